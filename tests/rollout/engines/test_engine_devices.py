"""Which GPUs each rollout engine computes on (`placement.assign_engine_devices`), for node / TP shapes
of real launches. Rank layouts come from Megatron-Core's own `RankGenerator` (the order
"tp-cp-ep-dp-pp" that `initialize_model_parallel` uses), so the replicas are the ones a run builds.

Launch shapes: torchrun / srun with every task seeing all GPUs of its node and rank r on GPU
r % gpus_per_node (the sbatch scripts), a node whose CUDA_VISIBLE_DEVICES lists other GPU ids, and
srun --gpus-per-task=1 (each task sees one GPU).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from megatron.core.parallel_state import RankGenerator

from megatron_dapo.distributed.placement import (
    EngineDevices,
    PlacementError,
    RankGpu,
    SpmdSlot,
    assign_engine_devices,
    replica_groups,
)
from tests.support.torchrun_utils import run_torchrun_function


def torchrun_ranks(nodes: int, gpus_per_node: int = 8, visible: tuple[str, ...] = ()) -> list[RankGpu]:
    """Every task sees all GPUs of its node (`visible`, default "0".."n-1") and uses the local rank's."""
    ids = visible or tuple(str(i) for i in range(gpus_per_node))
    return [RankGpu(f"node{r // gpus_per_node}", ids, r % gpus_per_node) for r in range(nodes * gpus_per_node)]


def megatron_coordinates(world: int, tp: int, pp: int = 1, cp: int = 1) -> list[tuple[int, int, int, int]]:
    """(DP, PP, CP, TP) rank of every global rank, as Megatron-Core lays out its groups."""
    dp = world // (tp * pp * cp)
    generator = RankGenerator(tp=tp, ep=1, dp=dp, pp=pp, cp=cp, order="tp-cp-ep-dp-pp")
    coordinates = [[0, 0, 0, 0] for _ in range(world)]
    for slot, token in enumerate(("dp", "pp", "cp", "tp")):
        for group in generator.get_ranks(token):
            for position, rank in enumerate(group):
                coordinates[rank][slot] = position
    return [tuple(c) for c in coordinates]


def leader_engines(engine: str, rollout_tp: int, nodes: int, tp: int, pp: int = 1, cp: int = 1, **kwargs) -> list[EngineDevices]:
    ranks = torchrun_ranks(nodes, **kwargs)
    groups = replica_groups(megatron_coordinates(len(ranks), tp, pp, cp))
    return assign_engine_devices("leader", engine, rollout_tp, ranks, groups)


def spmd_engines(rollout_tp: int, ranks: list[RankGpu]) -> list[EngineDevices]:
    groups = [SpmdSlot(first, len(ranks), rollout_tp).group_ranks for first in range(0, len(ranks), rollout_tp)]
    return assign_engine_devices("spmd", "vllm", rollout_tp, ranks, groups)


def test_replica_groups_put_the_leader_first():
    assert megatron_coordinates(8, tp=2, pp=2)[:4] == [(0, 0, 0, 0), (0, 0, 0, 1), (1, 0, 0, 0), (1, 0, 0, 1)]
    assert replica_groups(megatron_coordinates(8, tp=2, pp=2)) == [[0, 1, 4, 5], [2, 3, 6, 7]]
    assert replica_groups(megatron_coordinates(8, tp=4)) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert replica_groups(megatron_coordinates(8, tp=2, cp=2)) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert replica_groups([(1, 0, 0, 1), (1, 0, 0, 0), (0, 0, 0, 0)]) == [[2], [1, 0]]


@pytest.mark.parametrize("rollout_tp", [1, 2, 4, 8])
def test_spmd_engines_use_their_ranks_gpus(rollout_tp):
    engines = spmd_engines(rollout_tp, torchrun_ranks(nodes=1))
    assert len(engines) == 8 // rollout_tp
    for k, engine in enumerate(engines):
        gpus = tuple(range(k * rollout_tp, (k + 1) * rollout_tp))
        assert engine.owner == gpus[0] and engine.ranks == gpus
        assert engine.indices == gpus and engine.gpus == tuple(map(str, gpus))


