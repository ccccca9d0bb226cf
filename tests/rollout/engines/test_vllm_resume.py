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

import math
import os
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.support.trainer_runs import CONFIG, FAST, cli, deterministic, read_metrics, stop_after_step, workspace_overrides

VLLM = ["rollout.engine=vllm", "trainer.total_steps=3"]


def _equal(x, y) -> bool:
    return x == y or (isinstance(x, float) and isinstance(y, float) and math.isnan(x) and math.isnan(y))


def _ok(proc: subprocess.CompletedProcess) -> None:
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"


def _popen(args: list[str], cpu: int, **kwargs) -> subprocess.Popen:
    """`megatron-dapo <args>` on one CPU with one OpenMP thread: the uninterrupted and the stopped run
    start together, one per core (a vLLM run keeps about one core busy, most of it start-up), and the
    runs compared (the resume included) compute with the same thread count."""
    proc = subprocess.Popen(cli(*args), cwd=Path(CONFIG).parents[1], text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}, **kwargs)  # fmt: skip
    os.sched_setaffinity(proc.pid, {cpu})  # before Python has started a thread or a process (inherited)
    return proc


def _run(args: list[str], cpu: int) -> subprocess.CompletedProcess:
    proc = _popen(args, cpu, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    stdout, stderr = proc.communicate(timeout=900)
    return subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)


def _run_stopped_after_step_1(args: list[str], output_dir: Path, cpu: int) -> subprocess.CompletedProcess:
    """The run, sent SIGTERM (SLURM preemption) once its metrics hold step 1; stdout and stderr together."""
    return stop_after_step(_popen(args, cpu, stdout=subprocess.PIPE, stderr=subprocess.STDOUT), output_dir, 1, timeout=900)


def _train_args(workspace, output_dir: Path) -> list[str]:
    return ["train", "--config", str(CONFIG), *FAST, *VLLM, *workspace_overrides(workspace, output_dir)]


CPUS = sorted(os.sched_getaffinity(0))


@pytest.fixture(scope="module")
def runs(demo_workspace, tmp_path_factory, require_vllm) -> dict[str, tuple[Path, subprocess.CompletedProcess]]:
    """Three uninterrupted steps, and the same run stopped after step 1, at once on two CPUs:
    name -> (output directory, process)."""
    root = tmp_path_factory.mktemp("vllm-resume")
    with ThreadPoolExecutor(max_workers=2) as pool:
        straight = pool.submit(_run, _train_args(demo_workspace, root / "straight"), CPUS[0])
        stopped = pool.submit(_run_stopped_after_step_1, _train_args(demo_workspace, root / "stopped"), root / "stopped", CPUS[-1])
    return {"straight": (root / "straight", straight.result()), "stopped": (root / "stopped", stopped.result())}


@pytest.fixture(scope="module")
def straight(runs) -> Path:
    """Three uninterrupted steps (the output directory)."""
    out, proc = runs["straight"]
    _ok(proc)
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


def test_sigterm_then_resume_equals_uninterrupted_with_vllm(demo_workspace, runs, straight):
    reference = read_metrics(straight)
    assert sorted(reference) == [1, 2, 3]

    stopped, proc = runs["stopped"]
    assert proc.returncode == 143, proc.stdout[-4000:]
    stopped_at = int((stopped / "checkpoints" / "latest").read_text().strip().split("_")[-1])
    assert stopped_at in (1, 2), stopped_at  # the signal lands during step 1's logging or step 2

    _ok(_run([*_train_args(demo_workspace, stopped), "--resume"], CPUS[0]))
    resumed = read_metrics(stopped)
    assert sorted(resumed) == [1, 2, 3]
    for step in range(stopped_at + 1, 4):
        a, b = deterministic(resumed[step]), deterministic(reference[step])
        problems = [f"{k}: {a.get(k)!r} vs {b.get(k)!r}" for k in sorted(set(a) | set(b)) if not _equal(a.get(k), b.get(k))]
        assert not problems, f"step {step} differs after resume:\n" + "\n".join(problems[:20])
