"""A short training run with `rollout.engine=sglang` through the real trainer (the CLI, the tiny demo
config, SGLang's CPU engine): two steps, the weights pushed into SGLang after each (one
weight-update session per sync), and the rollout / actor log-prob mismatch as small as the vLLM
run's (test_train_cli.py: float32 on both sides; a stale or partial push after step 1 would show
at step 2)."""

from __future__ import annotations

import pytest

from tests.support.trainer_runs import CONFIG, FAST, assert_ok, assert_weights_pushed_every_step, read_metrics, run_cli, workspace_overrides

pytestmark = pytest.mark.usefixtures("require_sglang")


def test_sglang_engine_trains_with_weight_sync_every_step(demo_workspace, tmp_path):
    out = tmp_path / "sglang"
    proc = run_cli("train", "--config", str(CONFIG), *FAST, "trainer.total_steps=2", "rollout.engine=sglang",
                   *workspace_overrides(demo_workspace, out), timeout=600)  # fmt: skip
    assert_ok(proc)
    assert_weights_pushed_every_step(read_metrics(out), steps=2)
