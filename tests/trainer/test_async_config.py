"""The config's rules for asynchronous training (`trainer.max_staleness`), each a named error."""

from __future__ import annotations

import pytest

from megatron_dapo.config import engine_returns_routing, load_config
from megatron_dapo.errors import ConfigError

SEPARATE = ["rollout.placement=separate", "rollout.num_gpus=1"]
PARTIAL = [*SEPARATE, "trainer.max_staleness=1", "algorithm.tis_cap=2", "rollout.partial_rollouts=true"]


def test_synchronous_is_the_default_and_async_needs_the_separate_placement_and_a_correction():
    assert load_config(None, []).trainer.max_staleness == 0
    cfg = load_config(None, [*SEPARATE, "trainer.max_staleness=2", "algorithm.tis_cap=2"])
    assert cfg.trainer.max_staleness == 2
    load_config(None, [*SEPARATE, "trainer.max_staleness=1", "algorithm.mis.enable=true"])
    assert not cfg.rollout.partial_rollouts
    for engine in ("embedded", "vllm", "sglang"):
        load_config(None, [*PARTIAL, f"rollout.engine={engine}"])
    # MoE routing replay: the engine's routing of carried groups is kept and saved with a checkpoint.
    for routing in ("actor.router_replay=r3", "rollout.return_routed_experts=true"):
        load_config(None, [*SEPARATE, "trainer.max_staleness=1", "algorithm.tis_cap=2", routing])


def test_the_embedded_engine_records_no_routing_with_partial_rollouts():
    assert engine_returns_routing(load_config(None, [*SEPARATE, "trainer.max_staleness=1", "algorithm.tis_cap=2"]), is_moe=True)
    assert not engine_returns_routing(load_config(None, PARTIAL), is_moe=True)
    assert engine_returns_routing(load_config(None, [*SEPARATE, "trainer.max_staleness=1", "algorithm.tis_cap=2", "actor.router_replay=r3"]), is_moe=True)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["trainer.max_staleness=-1"], "'trainer.max_staleness' must be an integer >= 0"),
        (["trainer.max_staleness=1", "algorithm.tis_cap=2"], "needs the engines on GPUs of their own: set rollout.placement=separate"),
        ([*SEPARATE, "trainer.max_staleness=1"], "set an off-policy correction, algorithm.tis_cap"),
        ([*PARTIAL, "actor.router_replay=r3"], "no engine records the routed experts of a response across a push: use actor.router_replay=off or r2"),
        ([*PARTIAL, "rollout.return_routed_experts=true"], "rollout.return_routed_experts=false with partial rollouts"),
        ([*SEPARATE, "rollout.partial_rollouts=true"], "only happens with asynchronous training: set trainer.max_staleness >= 1"),
    ],
)
def test_what_async_training_refuses(overrides, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        load_config(None, overrides)
