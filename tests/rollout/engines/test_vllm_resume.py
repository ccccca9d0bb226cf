"""The demo with `rollout.engine=vllm` (vLLM's CPU build, spmd placement, one process).

The uninterrupted run (three steps) trains with a weight push after every step, and the engine's
log-probs stay those of the actor. The same run stopped by SIGTERM and resumed equals it, on
training's default seeding (`rollout.seed_per_prompt=false`: each generation batch reseeds the
engine's sampler from (rollout.seed, step, batch, engine)). Every logged value that is not a
wall-clock time must repeat, the rollout's response lengths and scores included.
(That a reseeded engine repeats itself whatever ran before, and a fresh engine repeats it too, is
shown on the engine itself in test_vllm_seeds.py; here the trainer's checkpointed RNG would also
carry an in-process engine's stream across the resume.)
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from tests.trainer.conftest import CONFIG, FAST, cli, deterministic, read_metrics, run_cli, workspace_overrides

VLLM = ["rollout.engine=vllm", "trainer.total_steps=3"]


@pytest.fixture(scope="module")
def workspace(tmp_path_factory) -> dict[str, Path]:
    from megatron_dapo.cli.demo import prepare_workspace

    return prepare_workspace(tmp_path_factory.mktemp("vllm-resume-workspace"), seed=7, num_train=200, num_val=8)


def _equal(x, y) -> bool:
    return x == y or (isinstance(x, float) and isinstance(y, float) and math.isnan(x) and math.isnan(y))


def _ok(proc: subprocess.CompletedProcess) -> None:
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"


@pytest.fixture(scope="module")
def straight(workspace, tmp_path_factory, require_vllm) -> Path:
    """Three uninterrupted steps (the output directory)."""
    out = tmp_path_factory.mktemp("vllm-straight") / "run"
    _ok(run_cli("train", "--config", str(CONFIG), *FAST, *VLLM, *workspace_overrides(workspace, out), timeout=900))
    return out


def test_vllm_engine_trains_with_weight_sync_every_step(straight):
    metrics = read_metrics(straight)
    assert sorted(metrics) == [1, 2, 3]
    for step in metrics:
        assert metrics[step]["train/num_groups_generated"] == 8 * metrics[step]["train/num_gen_batches"]
        # The engine's sampled-token log-probs against the actor's, float32 on both sides: a stale or
        # wrong weight push after a step would show up as a large mismatch at the next.
        assert metrics[step]["rollout_mismatch/mean_abs"] < 1e-3, metrics[step]
        assert metrics[step]["weight_sync/seconds"] > 0


def test_sigterm_then_resume_equals_uninterrupted_with_vllm(workspace, straight, tmp_path):
    reference = read_metrics(straight)
    assert sorted(reference) == [1, 2, 3]

    stopped = tmp_path / "stopped"
    args = ["train", "--config", str(CONFIG), *FAST, *VLLM, *workspace_overrides(workspace, stopped)]
    proc = subprocess.Popen(cli(*args), cwd=Path(CONFIG).parents[1], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})  # fmt: skip
    metrics_file = stopped / "metrics.jsonl"
    deadline = time.monotonic() + 900
    while time.monotonic() < deadline and proc.poll() is None:
        if metrics_file.exists() and any(json.loads(l)["step"] == 1 for l in metrics_file.read_text().splitlines() if l.strip()):
            proc.send_signal(signal.SIGTERM)
            break
        time.sleep(0.2)
    output, _ = proc.communicate(timeout=900)
    assert proc.returncode == 143, output[-4000:]
    stopped_at = int((stopped / "checkpoints" / "latest").read_text().strip().split("_")[-1])
    assert stopped_at in (1, 2), stopped_at  # the signal lands during step 1's logging or step 2

    _ok(run_cli(*args, "--resume", timeout=900))
    resumed = read_metrics(stopped)
    assert sorted(resumed) == [1, 2, 3]
    for step in range(stopped_at + 1, 4):
        a, b = deterministic(resumed[step]), deterministic(reference[step])
        problems = [f"{k}: {a.get(k)!r} vs {b.get(k)!r}" for k in sorted(set(a) | set(b)) if not _equal(a.get(k), b.get(k))]
        assert not problems, f"step {step} differs after resume:\n" + "\n".join(problems[:20])
