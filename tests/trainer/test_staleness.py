"""The rules of asynchronous training (`trainer/staleness.py`): which versions a step may train on,
and how many generation batches the trainer hands out ahead of its update."""

from __future__ import annotations

import pytest

from megatron_dapo.trainer.metrics import busy_union_seconds, overlap_seconds, staleness_metrics, timeline_metrics
from megatron_dapo.trainer.staleness import batches_ahead, oldest_version, staleness


def test_versions_and_staleness():
    # step t starts from version t - 1: its own batch (synchronous) is 0 versions stale
    assert staleness(step=5, version=4) == 0 and staleness(step=5, version=3) == 1
    assert oldest_version(step=5, max_staleness=0) == 4 and oldest_version(step=5, max_staleness=2) == 2


def test_nothing_is_handed_out_ahead_in_the_synchronous_loop():
    assert batches_ahead(0, train_batch_size=4, carried_groups=0, kept_per_batch=4.0, in_flight=0) == 0


def test_one_step_off_hands_out_the_next_steps_batches():
    # every group kept: one batch of 4 groups per train batch of 4
    assert batches_ahead(1, 4, carried_groups=0, kept_per_batch=4.0, in_flight=0) == 1
    # dynamic sampling keeps 1.5 groups a batch: 3 batches for 4 groups
    assert batches_ahead(1, 4, carried_groups=0, kept_per_batch=1.5, in_flight=0) == 3
    # fresh carried groups count; what is in flight already counts
    assert batches_ahead(1, 4, carried_groups=4, kept_per_batch=4.0, in_flight=0) == 0
    assert batches_ahead(1, 4, carried_groups=2, kept_per_batch=1.0, in_flight=1) == 1
    assert batches_ahead(1, 4, carried_groups=0, kept_per_batch=4.0, in_flight=3) == 0


def test_a_larger_bound_keeps_more_steps_in_flight():
    assert batches_ahead(3, 4, carried_groups=0, kept_per_batch=4.0, in_flight=0) == 3
    assert batches_ahead(3, 4, carried_groups=0, kept_per_batch=4.0, in_flight=1) == 2


def test_bad_counts_are_refused():
    with pytest.raises(ValueError, match="kept_per_batch"):
        batches_ahead(1, 4, 0, 0.0, 0)
    with pytest.raises(ValueError):
        batches_ahead(-1, 4, 0, 1.0, 0)


def test_staleness_metrics():
    out = staleness_metrics([0, 1, 1, 1], max_staleness=2)
    assert out == {
        "async/staleness_mean": 0.75, "async/staleness_max": 1.0,
        "async/staleness_frac_0": 0.25, "async/staleness_frac_1": 0.75, "async/staleness_frac_2": 0.0,
    }  # fmt: skip
    with pytest.raises(ValueError, match="newer"):
        staleness_metrics([-1], 1)


def test_busy_intervals_and_their_overlap():
    assert busy_union_seconds([(0, 2), (1, 3), (5, 6)]) == 4
    assert overlap_seconds([(0, 2), (1, 3)], [(2.5, 10)]) == 0.5
    assert overlap_seconds([(0, 1)], [(1, 2)]) == 0
    # engines busy 0-4 (two overlapping requests) and 6-12, trainer busy 3-8, step window 2-10
    out = timeline_metrics((2, 10), [(0, 3), (1, 4), (6, 12)], [(3, 8)], engine_wait_s=1.5, trainer_wait_s=0.25)
    assert out["async/engine_busy_s"] == 2 + 4  # clipped to the window: 2-4 and 6-10
    assert out["async/overlap_frac"] == (1 + 2) / 8  # 3-4 and 6-8
    assert out["async/engine_wait_s"] == 1.5 and out["async/trainer_wait_s"] == 0.25
