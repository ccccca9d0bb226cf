"""How the weight export packs experts for one collective per buffer (model/expert_groups.py). Pure."""

from __future__ import annotations

import pytest

from megatron_dapo.model.expert_groups import expert_group_limit, plan_expert_groups


def test_one_buffer_per_rank_when_a_ranks_experts_fit():
    # 8 experts x 2 rows (fc1, fc2) over EP=2: rank 0 holds rows 0..7, rank 1 rows 8..15
    sources = [0] * 8 + [1] * 8
    assert plan_expert_groups(sources, [100] * 16, limit_bytes=800) == [range(0, 8), range(8, 16)]


def test_a_ranks_experts_larger_than_the_limit_split_in_order():
    sources = [0] * 8 + [1] * 8
    groups = plan_expert_groups(sources, [100] * 16, limit_bytes=350)
    assert groups == [range(0, 3), range(3, 6), range(6, 8), range(8, 11), range(11, 14), range(14, 16)]


def test_groups_cover_every_item_in_order_never_mix_sources_and_respect_the_limit():
    sources = [(0, "f32")] * 3 + [(0, "bf16")] * 2 + [(1, "bf16")] * 4
    sizes = [40, 70, 10, 50, 50, 30, 30, 30, 30]
    groups = plan_expert_groups(sources, sizes, limit_bytes=100)
    assert [i for g in groups for i in g] == list(range(len(sizes)))
    for group in groups:
        assert len({sources[i] for i in group}) == 1
        assert sum(sizes[i] for i in group) <= 100
    assert groups == [range(0, 1), range(1, 3), range(3, 5), range(5, 8), range(8, 9)]


def test_an_item_larger_than_the_limit_travels_alone():
    groups = plan_expert_groups([0, 0, 0, 0], [10, 500, 10, 10], limit_bytes=100)
    assert groups == [range(0, 1), range(1, 2), range(2, 4)]


def test_nothing_to_plan_and_bad_input():
    assert plan_expert_groups([], [], limit_bytes=1) == []
    with pytest.raises(ValueError, match="2 sources but 1 sizes"):
        plan_expert_groups([0, 0], [1], limit_bytes=10)
    with pytest.raises(ValueError, match="at least 1 byte"):
        plan_expert_groups([0], [1], limit_bytes=0)
    with pytest.raises(ValueError, match="negative size"):
        plan_expert_groups([0], [-1], limit_bytes=10)


def test_a_buffer_holds_at_most_half_a_bucket():
    """Half: a bucket may still pin the buffer of the tensors it took last while the next is
    filled, so the export holds at most one bucket beyond the consumer's."""
    assert expert_group_limit(512 << 20) == 256 << 20
    assert expert_group_limit(1) == 1
    with pytest.raises(ValueError, match="at least 1 byte"):
        expert_group_limit(0)
