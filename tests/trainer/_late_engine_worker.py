"""Subprocess body for test_late_engine.py: one rank's engine finishes long after the other's.

Every rank runs `init_distributed` (default group with `timeout_s`, gather group with
`gather_timeout_s`), meets the others on the gather group (so all start together), then rank 1
"generates" for `delay_s` seconds before both gather their samples (`experience.gather_samples`,
the trainer's path) and the replica leaders' statistics (`objects.gather_from_leaders`, the
mismatch metrics' path). Rank 0 reaches both gathers `delay_s` seconds before rank 1.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import torch.distributed as dist

from tests.support.torchrun_utils import RESULT_DIR_ENV, write_rank_result


def _start_together(rank: int, world: int) -> None:
    """A file barrier before any process group exists: with a default timeout of a few seconds, ranks
    that finish importing seconds apart on a loaded machine would otherwise time out in the set-up."""
    directory = Path(os.environ[RESULT_DIR_ENV])
    (directory / f"ready{rank}").touch()
    while not all((directory / f"ready{r}").exists() for r in range(world)):
        time.sleep(0.05)


def late_engine(timeout_s: float, gather_timeout_s: float, delay_s: float, meet_on_default_group: bool) -> None:
    from megatron_dapo.distributed import ParallelLayout, enable_cpu_compat, init_distributed, teardown
    from megatron_dapo.distributed.objects import any_rank, gather_from_leaders
    from megatron_dapo.distributed.setup import gather_group
    from megatron_dapo.trainer.samples import gather_samples

    from tests.support.samples import as_plain, make_samples

    enable_cpu_compat()
    import megatron.core.parallel_state  # noqa: F401 - the slow import, before the start line

    _start_together(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]))
    ctx = init_distributed(ParallelLayout(), timeout_s=timeout_s, seed=1, gather_timeout_s=gather_timeout_s)
    rank = ctx.rank
    meet_on = dist.group.WORLD if meet_on_default_group else None
    out: dict = {"rank": rank, "error": None, "stage": "start"}
    dist.barrier(group=gather_group())  # start together, whatever the start-up skew
    try:
        out["stage"] = "samples"
        if rank == 1:
            time.sleep(delay_s)  # this engine is slow
        local = make_samples(seed=rank, num_prompts=2 + rank, n=2)
        started = time.monotonic()
        gathered = gather_samples(local, order_key=rank, meet_on=meet_on)
        out["samples_wait_s"] = time.monotonic() - started
        expected = [as_plain(make_samples(seed=r, num_prompts=2 + r, n=2)) for r in range(ctx.world_size)]
        out["samples_equal"] = as_plain(gathered) == {k: [v for part in expected for v in part[k]] for k in expected[0]}
        out["stage"] = "leaders"
        if rank == 1:
            time.sleep(delay_s)  # its log-probs (or validation) take long too
        out["leaders"] = gather_from_leaders({"replica": rank}, meet_on=meet_on)
        out["stage"] = "after"
        out["default_group_alive"] = any_rank(rank == 1)  # in step again: the default group still works
    except Exception as error:  # noqa: BLE001 - the test reads which error, on which rank, when
        out["error"] = f"{type(error).__name__}: {error}"
        out["failed_after_s"] = time.monotonic() - started
        write_rank_result(out)
        return  # a broken group: leave without the clean-up collectives
    write_rank_result(out)
    dist.barrier(group=gather_group())
    teardown()
