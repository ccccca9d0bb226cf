"""A rank that is gone is noticed within the liveness window; a slow one is waited for (issue 26, item 5).

Two ranks under torchrun and `init_distributed` (`_liveness_worker.py`). The awaited rank either
takes longer than the liveness window and then arrives (alive: it beats), or freezes itself with
SIGSTOP, which is how a lost node looks to the others: no beat, and no closed socket for gloo to
notice. In the trainer's gather after generating, and in a replica's meeting around its leader's
engine start. The control (the waits before this change: the gloo collective alone, bounded by
`rollout.gather_timeout_s`) waits out the whole timeout for the frozen rank.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.torchrun_utils import run_torchrun_function

WORKER = Path(__file__).with_name("_liveness_worker.py")
WINDOW_S = 3.0  # rollout.liveness_window_s of these runs
GATHER_TIMEOUT_S = 25.0  # rollout.gather_timeout_s: what the control waits for the frozen rank


def _waiter(where: str, case: str, delay_s: float = 0.0, liveness_on: bool = True) -> dict:
    kwargs = {"where": where, "case": case, "window_s": WINDOW_S, "gather_timeout_s": GATHER_TIMEOUT_S,
              "delay_s": delay_s, "liveness_on": liveness_on}  # fmt: skip
    result = run_torchrun_function(WORKER, "main", nproc=2, timeout=240, kwargs=kwargs)
    waiter = result.rank_results[1 if where == "barrier" else 0]
    assert waiter is not None, result.tail()
    if case == "slow":
        result.check()
    return waiter


@pytest.mark.parametrize("where", ["gather", "barrier"])
def test_a_frozen_rank_is_noticed_within_the_liveness_window(where):
    waiter = _waiter(where, "frozen")
    assert waiter["error"] is not None and "RankUnresponsive" in waiter["error"], waiter
    # ~1.5 windows after its last beat (here the store is the launcher's or rank 0's: either way).
    assert waiter["waited_s"] < 2.5 * WINDOW_S + 3, waiter


@pytest.mark.parametrize("where", ["gather", "barrier"])
def test_a_slow_rank_that_beats_is_waited_for_beyond_the_window(where):
    waiter = _waiter(where, "slow", delay_s=4 * WINDOW_S)
    assert waiter["error"] is None, waiter
    assert waiter["waited_s"] > 3 * WINDOW_S, waiter


def test_the_control_waits_out_the_gather_timeout_for_a_frozen_rank():
    waiter = _waiter("gather", "frozen", liveness_on=False)
    assert waiter["error"] is not None, waiter
    assert waiter["waited_s"] >= GATHER_TIMEOUT_S - 1, waiter
