"""A preemption through real SLURM with vLLM in the leader placement (issue 26, item 4).

`scancel --signal=TERM` reaches every process of the job step: the trainer, its reward workers
(which ignore it) and the vLLM engine core, a process of its own in the leader placement, which
used to exit on it at once, so that the trainer's exit save found a dead engine (or the running
`generate` failed). The engine's processes now keep SIGTERM blocked (`process_state.
sigterm_ignored_by_new_processes`) and the exit save needs no engine.

One task, the tiny demo model, the actor offloaded with `rollout.sleep_level=2` (as the GPU
recipes run: a save takes the GPU from the engine and, before this fix, pushed the weights back
into it afterwards). The SIGTERM is sent when the reward function marks that step 2's first
generation batch is being scored (`preempt_mark_reward.py`, which then pauses so the signal lands
during scoring). The job must exit with 143 after writing the checkpoint of step 1, and a resumed
job must log steps equal to an uninterrupted job's.
"""

from __future__ import annotations

import json
import re
import textwrap
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.slurm

REPO_ROOT = Path(__file__).resolve().parents[2]
CONFIG = REPO_ROOT / "configs" / "tiny_cpu.yaml"
REWARD = Path(__file__).with_name("preempt_mark_reward.py")
GEN_BATCH, N = 8, 2
SETTINGS = [
    "rollout.engine=vllm", "rollout.placement=leader", "rollout.seed_per_prompt=true",
    f"rollout.n={N}", "rollout.max_response_length=16", "algorithm.overlong_buffer.len=4",
    f"trainer.gen_batch_size={GEN_BATCH}", f"trainer.train_batch_size={GEN_BATCH}", "trainer.ppo_mini_batch_size=4",
    "trainer.micro_batch_size=4", "trainer.eval_every=0", "trainer.val_before_train=false", "trainer.total_steps=3",
    "trainer.save_every=3", "trainer.loggers=[console,jsonl]", "reward.num_workers=1",
    f"reward.custom_function.path={REWARD}:compute_score",
    "actor.offload_params=true", "actor.offload_grads=true", "actor.offload_optimizer=true", "rollout.sleep_level=2",
]  # fmt: skip
CALLS_PER_BATCH = GEN_BATCH * N

_JOB = """\
#!/bin/bash
#SBATCH --nodes=1
#SBATCH --ntasks=1
#SBATCH --cpus-per-task=2
#SBATCH --time=00:20:00
set -euo pipefail
source "${SLURM_SUBMIT_DIR}/slurm/common.sh"
dapo_setup
dapo_srun python -m megatron_dapo.cli train "$@"
"""


def _args(workspace: dict[str, Path], output: Path, *extra: str) -> list[str]:
    where = [f"model.hf_dir={workspace['model']}", f"data.train_files=[{workspace['train']}]",
             f"data.val_files=[{workspace['val']}]", f"trainer.output_dir={output}"]  # fmt: skip
    return ["--config", str(CONFIG), *SETTINGS, *where, *extra]


def _metrics(output: Path) -> dict[int, dict]:
    from megatron_dapo.trainer.metrics import is_wall_clock

    by_step: dict[int, dict] = {}
    for line in (output / "metrics.jsonl").read_text().splitlines():
        if line.strip():
            record = json.loads(line)
            by_step.setdefault(record["step"], {}).update({k: v for k, v in record.items() if not is_wall_clock(k)})
    return by_step


def test_scancel_sigterm_with_a_leader_vllm_engine_checkpoints_and_resumes_equal(slurm_cluster, demo_workspace, tmp_path):
    script = tmp_path / "train.sbatch"
    script.write_text(textwrap.dedent(_JOB))
    env = {"DAPO_DOCTOR": "0", "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "2"}

    straight = tmp_path / "straight"
    job = slurm_cluster.submit(script, args=_args(demo_workspace, straight), cwd=REPO_ROOT, env=env, timeout_s=900)
    job.assert_completed()
    reference = _metrics(straight)
    assert sorted(reference) == [1, 2, 3], job.describe()
    # The SIGTERM lands half-way through scoring step 2's first generation batch.
    mark_at = CALLS_PER_BATCH * int(reference[1]["train/num_gen_batches"]) + CALLS_PER_BATCH // 2

    stopped, mark = tmp_path / "stopped", tmp_path / "mark"
    marking = {**env, "MDAPO_TEST_REWARD_CALLS": str(tmp_path / "calls"), "MDAPO_TEST_MARK": str(mark),
               "MDAPO_TEST_MARK_AT_CALL": str(mark_at)}  # fmt: skip
    submission = slurm_cluster.submit_async(script, args=_args(demo_workspace, stopped), cwd=REPO_ROOT, env=marking)
    job_id = submission.wait_until_running(timeout_s=120)
    deadline = time.monotonic() + 600
    while not mark.exists() and time.monotonic() < deadline and submission.proc.poll() is None:
        time.sleep(0.1)
    assert mark.exists(), submission.wait(timeout_s=60).describe()
    slurm_cluster.run("scancel", "--signal=TERM", str(job_id))
    sent = time.monotonic()
    job = submission.wait(timeout_s=600)
    to_exit_s = time.monotonic() - sent
    output = job.output()
    assert job.exit_code == "143:0", job.describe()
    assert "SIGTERM during step 2, before its update: checkpoint of step 1 written" in output, job.describe()
    assert (stopped / "checkpoints" / "latest").read_text().strip() == "step_00000001"
    seconds = re.search(r"(\d+\.\d+) s after the SIGTERM", output)
    print(f"\nSIGTERM to job end: {to_exit_s:.1f} s (scancel to sbatch's return); trainer: {seconds and seconds.group(1)} s")

    resumed_job = slurm_cluster.submit(script, args=_args(demo_workspace, stopped, "--resume"), cwd=REPO_ROOT, env=env, timeout_s=900)
    resumed_job.assert_completed()
    resumed = _metrics(stopped)
    assert sorted(resumed) == [1, 2, 3]
    for step in (1, 2, 3):
        a, b = resumed[step], reference[step]
        problems = [f"{k}: {a.get(k)!r} vs {b.get(k)!r}" for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)]
        assert not problems, f"step {step} differs after the resume:\n" + "\n".join(problems[:20])
