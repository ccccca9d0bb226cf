"""Tests for the prompt sampler and DP sharding (megatron_dapo/data/sampler.py)."""

from __future__ import annotations

import json
from collections import Counter

import pytest

from megatron_dapo.data.sampler import PromptSampler, shard_for_rank


def batches(sampler: PromptSampler, count: int) -> list[list[int]]:
    return [sampler.next_batch() for _ in range(count)]


def test_same_arguments_same_batches_on_every_rank():
    ranks = [PromptSampler(50, 8, shuffle=True, seed=3) for _ in range(4)]
    streams = [batches(s, 10) for s in ranks]
    assert all(stream == streams[0] for stream in streams)
    assert batches(PromptSampler(50, 8, shuffle=True, seed=4), 10) != streams[0]


def test_resume_continues_bit_for_bit():
    uninterrupted = PromptSampler(23, 5, shuffle=True, seed=7)
    expected = batches(uninterrupted, 12)  # crosses two epoch boundaries

    first = PromptSampler(23, 5, shuffle=True, seed=7)
    assert batches(first, 3) == expected[:3]
    state = json.loads(json.dumps(first.state_dict()))  # what a checkpoint stores survives JSON
    assert state["consumed"] == 15

    resumed = PromptSampler(23, 5, shuffle=True, seed=7)
    resumed.load_state_dict(state)
    assert (resumed.consumed, resumed.epoch) == (15, 0)
    assert batches(resumed, 9) == expected[3:]
    assert resumed.state_dict() == uninterrupted.state_dict()


def test_every_epoch_covers_every_index_once_and_reshuffles():
    sampler = PromptSampler(10, 4, shuffle=True, seed=1)
    stream = [i for batch in batches(sampler, 10) for i in batch]  # 40 indices = 4 epochs
    epochs = [stream[e * 10 : (e + 1) * 10] for e in range(4)]
    for order in epochs:
        assert sorted(order) == list(range(10))
    assert len({tuple(order) for order in epochs}) == 4, "each epoch has its own order"
    assert all(order != list(range(10)) for order in epochs)
    assert (sampler.epoch, sampler.consumed) == (4, 40)


def test_batch_straddles_the_epoch_boundary():
    sampler = PromptSampler(6, 4, shuffle=True, seed=2)
    first, second = sampler.next_batch(), sampler.next_batch()
    assert sampler.epoch == 1 and sampler.consumed == 8
    assert sorted(first + second[:2]) == list(range(6))
    assert second[2:] == list(sampler.epoch_order(1)[:2])


def test_without_shuffle_the_order_is_the_dataset_order():
    sampler = PromptSampler(5, 3, shuffle=False, seed=0)
    assert batches(sampler, 4) == [[0, 1, 2], [3, 4, 0], [1, 2, 3], [4, 0, 1]]


def test_never_runs_dry_with_a_batch_larger_than_the_dataset():
    sampler = PromptSampler(3, 7, shuffle=True, seed=5)
    stream = [i for batch in batches(sampler, 3) for i in batch]
    assert len(stream) == 21
    assert Counter(stream) == {0: 7, 1: 7, 2: 7}
    assert sampler.epoch == 7


def test_resume_with_a_different_batch_size_continues_the_stream():
    reference = PromptSampler(11, 4, shuffle=True, seed=9)
    stream = [i for batch in batches(reference, 6) for i in batch]
    first = PromptSampler(11, 4, shuffle=True, seed=9)
    batches(first, 2)
    resumed = PromptSampler(11, 8, shuffle=True, seed=9)
    resumed.load_state_dict(first.state_dict())
    assert batches(resumed, 2) == [stream[8:16], stream[16:24]]


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(num_examples=12), r"dataset has 12 prompts but the checkpoint's had 11"),
        (dict(seed=10), r"data\.seed is 10 but was 9"),
        (dict(shuffle=False), r"data\.shuffle is False but was True"),
    ],
)
def test_resume_refuses_a_different_order(change, message):
    saved = PromptSampler(11, 4, shuffle=True, seed=9)
    saved.next_batch()
    arguments = dict(num_examples=11, batch_size=4, shuffle=True, seed=9) | change
    other = PromptSampler(arguments.pop("num_examples"), arguments.pop("batch_size"), **arguments)
    with pytest.raises(ValueError, match=message) as info:
        other.load_state_dict(saved.state_dict())
    # A config mistake, not a program error: the CLI reports it in one line (exit 2) with both ways out.
    from megatron_dapo.config import ConfigError

    assert isinstance(info.value, ConfigError)
    assert "To resume, set them back" in str(info.value) and "run without --resume in a new trainer.output_dir" in str(info.value)
    with pytest.raises(ValueError, match="lacks"):
        other.load_state_dict({"consumed": 3})


def test_invalid_arguments():
    with pytest.raises(ValueError, match="at least one example"):
        PromptSampler(0, 4, shuffle=True, seed=0)
    with pytest.raises(ValueError, match="batch_size"):
        PromptSampler(4, 0, shuffle=True, seed=0)
    with pytest.raises(ValueError, match="data.seed"):
        PromptSampler(4, 2, shuffle=True, seed=-1)


def test_shard_for_rank_gives_contiguous_equal_shares():
    items = list(range(12))
    shares = [shard_for_rank(items, rank, 4) for rank in range(4)]
    assert shares == [[0, 1, 2], [3, 4, 5], [6, 7, 8], [9, 10, 11]]
    assert shard_for_rank(items, 0, 1) == items
    assert shard_for_rank(("a", "b"), 1, 2) == ["b"]


def test_shard_for_rank_errors():
    with pytest.raises(ValueError, match=r"cannot split 10 items evenly over 4 .*multiple of 4"):
        shard_for_rank(list(range(10)), 0, 4)
    with pytest.raises(ValueError, match="outside"):
        shard_for_rank(list(range(8)), 4, 4)
    with pytest.raises(ValueError, match="world size"):
        shard_for_rank(list(range(8)), 0, 0)


def test_shard_for_rank_uneven_shares_differ_by_at_most_one():
    """A validation set of any size: contiguous shares, sizes within one, nothing lost or repeated."""
    for length in range(0, 12):
        for world in range(1, 5):
            shares = [shard_for_rank(list(range(length)), rank, world, even=False) for rank in range(world)]
            assert [i for share in shares for i in share] == list(range(length))
            assert max(map(len, shares)) - min(map(len, shares)) <= 1
            if length % world == 0:  # an even split is the even rule's
                assert shares == [shard_for_rank(list(range(length)), rank, world) for rank in range(world)]
    assert [shard_for_rank(list(range(8)), rank, 3, even=False) for rank in range(3)] == [[0, 1], [2, 3, 4], [5, 6, 7]]
