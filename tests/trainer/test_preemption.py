"""SIGTERM in the middle of a step and during start-up (issue 17, items 5 and 9).

The SIGTERM is sent by the reward function itself (`preempt_reward.py`) on its N-th call, so it
lands while a chosen generation batch is being scored: a point fixed by the data, not by timing.

* mid-step: the run leaves after that generation batch (no further sample is scored) with exit code
  143 and a checkpoint of the state at the step's start (the previous step; prompt sampler and RNG
  put back); `--resume` redoes the step, and every step's metrics and the final weights and
  optimizer state equal those of an uninterrupted run, bit for bit. The step chosen generates more
  than one batch in the uninterrupted run, so stopping at the end of the step would score more
  samples than the test allows, and stopping with the sampler where it was mid-step would change
  the redone step's prompts (the metrics would differ).
* start-up: SIGTERM while the trainer is being built (model loaded, process groups up, engine not yet
  started) ends the process with exit code 143 and one line, not a traceback or a signal death.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from tests.support.trainer_runs import (
    CONFIG, FAST, assert_ok, checkpoint_state, cli, deterministic, read_metrics, state_differences, workspace_overrides,
)  # fmt: skip

REWARD = Path(__file__).with_name("preempt_reward.py")
GEN_BATCH, N = 8, 2
# Every prompt group must have mixed rewards for a step to fill from one generation batch: with
# 2 responses per prompt and train batch = generation batch = 8 prompts that almost never happens,
# so steps take several generation batches.
SETTINGS = [
    *FAST,
    f"rollout.n={N}",
    f"trainer.gen_batch_size={GEN_BATCH}",
    f"trainer.train_batch_size={GEN_BATCH}",
    "trainer.total_steps=3",
    "trainer.save_every=3",
    f"reward.custom_function.path={REWARD}:compute_score",
]
CALLS_PER_BATCH = GEN_BATCH * N  # one process scores every sample


def _train(output: Path, workspace, *extra: str, env: dict) -> subprocess.CompletedProcess:
    args = ["train", "--config", str(CONFIG), *SETTINGS, *workspace_overrides(workspace, output), *extra]
    return subprocess.run(cli(*args), cwd=CONFIG.parents[1], env={**os.environ, "PYTHONUNBUFFERED": "1", **env},
                          capture_output=True, text=True, timeout=600)  # fmt: skip


def test_sigterm_during_generation_redoes_the_step_on_resume(demo_workspace, tmp_path):
    straight = tmp_path / "straight"
    straight_calls = tmp_path / "straight_calls"
    assert_ok(_train(straight, demo_workspace, env={"MDAPO_TEST_REWARD_CALLS": str(straight_calls)}))
    reference = read_metrics(straight)
    assert sorted(reference) == [1, 2, 3]
    batches = {step: int(reference[step]["train/num_gen_batches"]) for step in reference}
    assert straight_calls.stat().st_size == CALLS_PER_BATCH * sum(batches.values())  # one call per sample
    # The first step after step 1 that needs more than one generation batch: SIGTERM in its first batch.
    step = next((s for s in (2, 3) if batches[s] > 1), None)
    assert step is not None, f"every step filled from one generation batch ({batches}): the test needs more"
    before = CALLS_PER_BATCH * sum(batches[s] for s in range(1, step))
    sigterm_at = before + CALLS_PER_BATCH // 2 + 1  # half-way through scoring the step's first batch

    stopped = tmp_path / "stopped"
    calls = tmp_path / "calls"
    env = {"MDAPO_TEST_REWARD_CALLS": str(calls), "MDAPO_TEST_SIGTERM_AT_CALL": str(sigterm_at)}
    proc = _train(stopped, demo_workspace, env=env)
    assert_ok(proc, 143)
    # It left after the batch during which SIGTERM came: the rest of that batch was scored, nothing more.
    assert calls.stat().st_size == before + CALLS_PER_BATCH, (calls.stat().st_size, before, batches)
    assert f"during step {step}, before its update: checkpoint of step {step - 1} written" in proc.stdout, proc.stdout[-3000:]
    assert (stopped / "checkpoints" / "latest").read_text().strip() == f"step_{step - 1:08d}"
    assert sorted(read_metrics(stopped)) == list(range(1, step))  # the interrupted step was not logged

    assert_ok(_train(stopped, demo_workspace, "--resume", env={"MDAPO_TEST_REWARD_CALLS": str(calls)}))
    resumed = read_metrics(stopped)
    assert sorted(resumed) == [1, 2, 3]
    for s in (1, 2, 3):
        a, b = deterministic(resumed[s]), deterministic(reference[s])
        problems = [f"{k}: {a.get(k)!r} vs {b.get(k)!r}" for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)]
        assert not problems, f"step {s} differs after the resume:\n" + "\n".join(problems[:20])
    problems = state_differences(
        checkpoint_state(stopped / "checkpoints" / "step_00000003"), checkpoint_state(straight / "checkpoints" / "step_00000003")
    )
    assert not problems, "final weights / optimizer state differ:\n" + "\n".join(problems[:20])


def test_sigterm_during_start_up_exits_143_with_one_line(demo_workspace, tmp_path):
    out = tmp_path / "run"
    proc = _train(out, demo_workspace, env={"MDAPO_TEST_SIGTERM_ON_LOAD": "1"})
    assert_ok(proc, 143)
    text = proc.stdout + proc.stderr
    assert "Traceback" not in text, text[-4000:]
    lines = [line for line in text.splitlines() if "SIGTERM" in line]
    assert len(lines) == 1 and "stopped by SIGTERM" in lines[0] and "143" in lines[0], text[-4000:]
    assert not (out / "checkpoints").exists()
