"""`liveness.called_off`: a rank busy elsewhere (an spmd engine's rank between engine steps) asks
whether its next meeting was called off by another rank, with one store read and without arriving.
In one process over an in-memory store, as test_liveness.py: this process is rank 0, rank 1's store
operations are played directly."""

from __future__ import annotations

import pytest

from megatron_dapo.distributed import liveness




def _rank1_calls_off(store, n: int) -> None:
    """What rank 1's `liveness.call_off("gather")` does to meeting n."""
    assert store.compare_set(f"outcome/gather/{n}", "", "off") == b"off"
    store.add(f"count/gather/{n}", liveness.CALLED_OFF)


def test_without_a_beat_nothing_is_called_off():
    assert not liveness.beating()
    assert liveness.called_off(liveness.GATHER) is False


def test_called_off_reads_the_next_meeting_without_arriving(liveness_job):
    assert liveness.called_off(liveness.GATHER) is False
    assert liveness_job.add("count/gather/0", 0) == 0  # a read: this rank has not arrived
    liveness_job.append("arrived/gather/0", "1,")  # rank 1 arrived: still not called off
    liveness_job.add("count/gather/0", 1)
    assert liveness.called_off(liveness.GATHER) is False
    _rank1_calls_off(liveness_job, 0)
    assert liveness.called_off(liveness.GATHER) is True
    assert liveness.called_off("other") is False  # another stream's meeting
    with pytest.raises(liveness.MeetingCalledOff):  # this rank's own wait in it ends the same way
        liveness.await_ranks([0, 1], liveness.GATHER)
    assert liveness.called_off(liveness.GATHER) is False  # its next meeting (1) is not off


def test_this_ranks_own_call_off_is_seen_too(liveness_job):
    assert liveness.call_off(liveness.GATHER) is True
    assert liveness.called_off(liveness.GATHER) is True
    assert liveness_job.get("outcome/gather/0") == b"off"


def test_a_completed_meeting_is_not_called_off(liveness_job):
    liveness_job.append("arrived/gather/0", "1,")
    liveness_job.add("count/gather/0", 1)
    liveness.await_ranks([0, 1], liveness.GATHER)  # both there: done
    assert liveness.called_off(liveness.GATHER) is False  # meeting 1, not yet met
    _rank1_calls_off(liveness_job, 1)
    assert liveness.called_off(liveness.GATHER) is True
