"""Subprocess body for test_init_distributed.py: one task of an emulated `srun --ntasks 2`."""

from __future__ import annotations

import torch


def init_from_slurm() -> dict:
    import torch.distributed as dist

    from megatron_dapo.distributed import ParallelLayout, init_distributed, teardown

    ctx = init_distributed(ParallelLayout(tp=2), timeout_s=120, seed=7)
    from megatron.core import parallel_state as ps

    value = torch.tensor([float(ctx.rank + 1)])
    dist.all_reduce(value, group=ps.get_tensor_model_parallel_group())
    out = {
        "source": ctx.launch.source,
        "rank": ctx.rank,
        "world_size": ctx.world_size,
        "master_addr": ctx.launch.master_addr,
        "backend": ctx.backend,
        "tp_rank": ps.get_tensor_model_parallel_rank(),
        "tp_sum": value.item(),
        "describe": ctx.layout.describe(num_layers=4),
    }
    # Re-initialise Megatron's groups with another layout over the same processes.
    teardown(keep_process_group=True)
    out["after_keep"] = {"dist": dist.is_initialized(), "megatron": ps.model_parallel_is_initialized()}
    ctx = init_distributed(ParallelLayout(pp=2), timeout_s=120, seed=7)
    out["pp_rank"] = ps.get_pipeline_model_parallel_rank()
    out["seeded"] = torch.initial_seed()
    try:
        init_distributed(ParallelLayout(pp=2))
        out["double_init"] = "no error"
    except RuntimeError as exc:
        out["double_init"] = str(exc)
    teardown()
    out["after_teardown"] = {"dist": dist.is_initialized(), "megatron": ps.model_parallel_is_initialized()}
    teardown()  # a second call is harmless
    return out


def leave_together_after_a_late_store_use(late_s: float) -> None:
    """Rank 1 uses the job's store `late_s` after rank 0 is done (as an engine owner counts itself
    done after shutting its engine down); rank 0, the store's host under srun, leaves together with
    the others and then exits at once. Each rank writes what it saw; rank 1 fails if the store was gone."""
    import os
    import time

    import torch.distributed as dist

    from megatron_dapo.distributed import ParallelLayout, init_distributed, teardown
    from tests.support.torchrun_utils import write_rank_result

    ctx = init_distributed(ParallelLayout(), timeout_s=120, seed=7)
    started = time.monotonic()
    if ctx.rank == 1:
        time.sleep(late_s)
        dist.distributed_c10d._get_default_store().add("late_use", 1)
    teardown(together=True)
    write_rank_result({"rank": ctx.rank, "left_after_s": time.monotonic() - started})
    os._exit(0)  # the store's host goes as soon as it may
