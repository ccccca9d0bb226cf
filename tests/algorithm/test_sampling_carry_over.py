"""Dynamic sampling for asynchronous training: surplus groups carried to the next step, and groups
grown too old dropped and counted (`DynamicSamplingBuffer(carry_over=True)`, `drop_stale`,
`note_stale`, `num_carried_groups`)."""

from __future__ import annotations

import pytest

from megatron_dapo.algorithm.sampling import DynamicSamplingBuffer

N = 2
MIXED = (True, False)


def _batch(first_uid: int, groups: int, version: int):
    """`groups` mixed groups of N samples (contiguous), every sample of weight version `version`."""
    uids = [first_uid + g for g in range(groups) for _ in range(N)]
    acc = [a for _ in range(groups) for a in MIXED]
    fields = {"uid": list(uids), "weight_version": [version] * len(uids), "token": [10 * u + i % N for i, u in enumerate(uids)]}
    return fields, acc, uids


def test_without_carry_over_the_surplus_is_dropped_and_the_stats_unchanged():
    buf = DynamicSamplingBuffer(train_batch_size=2, n_samples_per_prompt=N)
    buf.add(*_batch(0, 3, version=0))
    assert buf.take()["uid"] == [0, 0, 1, 1]
    assert "num_groups_carried" not in buf.stats and "num_groups_stale_dropped" not in buf.stats
    assert buf.num_carried_groups() == 0 and buf.carried_values("uid") == []
    buf.add(*_batch(10, 2, version=1))
    assert buf.take()["uid"] == [10, 10, 11, 11]  # group 2 did not come back


def test_carry_over_keeps_the_surplus_in_arrival_order_for_the_next_step():
    buf = DynamicSamplingBuffer(train_batch_size=2, n_samples_per_prompt=N, carry_over=True)
    buf.add(*_batch(0, 3, version=0))
    assert buf.take()["uid"] == [0, 0, 1, 1]
    assert buf.num_carried_groups() == 1
    assert buf.num_carried_groups("weight_version", 0) == 1 and buf.num_carried_groups("weight_version", 1) == 0
    assert buf.carried_values("token") == [20, 21] and buf.carried_values("no such field") == []
    buf.add(*_batch(10, 3, version=1))
    assert buf.is_full
    taken = buf.take()
    assert taken["uid"] == [2, 2, 10, 10] and taken["weight_version"] == [0, 0, 1, 1]  # oldest first
    assert taken["token"] == [20, 21, 100, 101]  # each sample's own fields travel with it
    stats = buf.stats
    assert stats["num_groups_carried"] == 1 and stats["num_groups_kept"] == 3 and stats["num_gen_batches"] == 1
    assert buf.num_carried_groups() == 2


def test_a_step_filled_by_carried_groups_alone_needs_no_generation():
    buf = DynamicSamplingBuffer(train_batch_size=1, n_samples_per_prompt=N, carry_over=True)
    buf.add(*_batch(0, 3, version=0))
    buf.take()
    assert buf.drop_stale("weight_version", oldest=0) == 0
    assert buf.is_full
    assert buf.take()["uid"] == [1, 1]
    assert buf.stats["num_gen_batches"] == 0 and buf.stats["num_groups_carried"] == 2


def test_drop_stale_removes_the_groups_below_the_oldest_version_and_counts_them():
    buf = DynamicSamplingBuffer(train_batch_size=1, n_samples_per_prompt=N, carry_over=True)
    buf.add(*_batch(0, 3, version=4))
    buf.take()
    assert buf.drop_stale("weight_version", oldest=5) == 2
    assert not buf.is_full and buf.num_stored_groups == 0
    buf.note_stale(3)  # a whole batch that aged in flight
    buf.add(*_batch(10, 1, version=5))
    assert buf.take()["uid"] == [10, 10]
    stats = buf.stats
    assert stats["num_groups_stale_dropped"] == 5 and stats["num_groups_carried"] == 0


def test_a_group_whose_samples_differ_in_version_is_refused():
    buf = DynamicSamplingBuffer(train_batch_size=1, n_samples_per_prompt=N, carry_over=True)
    fields, acc, uids = _batch(0, 2, version=0)
    fields["weight_version"] = [0, 0, 0, 1]
    buf.add(fields, acc, uids)
    buf.take()
    with pytest.raises(ValueError, match="groups must come whole"):
        buf.drop_stale("weight_version", oldest=1)
