"""Which ranks meet around the engine's sleeps and wakes (`handover.handover_groups`, pure)."""

from __future__ import annotations

import pytest

from megatron_dapo.distributed.layout import ParallelLayout
from megatron_dapo.trainer.handover import ReplicaBarrier, handover_groups


def _layout(world: int, **sizes) -> ParallelLayout:
    return ParallelLayout(**sizes).resolve(world)


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_leader_placement_meets_per_replica_leader_first(engine):
    # tp 2 x pp 2, dp 2: Megatron's order puts TP innermost, then DP, then PP.
    assert handover_groups(_layout(8, tp=2, pp=2), engine) == [[0, 1, 4, 5], [2, 3, 6, 7]]
    assert handover_groups(_layout(4, tp=2, cp=2), engine) == [[0, 1, 2, 3]]


def test_no_meeting_where_no_engine_memory_is_on_another_rank():
    assert handover_groups(_layout(4, tp=1), "vllm") == []  # replicas of one rank
    assert handover_groups(_layout(4, tp=2), "embedded") == []  # in the leader's process, on its GPU
    spmd = ParallelLayout(tp=2, rollout_tp=2, placement="spmd").resolve(4)
    assert handover_groups(spmd, "vllm") == []  # each rank's shard on its own GPU, slept by its own thread


def test_a_barrier_without_a_group_returns_at_once():
    ReplicaBarrier().wait()