def test_spmd_on_two_nodes_and_with_one_gpu_per_task():
    engines = spmd_engines(4, torchrun_ranks(nodes=2))
    assert [(e.node, e.indices) for e in engines] == [
        ("node0", (0, 1, 2, 3)), ("node0", (4, 5, 6, 7)), ("node1", (0, 1, 2, 3)), ("node1", (4, 5, 6, 7))
    ]  # fmt: skip
    # srun --gpus-per-task=1: every process calls its GPU cuda:0; the node-wide ids tell them apart.
    one_each = [RankGpu("node0", (str(r),), 0) for r in range(8)]
    engines = spmd_engines(2, one_each)
    assert [e.gpus for e in engines] == [("0", "1"), ("2", "3"), ("4", "5"), ("6", "7")]
    assert {e.indices for e in engines} == {(0, 0)}


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_leader_engines_of_the_7b_recipe_take_their_replicas_gpus(engine):
    """Actor TP 4, two replicas per node, rollout.tp 2 (the 7B recipe with engine=sglang): the leaders
    at local ranks 0 and 4 start on GPUs 0-1 and 4-5, not both on 0-1."""
    engines = leader_engines(engine, rollout_tp=2, nodes=1, tp=4)
    assert [(e.owner, e.indices, e.base_gpu_id, e.gpu_id_step) for e in engines] == [(0, (0, 1), 0, 1), (4, (4, 5), 4, 1)]
    assert [e.cuda_visible_devices for e in engines] == ["0,1", "4,5"]


@pytest.mark.parametrize("rollout_tp", [1, 2, 4, 8])
def test_leader_engines_for_each_rollout_tp(rollout_tp):
    """8 GPUs per node, two nodes, actor TP 8 (the 32B recipe's shape): one replica per node."""
    engines = leader_engines("vllm", rollout_tp, nodes=2, tp=8)
    assert [(e.owner, e.node, e.indices) for e in engines] == [
        (0, "node0", tuple(range(rollout_tp))), (8, "node1", tuple(range(rollout_tp)))
    ]  # fmt: skip


def test_leader_engines_across_pipeline_stages_and_context_parallelism():
    # TP 2 x PP 2 on 8 GPUs: replica 0 holds ranks 0, 1 (stage 0) and 4, 5 (stage 1).
    engines = leader_engines("vllm", rollout_tp=4, nodes=1, tp=2, pp=2)
    assert [e.indices for e in engines] == [(0, 1, 4, 5), (2, 3, 6, 7)]
    assert engines[0].cuda_visible_devices == "0,1,4,5"
    assert [e.indices for e in leader_engines("vllm", rollout_tp=2, nodes=1, tp=2, pp=2)] == [(0, 1), (2, 3)]
    # SGLang addresses GPUs as base + i * step: 0, 1, 4, 5 is refused, 0, 1 is fine.
    with pytest.raises(PlacementError, match="not evenly spaced"):
        leader_engines("sglang", rollout_tp=4, nodes=1, tp=2, pp=2)
    assert [e.base_gpu_id for e in leader_engines("sglang", rollout_tp=2, nodes=1, tp=2, pp=2)] == [0, 2]
    # TP 2 x CP 2: the first stage's TP x CP ranks are the replica's first GPUs.
    assert [e.indices for e in leader_engines("sglang", rollout_tp=4, nodes=1, tp=2, cp=2)] == [(0, 1, 2, 3), (4, 5, 6, 7)]


def test_a_replica_spanning_two_nodes_uses_the_leaders_node():
    # TP 8 x PP 2 on two 8-GPU nodes: one replica, stage 0 on node0, stage 1 on node1.
    engines = leader_engines("vllm", rollout_tp=8, nodes=2, tp=8, pp=2)
    assert [(e.owner, e.node, e.indices) for e in engines] == [(0, "node0", tuple(range(8)))]
    with pytest.raises(PlacementError, match="has 8 on node0"):
        leader_engines("vllm", rollout_tp=16, nodes=2, tp=8, pp=2)


def test_an_engine_larger_than_its_replica_is_refused():
    # Actor TP 2: four replicas per node; a rollout.tp=4 engine would take the next replica's GPUs.
    with pytest.raises(PlacementError) as error:
        leader_engines("sglang", rollout_tp=4, nodes=1, tp=2)
    message = str(error.value)
    assert "rollout.tp=4" in message and "ranks [0, 1]" in message and "rollout.tp <= 2" in message
    assert "rollout.placement=spmd" in message


