"""Waits that end when the awaited rank arrives or dies, not after a fixed timeout (issue 26, item 5).

In one process, over an in-memory store: this rank (0) waits in `liveness.await_ranks` for rank 1,
played by a thread that beats (or stops beating) and arrives when the case says. The pure parts
(`BeatWatch`, the poll schedule) first. The same through real processes and the trainer's gather:
test_liveness_gather.py.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch.distributed as dist

from megatron_dapo.distributed import liveness

WINDOW_S = 1.0


def test_a_rank_is_silent_once_its_beat_has_not_moved_for_the_window():
    watch = liveness.BeatWatch(window_s=10.0)
    assert watch.update({1: 5, 2: None}, now=0.0) == []  # first readings count as changes
    assert watch.update({1: 6, 2: None}, now=8.0) == []
    assert watch.update({1: 6, 2: None}, now=10.5) == [2]  # rank 2 never beat in 10.5 s
    assert watch.update({1: 6, 2: 1}, now=18.5) == [1]  # rank 1 stuck at 6 since t=8; rank 2 beat
    assert watch.update({1: 7, 2: 1}, now=19.0) == []


def test_polls_start_fast_and_settle():
    assert liveness.poll_interval(0.0) < 0.002
    assert liveness.poll_interval(10.0) == liveness.MAX_POLL_S
    assert liveness.beat_interval(60) == 10 and liveness.check_interval(60) == 15


def test_configure_checks_its_values():
    with pytest.raises(ValueError, match="rollout.liveness_window_s"):
        liveness.configure(window_s=0)




@pytest.fixture
def rank1(liveness_job):
    """Starts rank 1 (`_rank1`) in the test's store; its thread is stopped and joined when the test
    ends, so it never touches the store while the interpreter shuts down."""
    stop = threading.Event()
    threads = []

    def start(*, beats_for_s: float, arrives_after_s: float | None) -> None:
        threads.append(_rank1(liveness_job, stop, beats_for_s=beats_for_s, arrives_after_s=arrives_after_s))

    yield start
    stop.set()
    for thread in threads:
        thread.join(timeout=10)


def _rank1(store, stop: threading.Event, *, beats_for_s: float, arrives_after_s: float | None) -> threading.Thread:
    """Rank 1: beats like `_Heart` for `beats_for_s`, then falls silent; arrives at the meeting after
    `arrives_after_s` (None: never); ends once `stop` is set."""

    def run():
        started = time.monotonic()
        arrived = False
        while not stop.is_set():
            elapsed = time.monotonic() - started
            if elapsed < beats_for_s:
                store.add("beat/1", 1)
            if arrives_after_s is not None and not arrived and elapsed >= arrives_after_s:
                store.append("arrived/gather/0", "1,")
                store.add("count/gather/0", 1)
                arrived = True
            if elapsed > max(beats_for_s, arrives_after_s or 0) + 1:
                return
            stop.wait(liveness.beat_interval(WINDOW_S))

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def test_a_rank_that_stops_beating_ends_the_wait_within_the_window(rank1):
    rank1(beats_for_s=0.5, arrives_after_s=None)  # dies half a second into the wait
    started = time.monotonic()
    with pytest.raises(liveness.RankUnresponsive, match=r"rank\(s\) \[1\] stopped beating"):
        liveness.await_ranks([0, 1], "gather", what="the test's gather")
    waited = time.monotonic() - started
    assert waited < 0.5 + 2 * WINDOW_S, waited  # ~1.5 windows after its last beat, not an hour


def test_a_rank_that_beats_is_waited_for_beyond_the_window(rank1):
    rank1(beats_for_s=10, arrives_after_s=4 * WINDOW_S)  # slow, alive
    waited = liveness.await_ranks([0, 1], "gather")
    assert 4 * WINDOW_S - 0.5 < waited < 4 * WINDOW_S + 2, waited


def test_a_store_that_stops_answering_ends_the_wait_within_the_window(liveness_job):
    """The store's own host is gone (rank 0's node under SLURM): its calls hang, the wait does not."""

    class Frozen:
        def __getattr__(self, name):
            def hang(*args):
                time.sleep(3600)

            return hang

    liveness._heart.waits = liveness._BoundedStore(Frozen())
    started = time.monotonic()
    with pytest.raises(liveness.RankUnresponsive, match="the job's store"):
        liveness.await_ranks([0, 1], "gather")
    assert time.monotonic() - started < 2 * WINDOW_S


def test_a_live_rank_that_never_arrives_ends_at_the_limit(rank1):
    liveness.configure(limit_s=2 * WINDOW_S)
    rank1(beats_for_s=10, arrives_after_s=None)
    with pytest.raises(TimeoutError, match=r"rollout.gather_timeout_s=2 s"):
        liveness.await_ranks([0, 1], "gather")


def test_a_new_window_takes_effect_at_once():
    """The trainer sets its window after `init_distributed` started the beat with the default one:
    the beat must not sleep out the old interval (10 s) meanwhile."""
    saved = liveness.settings().window_s, liveness.settings().limit_s
    store = dist.HashStore()
    try:
        liveness.configure(window_s=60)
        assert liveness.start_beating(store, rank=0)
        first = store.add("beat/0", 0)
        liveness.configure(window_s=1.0)
        time.sleep(0.6)
        assert store.add("beat/0", 0) > first
    finally:
        liveness.stop_beating()
        liveness.configure(*saved)


def _arrive_as_rank1(store, n: int = 0) -> None:
    store.append(f"arrived/gather/{n}", "1,")
    store.add(f"count/gather/{n}", 1)


def test_a_meeting_called_off_while_waiting_ends_for_this_rank_and_the_others(liveness_job, rank1):
    """This rank is told to stop while it waits (its SIGTERM, `calling_off_when`): the wait ends at
    the next poll, and rank 1, arriving later, finds the same outcome."""
    rank1(beats_for_s=10, arrives_after_s=None)  # alive: only the call-off ends the wait
    asked = []
    threading.Timer(0.5, lambda: asked.append(True)).start()
    started = time.monotonic()
    with liveness.calling_off_when(lambda: bool(asked)), pytest.raises(liveness.MeetingCalledOff):
        liveness.await_ranks([0, 1], "gather")
    assert time.monotonic() - started < 0.5 + 2 * WINDOW_S  # the next poll, not the limit (600 s)
    _arrive_as_rank1(liveness_job)
    assert liveness_job.compare_set("outcome/gather/0", "", "done") == b"off"  # what rank 1's wait ends with


def test_another_rank_calling_off_ends_this_ones_wait(liveness_job, rank1):
    # Rank 1 beats throughout, as a live rank's heart thread does while its SIGTERM handler runs; without
    # it a loaded machine that delays the call-off past the window (1 s) ends the wait as
    # RankUnresponsive instead (CI, stack 2).
    rank1(beats_for_s=10, arrives_after_s=None)

    def rank1_calls_off():
        time.sleep(0.5)  # rank 1's SIGTERM handler, while its engine generates (`liveness.call_off`)
        assert liveness_job.compare_set("outcome/gather/0", "", "off") == b"off"
        liveness_job.add("count/gather/0", liveness.CALLED_OFF)

    threading.Thread(target=rank1_calls_off, daemon=True).start()
    with pytest.raises(liveness.MeetingCalledOff):
        liveness.await_ranks([0, 1], "gather")


def test_a_meeting_that_completed_cannot_be_called_off(liveness_job):
    _arrive_as_rank1(liveness_job)
    assert liveness.await_ranks([0, 1], "gather") >= 0  # both there: done
    assert liveness_job.compare_set("outcome/gather/0", "", "off") == b"done"  # a late call-off finds it done
    # This rank's own call-off now targets its next meeting, not the finished one.
    assert liveness.call_off("gather") is True
    assert liveness_job.get("outcome/gather/1") == b"off"
