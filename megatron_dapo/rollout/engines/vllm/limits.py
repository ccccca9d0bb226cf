"""What vLLM's CPU build cannot do, said as a config error: pure, no torch or vLLM import.

vLLM returns each token's routed experts (rollout routing replay) through its auxiliary-output
connector, which needs the V2 model runner, which needs Triton: the CPU build cannot
(`engine.routed_experts_settings`). The trainer's pre-flight refuses such a config before the
model loads (`trainer.startup.check_engine_device`); the engine refuses it again when it starts, as
a last guard, with the same error.
"""

from __future__ import annotations

from typing import Sequence

from megatron_dapo.errors import ConfigError

ROUTED_EXPERTS_KEYS = ("actor.router_replay=r3", "rollout.return_routed_experts=true")
"""The settings that ask the engine for routed experts on a mixture-of-experts model."""


class RoutedExpertsOnCPUError(ConfigError):
    """vLLM was asked for routed experts where it runs its CPU build."""


def routed_experts_on_cpu_error(asked_by: Sequence[str] = ROUTED_EXPERTS_KEYS) -> RoutedExpertsOnCPUError:
    """The error for `asked_by`, the settings that ask for routed experts (default: either of them)."""
    return RoutedExpertsOnCPUError(
        f"{' / '.join(asked_by)} asks rollout.engine=vllm for the routed experts of this mixture-of-experts model, "
        "but without a GPU vLLM runs its CPU build, which cannot return routed experts (its V2 model runner needs "
        "Triton): on a CPU set rollout.engine=embedded (it returns them on every MoE model), or run on GPUs"
    )
