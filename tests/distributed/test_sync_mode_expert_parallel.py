"""The weight-sync mode of an expert-parallel actor (`distributed/placement.py`, pure).

At parallel.ep > 1 a rank holds only its own experts, so the two modes that stream each rank's own
slices ("shared_memory", "tp_shards") cannot push the model: they are refused with a named error
naming the fix, at config load and in `choose_sync_mode`, and "auto" picks the gather path (whose
export moves the experts between expert-parallel ranks) for every engine and placement. Before this
rule, "auto" chose shared_memory for SGLang at TP > 1 and tp_shards for vLLM spmd with rollout TP =
actor TP, and the first push ended in a KeyError (a global expert id looked up among local ones).
The end-to-end checks at EP=2: tests/rollout/sync/test_check_sync_moe.py.
"""

from __future__ import annotations

import pytest

from megatron_dapo.config import ConfigError, load_config
from megatron_dapo.distributed.placement import PlacementError, check_sync_mode, choose_sync_mode


@pytest.mark.parametrize(
    "engine, placement, rollout_tp, device",
    [("sglang", "leader", None, "cpu"), ("vllm", "leader", None, "cuda"), ("embedded", "leader", None, "cpu"), ("vllm", "spmd", 2, "cuda")],
)
def test_auto_gathers_at_ep_above_one(engine, placement, rollout_tp, device):
    hosts = ["node0", "node0"] if placement == "leader" else []
    dense = choose_sync_mode("auto", 2, hosts, engine, device, placement=placement, rollout_tp=rollout_tp)
    moe = choose_sync_mode("auto", 2, hosts, engine, device, placement=placement, rollout_tp=rollout_tp, ep=2)
    assert dense in ("shared_memory", "tp_shards") and moe == "gather"  # the same layout without EP streams own slices


@pytest.mark.parametrize("mode, placement, rollout_tp", [("shared_memory", "leader", None), ("tp_shards", "spmd", 2)])
def test_shard_modes_are_refused_at_ep_above_one(mode, placement, rollout_tp):
    check_sync_mode(mode, placement, 2, rollout_tp, ep=1)  # fine without expert parallelism
    with pytest.raises(PlacementError) as error:
        check_sync_mode(mode, placement, 2, rollout_tp, ep=2)
    assert str(error.value) == (
        f"rollout.weight_sync_mode={mode} streams each rank's own slices, but at parallel.ep=2 a rank holds only its own "
        "experts: use auto or gather (the gather export moves the experts between expert-parallel ranks)"
    )
    hosts = ["node0", "node0"] if placement == "leader" else []
    with pytest.raises(PlacementError, match="use auto or gather"):
        choose_sync_mode(mode, 2, hosts, "vllm", "cpu", placement=placement, rollout_tp=rollout_tp, ep=2)
    assert choose_sync_mode("gather", 2, hosts, "vllm", "cpu", placement=placement, rollout_tp=rollout_tp, ep=2) == "gather"


def test_config_refuses_a_shard_mode_for_an_expert_parallel_actor():
    base = ["parallel.ep=2", "rollout.engine=vllm", "rollout.tp=1", "parallel.tp=1"]
    load_config(None, base + ["rollout.weight_sync_mode=auto"])
    with pytest.raises(ConfigError, match="rollout.weight_sync_mode=tp_shards streams each rank's own slices, but at parallel.ep=2"):
        load_config(None, base + ["rollout.weight_sync_mode=tp_shards"])
    with pytest.raises(ConfigError, match="rollout.weight_sync_mode=shared_memory .* parallel.ep=2"):
        load_config(None, base + ["rollout.placement=leader", "rollout.weight_sync_mode=shared_memory"])
