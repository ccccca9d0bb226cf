"""SIGTERM during a step's generation, with the step's start saved: the batch is called off on every
rank, no further checkpoint is written, and `--resume` redoes the step (issue 26, item 4).

Two processes, one TP-2 replica: rank 0 (the leader) generates and scores, rank 1 waits in the
gather meeting. Checkpoints every step (`trainer.save_every=1`), so step 1's is on disk when step 2
begins. The reward function sends SIGTERM to both ranks, as SLURM does, while rank 0 scores step 2's
first generation batch (`sigterm_all_reward.py`); rank 1, waiting in the gather meeting, calls it
off, rank 0 finds it off when it arrives, both exit with 143 without another checkpoint, and the
resumed run's steps equal an uninterrupted run's. (A SIGTERM to rank 0 alone would let the meeting
complete, rank 0 being the last to arrive: then the step stops before its update, as before.)
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from tests.support.trainer_runs import CONFIG, FAST, assert_ok, cli, deterministic, read_metrics, workspace_overrides

REWARD = Path(__file__).with_name("sigterm_all_reward.py")
GEN_BATCH, N = 8, 2
SETTINGS = [
    *FAST, f"rollout.n={N}", f"trainer.gen_batch_size={GEN_BATCH}", f"trainer.train_batch_size={GEN_BATCH}",
    "trainer.total_steps=3", "trainer.save_every=1", "parallel.tp=2", f"reward.custom_function.path={REWARD}:compute_score",
]  # fmt: skip
CALLS_PER_BATCH = GEN_BATCH * N  # the leader scores every sample


def _train(output: Path, workspace, *extra: str, env: dict) -> subprocess.CompletedProcess:
    args = ["train", "--config", str(CONFIG), *SETTINGS, *workspace_overrides(workspace, output), *extra]
    return subprocess.run(cli(*args, nproc=2), cwd=CONFIG.parents[1], timeout=900, capture_output=True, text=True,
                          env={**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", **env})  # fmt: skip


def test_sigterm_in_generation_with_the_step_start_saved_calls_the_batch_off(demo_workspace, tmp_path):
    straight = tmp_path / "straight"
    assert_ok(_train(straight, demo_workspace, env={}))
    reference = read_metrics(straight)
    assert sorted(reference) == [1, 2, 3]
    before = CALLS_PER_BATCH * int(reference[1]["train/num_gen_batches"])
    sigterm_at = before + CALLS_PER_BATCH // 2  # half-way through scoring step 2's first batch

    stopped, calls = tmp_path / "stopped", tmp_path / "calls"
    proc = _train(stopped, demo_workspace, env={"MDAPO_TEST_REWARD_CALLS": str(calls), "MDAPO_TEST_SIGTERM_ALL_AT_CALL": str(sigterm_at)})
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0 and "exitcode  : 143" in output, output[-4000:]
    assert "SIGTERM during step 2's generation: called off at once; the checkpoint of step 1" in proc.stdout, output[-4000:]
    assert calls.stat().st_size == before + CALLS_PER_BATCH  # the batch's scoring ended, nothing after it
    assert (stopped / "checkpoints" / "latest").read_text().strip() == "step_00000001"
    assert sorted(read_metrics(stopped)) == [1]

    assert_ok(_train(stopped, demo_workspace, "--resume", env={}))
    resumed = read_metrics(stopped)
    for step in (1, 2, 3):
        a, b = deterministic(resumed[step]), deterministic(reference[step])
        problems = [f"{k}: {a.get(k)!r} vs {b.get(k)!r}" for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)]
        assert not problems, f"step {step} differs after the resume:\n" + "\n".join(problems[:20])
