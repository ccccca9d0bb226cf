"""Subprocess body for test_collective_timeout.py: rank 1 never joins a collective."""

from __future__ import annotations

import time


def one_rank_hangs(timeout_s: float, hang_s: float) -> dict:
    from megatron_dapo.distributed import ParallelLayout, init_distributed
    from megatron_dapo.distributed.objects import any_rank

    ctx = init_distributed(ParallelLayout(), timeout_s=timeout_s, seed=1)
    if ctx.rank == 1:
        time.sleep(hang_s)  # a stuck rank: never reaches the collective below
        return {"rank": 1}
    started = time.monotonic()
    try:
        any_rank(False)
    except Exception as error:  # noqa: BLE001 - the point is which error, and when
        return {"rank": 0, "failed_after_s": time.monotonic() - started, "error": f"{type(error).__name__}: {error}"}
    return {"rank": 0, "failed_after_s": None, "error": None}
