"""Worker for test_engine_devices.py: `group.engine_devices` on 4 ranks of a resolved layout with
Megatron's real process groups (TP 2, DP 2), each rank describing a GPU of a 4-GPU node (rank r on GPU r)."""

from __future__ import annotations


def main() -> dict:
    import dataclasses

    import torch.distributed as dist

    from megatron_dapo.distributed import ParallelLayout, init_distributed
    from megatron_dapo.distributed.placement import PlacementError, RankGpu
    from megatron_dapo.rollout.group import engine_devices
    from tests.support.torchrun_utils import reporting

    out: dict = {}
    with reporting(out):
        ctx = init_distributed(ParallelLayout(tp=2, pp=1), timeout_s=300)
        rank = dist.get_rank()
        mine = RankGpu("node0", ("0", "1", "2", "3"), rank)
        for name, placement, engine, tp in (
            ("leader_vllm_tp2", "leader", "vllm", 2),
            ("leader_sglang_tp1", "leader", "sglang", 1),
            ("leader_embedded", "leader", "embedded", 1),
            ("spmd_tp2", "spmd", "vllm", 2),
            ("spmd_tp4", "spmd", "vllm", 4),
            ("leader_vllm_tp4", "leader", "vllm", 4),  # larger than a replica (TP 2): refused on every rank
        ):
            try:
                layout = dataclasses.replace(ctx.layout, placement=placement, rollout_tp=tp)
                devices = engine_devices(layout, engine, mine)
                out[name] = None if devices is None else {"owner": devices.owner, "indices": list(devices.indices)}
            except PlacementError as error:
                out[name] = {"error": str(error)}
    return out
