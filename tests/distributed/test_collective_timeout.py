"""A hung rank makes the job fail with a message instead of idling (trainer.collective_timeout_s)."""

from __future__ import annotations

from pathlib import Path

from tests.support.torchrun_utils import run_torchrun_function

WORKER = Path(__file__).with_name("_hang_worker.py")


def test_collective_fails_after_the_timeout_when_a_rank_hangs():
    result = run_torchrun_function(WORKER, "one_rank_hangs", nproc=2, kwargs={"timeout_s": 4.0, "hang_s": 12.0}, timeout=180)
    rank0 = next(r for r in result.rank_results if r["rank"] == 0)
    assert rank0["error"] is not None, result.tail()
    # It fails at the configured timeout (not after the 12 s the other rank is stuck, nor never).
    assert 3.0 <= rank0["failed_after_s"] < 10.0, rank0