def test_visible_device_ids_are_mapped_through_cuda_visible_devices():
    # The node's job got GPUs 2, 3, 6, 7 (CUDA_VISIBLE_DEVICES=2,3,6,7 in every task).
    engines = leader_engines("vllm", rollout_tp=2, nodes=1, tp=2, gpus_per_node=4, visible=("2", "3", "6", "7"))
    assert [(e.indices, e.cuda_visible_devices) for e in engines] == [((0, 1), "2,3"), ((2, 3), "6,7")]
    sglang = leader_engines("sglang", rollout_tp=2, nodes=1, tp=2, gpus_per_node=4, visible=("2", "3", "6", "7"))
    assert [(e.base_gpu_id, e.gpu_id_step) for e in sglang] == [(0, 1), (2, 1)]  # SGLang counts visible GPUs
    uuids = ("GPU-a", "GPU-b")
    assert leader_engines("vllm", 2, nodes=1, tp=2, gpus_per_node=2, visible=uuids)[0].cuda_visible_devices == "GPU-a,GPU-b"


def test_a_leader_that_sees_only_its_own_gpu_cannot_start_a_tp_engine():
    one_each = [RankGpu("node0", (str(r),), 0) for r in range(8)]
    groups = replica_groups(megatron_coordinates(8, tp=4))
    with pytest.raises(PlacementError, match=r"sees only \['0'\].*gpus-per-task"):
        assign_engine_devices("leader", "vllm", 2, one_each, groups)
    engines = assign_engine_devices("leader", "vllm", 1, one_each, groups)  # its own GPU is fine
    assert [(e.gpus, e.indices) for e in engines] == [(("0",), (0,)), (("4",), (0,))]


def test_the_embedded_engine_stays_on_its_leaders_gpu():
    engines = leader_engines("embedded", rollout_tp=1, nodes=2, tp=2)
    assert [(e.owner, e.node, e.indices) for e in engines] == [
        (0, "node0", (0,)), (2, "node0", (2,)), (4, "node0", (4,)), (6, "node0", (6,)),
        (8, "node1", (0,)), (10, "node1", (2,)), (12, "node1", (4,)), (14, "node1", (6,)),
    ]  # fmt: skip


def test_ranks_sharing_a_gpu_are_refused():
    # 16 tasks on one 8-GPU node: ranks r and r + 8 share GPU r.
    shared = [RankGpu("node0", tuple(str(i) for i in range(8)), r % 8) for r in range(16)]
    with pytest.raises(PlacementError, match="GPU 0 of node0 would hold two rollout engine shards"):
        spmd_engines(2, shared)
    with pytest.raises(PlacementError, match="of ranks 0 and 8"):
        assign_engine_devices("leader", "vllm", 2, shared, replica_groups(megatron_coordinates(16, tp=2)))


def test_bad_arguments():
    ranks = torchrun_ranks(1)
    with pytest.raises(ValueError, match="placement"):
        assign_engine_devices("auto", "vllm", 1, ranks, [[0]])
    with pytest.raises(ValueError, match="unknown rollout.engine"):
        assign_engine_devices("leader", "trt", 1, ranks, [[0]])
    with pytest.raises(ValueError, match="rollout.tp=2 ranks"):
        assign_engine_devices("spmd", "vllm", 2, ranks, [[0, 1, 2]])
    with pytest.raises(ValueError, match="outside the 1 GPUs"):
        RankGpu("node0", ("0",), 1)


def test_every_rank_learns_its_engines_devices_from_megatrons_groups():
    """`group.engine_devices` under torchrun: 4 ranks, Megatron TP 2 x DP 2, rank r on GPU r."""
    result = run_torchrun_function(Path(__file__).parent / "_engine_devices_worker.py", "main", nproc=4, timeout=600)
    result.check()
    ranks = result.rank_results
    assert all("error" not in r for r in ranks), [r.get("error") for r in ranks]
    assert [r["leader_vllm_tp2"] for r in ranks] == [{"owner": 0, "indices": [0, 1]}, None, {"owner": 2, "indices": [2, 3]}, None]
    assert [r["leader_sglang_tp1"] for r in ranks] == [{"owner": 0, "indices": [0]}, None, {"owner": 2, "indices": [2]}, None]
    assert [r["leader_embedded"] for r in ranks] == [{"owner": 0, "indices": [0]}, None, {"owner": 2, "indices": [2]}, None]
    assert [r["spmd_tp2"] for r in ranks] == [{"owner": 0, "indices": [0, 1]}] * 2 + [{"owner": 2, "indices": [2, 3]}] * 2
    assert [r["spmd_tp4"] for r in ranks] == [{"owner": 0, "indices": [0, 1, 2, 3]}] * 4
    errors = [r["leader_vllm_tp4"]["error"] for r in ranks]  # the same refusal everywhere: nobody hangs
    assert len(set(errors)) == 1 and "rollout.tp=4" in errors[0] and "ranks [0, 1]" in errors[0]
