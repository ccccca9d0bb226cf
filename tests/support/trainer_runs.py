"""The trainer's CLI as the trainer tests run it: a subprocess (or ranks forked from the zygote),
small fixed-size steps (FAST), the demo workspace's overrides, and checks of the metrics it writes.

The workspaces themselves are fixtures (`demo_workspace`, `moe_workspace` in tests/conftest.py).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from tests.support.torchrun_utils import launch_slot, run_module_forked

REPO = Path(__file__).resolve().parents[2]
CONFIG = REPO / "configs" / "tiny_cpu.yaml"
PARITY_REWARD = REPO / "tests" / "trainer" / "parity_reward.py"

# Small, fixed-size steps (a few seconds each on 2 cores).
FAST = [
    "rollout.n=4",
    "rollout.max_response_length=16",
    "algorithm.overlong_buffer.len=4",
    "trainer.gen_batch_size=8",
    "trainer.train_batch_size=4",
    "trainer.ppo_mini_batch_size=2",
    "trainer.micro_batch_size=4",
    "trainer.eval_every=0",
    "trainer.val_before_train=false",
    "trainer.save_every=0",
    "trainer.loggers=[console,jsonl]",
    "reward.num_workers=1",
    f"reward.custom_function.path={PARITY_REWARD}:compute_score",
]


def workspace_overrides(paths: dict[str, Path], output_dir: Path) -> list[str]:
    return [
        f"model.hf_dir={paths['model']}",
        f"data.train_files=[{paths['train']}]",
        f"data.val_files=[{paths['val']}]",
        f"trainer.output_dir={output_dir}",
    ]


def cli(*args: str, nproc: int = 1) -> list[str]:
    if nproc == 1:
        return [sys.executable, "-m", "megatron_dapo.cli", *args]
    from megatron_dapo.distributed.launch import find_free_port

    return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--master_addr", "127.0.0.1",
            "--master_port", str(find_free_port()), "-m", "megatron_dapo.cli", *args]  # fmt: skip


def run_cli(*args: str, nproc: int = 1, timeout: float = 300, threads: int | None = None) -> subprocess.CompletedProcess:
    """The CLI in a subprocess. `threads`: OpenMP threads per process (default: 1 for several
    processes, else the caller's or 2); give 1 to runs that start two at a time, and the same count
    to runs whose values are compared exactly."""
    if threads is None:
        threads = 1 if nproc > 1 else int(os.environ.get("OMP_NUM_THREADS", "2"))
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": str(threads)}
    forked = run_module_forked("megatron_dapo.cli", args, nproc, env, cwd=REPO, timeout=timeout)  # the launch's ranks, preloaded
    if forked is not None:
        return forked
    with launch_slot():
        return subprocess.run(cli(*args, nproc=nproc), cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)


def stop_after_step(proc: subprocess.Popen, output_dir: Path, step: int, timeout: float) -> subprocess.CompletedProcess:
    """Send the run `proc` SIGTERM (SLURM preemption) once its metrics hold `step`, then wait for it.
    `proc` was opened with stdout=PIPE, stderr=STDOUT: its output comes back as stdout."""
    metrics_file = output_dir / "metrics.jsonl"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        if metrics_file.exists() and any(json.loads(l)["step"] == step for l in metrics_file.read_text().splitlines() if l.strip()):
            proc.send_signal(signal.SIGTERM)
            break
        time.sleep(0.2)
    output, _ = proc.communicate(timeout=timeout)
    return subprocess.CompletedProcess(proc.args, proc.returncode, output, "")


def read_metrics(output_dir: Path) -> dict[int, dict]:
    by_step: dict[int, dict] = {}
    for line in (output_dir / "metrics.jsonl").read_text().splitlines():
        if line.strip():
            record = json.loads(line)
            by_step.setdefault(record["step"], {}).update(record)
    return by_step


def deterministic(metrics: dict) -> dict:
    """The metrics that must repeat exactly (not wall-clock ones)."""
    from megatron_dapo.trainer.metrics import is_wall_clock

    return {k: v for k, v in metrics.items() if not is_wall_clock(k)}


def assert_ok(proc: subprocess.CompletedProcess, code: int = 0) -> None:
    """`proc` exited with `code`; else the failure shows the ends of its output."""
    assert proc.returncode == code, f"exit {proc.returncode}\n--- stdout\n{proc.stdout[-4000:]}\n--- stderr\n{proc.stderr[-6000:]}"


def assert_weights_pushed_every_step(metrics: dict[int, dict], steps: int, gen_batch_size: int = 8) -> None:
    """Each of `steps` steps pooled whole generation batches and pushed the weights into the engine,
    and the engine's sampled-token log-probs match the actor's (float32 on both sides): a stale or
    partial push after step 1 would show up as a large mismatch at step 2."""
    assert sorted(metrics) == list(range(1, steps + 1))
    for step in metrics:
        assert metrics[step]["train/num_groups_generated"] == gen_batch_size * metrics[step]["train/num_gen_batches"]
        assert metrics[step]["rollout_mismatch/mean_abs"] < 1e-3, metrics[step]
        assert metrics[step]["weight_sync/seconds"] > 0


def checkpoint_state(checkpoint: Path) -> dict:
    """Everything in a checkpoint's distributed state (model, optimizer, scheduler), as plain tensors."""
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    target = checkpoint / "flat.pt"
    dcp_to_torch_save(checkpoint / "dist", target)
    state = torch.load(target, weights_only=False)
    target.unlink()
    return state


def state_differences(a, b, path: str = "") -> list[str]:
    """Where two nested states (dicts, lists, tensors, values) differ; tensors bit for bit."""
    if isinstance(a, dict) and isinstance(b, dict):
        if set(a) != set(b):
            return [f"{path}: keys {sorted(set(a) ^ set(b))[:5]}"]
        return [d for key in a for d in state_differences(a[key], b[key], f"{path}/{key}")]
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)) and len(a) == len(b):
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in state_differences(x, y, f"{path}[{i}]")]
    import torch

    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        same = a.shape == b.shape and a.dtype == b.dtype and torch.equal(a, b)
        return [] if same else [f"{path}: tensors differ"]
    return [] if a == b else [f"{path}: {a!r} vs {b!r}"]
