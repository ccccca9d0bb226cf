"""The config's rules for asynchronous training (`trainer.max_staleness`), each a named error."""

from __future__ import annotations

import pytest

from megatron_dapo.config import load_config
from megatron_dapo.errors import ConfigError

SEPARATE = ["rollout.placement=separate", "rollout.num_gpus=1"]


def test_synchronous_is_the_default_and_async_needs_the_separate_placement_and_a_correction():
    assert load_config(None, []).trainer.max_staleness == 0
    cfg = load_config(None, [*SEPARATE, "trainer.max_staleness=2", "algorithm.tis_cap=2"])
    assert cfg.trainer.max_staleness == 2
    load_config(None, [*SEPARATE, "trainer.max_staleness=1", "algorithm.mis.enable=true"])
    assert not cfg.rollout.partial_rollouts
    for engine in ("embedded", "vllm", "sglang"):
        load_config(None, [*SEPARATE, "trainer.max_staleness=1", "algorithm.tis_cap=2", "rollout.partial_rollouts=true", f"rollout.engine={engine}"])


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["trainer.max_staleness=-1"], "'trainer.max_staleness' must be an integer >= 0"),
        (["trainer.max_staleness=1", "algorithm.tis_cap=2"], "needs the engines on GPUs of their own: set rollout.placement=separate"),
        ([*SEPARATE, "trainer.max_staleness=1"], "set an off-policy correction, algorithm.tis_cap"),
        ([*SEPARATE, "trainer.max_staleness=1", "algorithm.tis_cap=2", "actor.router_replay=r3"], "use actor.router_replay=off or r2"),
        ([*SEPARATE, "trainer.max_staleness=1", "algorithm.tis_cap=2", "rollout.return_routed_experts=true"], "rollout.return_routed_experts=false"),
        ([*SEPARATE, "rollout.partial_rollouts=true"], "only happens with asynchronous training: set trainer.max_staleness >= 1"),
    ],
)
def test_what_async_training_refuses(overrides, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        load_config(None, overrides)
