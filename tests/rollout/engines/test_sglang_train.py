"""A short training run with `rollout.engine=sglang` through the real trainer (the CLI, the tiny demo
config, SGLang's CPU engine): two steps, the weights pushed into SGLang after each (one
weight-update session per sync), and the rollout / actor log-prob mismatch as small as the vLLM
run's (tests/trainer/test_train_cli.py: float32 on both sides; a stale or partial push after step 1
would show at step 2)."""

from __future__ import annotations

import pytest

from tests.trainer.conftest import CONFIG, FAST, read_metrics, run_cli, workspace_overrides

pytestmark = pytest.mark.usefixtures("require_sglang")


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    from megatron_dapo.cli.demo import prepare_workspace

    return prepare_workspace(tmp_path_factory.mktemp("demo-workspace"), seed=7, num_train=200, num_val=8)


def test_sglang_engine_trains_with_weight_sync_every_step(workspace, tmp_path):
    out = tmp_path / "sglang"
    proc = run_cli("train", "--config", str(CONFIG), *FAST, "trainer.total_steps=2", "rollout.engine=sglang",
                   *workspace_overrides(workspace, out), timeout=600)  # fmt: skip
    assert proc.returncode == 0, f"exit {proc.returncode}\n--- stdout\n{proc.stdout[-4000:]}\n--- stderr\n{proc.stderr[-6000:]}"
    metrics = read_metrics(out)
    assert sorted(metrics) == [1, 2]
    for step in (1, 2):
        assert metrics[step]["train/num_groups_generated"] == 8 * metrics[step]["train/num_gen_batches"]
        assert metrics[step]["rollout_mismatch/mean_abs"] < 1e-3, metrics[step]
        assert metrics[step]["weight_sync/seconds"] > 0
