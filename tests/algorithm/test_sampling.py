"""Dynamic sampling: group filter and the accumulate-until-full buffer."""

from __future__ import annotations

import pytest
import torch

from megatron_dapo.algorithm.sampling import (
    DynamicSamplingBuffer,
    DynamicSamplingExhausted,
    select_informative_groups,
)


def test_filter_keeps_mixed_groups_and_counts_the_rest():
    # groups (non-contiguous): a mixed, b all correct, c all wrong, d single, e mixed
    ids = ["a", "b", "c", "a", "b", "c", "d", "e", "e", "a"]
    acc = [1, 1, 0, 0, 1, 0, 1, 0, 1, 1]
    result = select_informative_groups(torch.tensor(acc, dtype=torch.bool), ids)
    assert result.kept_group_ids == ["a", "d", "e"]
    assert result.keep.tolist() == [g in ("a", "d", "e") for g in ids]
    assert (result.num_groups, result.num_kept) == (5, 3)
    assert (result.num_all_correct, result.num_all_wrong, result.num_constant) == (1, 1, 0)


def test_filter_uses_the_metric_not_the_shaped_reward():
    # an all-wrong group whose overlong penalty makes the shaped scores differ must still be dropped
    shaped_scores = [-1.0, -1.3, -1.7, 1.0, -1.0, -1.0]
    acc = [False, False, False, True, False, False]
    ids = [0, 0, 0, 1, 1, 1]
    by_acc = select_informative_groups(acc, torch.tensor(ids))
    assert by_acc.kept_group_ids == [1] and by_acc.num_all_wrong == 1
    assert select_informative_groups(shaped_scores, ids).num_kept == 2  # what filtering on score would do


def test_non_binary_constant_groups_are_counted_as_constant():
    result = select_informative_groups([0.5, 0.5, 0.2, 0.3, 1.0, 1.0], [0, 0, 1, 1, 2, 2])
    assert result.kept_group_ids == [1]
    assert (result.num_all_correct, result.num_all_wrong, result.num_constant) == (1, 0, 1)


def test_disabled_filter_keeps_everything_but_still_counts():
    result = select_informative_groups([1, 1, 0, 0], [7, 7, 8, 8], enabled=False)
    assert result.keep.all() and result.kept_group_ids == [7, 8]
    assert (result.num_all_correct, result.num_all_wrong) == (1, 1)


def test_filter_rejects_bad_inputs():
    with pytest.raises(ValueError, match="group ids"):
        select_informative_groups([1, 0], [0])
    with pytest.raises(ValueError, match="NaN"):
        select_informative_groups([1.0, float("nan")], [0, 0])


def make_generation_batch(first_uid, accs, seq_len, n):
    """A batch of len(accs) groups of n samples; uids first_uid, first_uid+1, ... interleaved."""
    num_groups = len(accs)
    # interleave the groups (sample j of every group, then sample j+1) to exercise non-contiguity
    uids = [first_uid + g for _ in range(n) for g in range(num_groups)]
    acc = [accs[g][j] for j in range(n) for g in range(num_groups)]
    tokens = torch.tensor([[uid * 100 + j] * seq_len for j, uid in enumerate(uids)])
    batch = {"input_ids": tokens, "uid": list(uids), "acc": torch.tensor(acc, dtype=torch.float32)}
    return batch, acc, uids


MIXED, RIGHT, WRONG = [1, 0], [1, 1], [0, 0]


def test_buffer_accumulates_until_full_and_returns_whole_groups_in_arrival_order():
    buf = DynamicSamplingBuffer(
        train_batch_size=3, n_samples_per_prompt=2, max_num_gen_batches=5, pad_values={"input_ids": -1}
    )
    batch, acc, uids = make_generation_batch(10, [WRONG, MIXED, RIGHT], seq_len=4, n=2)
    buf.add(batch, acc, uids)
    assert not buf.is_full and buf.num_stored_groups == 1
    batch, acc, uids = make_generation_batch(20, [MIXED, WRONG, MIXED, MIXED], seq_len=6, n=2)
    result = buf.add(batch, acc, uids)
    assert result.kept_group_ids == [20, 22, 23]
    assert buf.is_full and buf.num_gen_batches == 2
    stats = buf.stats
    assert stats == {
        "num_gen_batches": 2,
        "num_groups_generated": 7,
        "num_groups_kept": 4,
        "num_groups_all_correct": 1,
        "num_groups_all_wrong": 2,
        "num_groups_constant": 0,
        "num_samples_reward_failed": 0,
    }

    out = buf.take()
    # exactly 3 prompts x 2, group-contiguous, groups in arrival order; surplus group 23 dropped
    assert out["uid"] == [11, 11, 20, 20, 22, 22]
    assert out["acc"].tolist() == [1.0, 0.0, 1.0, 0.0, 1.0, 0.0]
    ids = out["input_ids"]
    assert ids.shape == (6, 6)
    assert ids[:2, 4:].eq(-1).all() and ids[2:, :].ne(-1).all()  # first batch right-padded
    assert ids[:, 0].tolist() == [1101, 1104, 2000, 2004, 2202, 2206]  # sample order within groups kept
    # stats describe the step just taken until the next add starts a new one
    assert buf.stats == stats and not buf.is_full

    batch, acc, uids = make_generation_batch(30, [MIXED, MIXED, MIXED], seq_len=2, n=2)
    buf.add(batch, acc, uids)
    assert buf.num_gen_batches == 1 and buf.stats["num_groups_generated"] == 3
    assert buf.take()["uid"] == [30, 30, 31, 31, 32, 32]


def test_exhaustion_raises_naming_the_knobs():
    buf = DynamicSamplingBuffer(train_batch_size=2, n_samples_per_prompt=2, max_num_gen_batches=3)
    for i in range(2):
        batch, acc, uids = make_generation_batch(10 * i, [RIGHT, MIXED if i == 0 else WRONG], seq_len=3, n=2)
        buf.add(batch, acc, uids)
    batch, acc, uids = make_generation_batch(100, [WRONG, WRONG], seq_len=3, n=2)
    with pytest.raises(DynamicSamplingExhausted) as info:
        buf.add(batch, acc, uids)
    message = str(info.value)
    assert "algorithm.filter_groups.max_num_gen_batches=3" in message
    assert "trainer.gen_batch_size" in message and "1/2" in message
    assert "2 were all correct" in message and "3 all wrong" in message


def test_reward_failures_on_every_sample_are_named_as_the_cause_not_the_data():
    """A reward function that raises on every sample makes every group all wrong; the message must
    blame it (count and first error), not the data's difficulty."""
    buf = DynamicSamplingBuffer(train_batch_size=2, n_samples_per_prompt=2, max_num_gen_batches=2)
    for i in range(2):
        batch, acc, uids = make_generation_batch(10 * i, [WRONG, WRONG, WRONG], seq_len=3, n=2)
        failures = [f"KeyError: 'answer' (batch {i})"] * len(uids)
        if i == 0:
            buf.add(batch, acc, uids, failures=failures)
            assert buf.stats["num_samples_reward_failed"] == 6
    with pytest.raises(DynamicSamplingExhausted) as info:
        buf.add(batch, acc, uids, failures=failures)
    message = str(info.value)
    assert "the reward function failed on 12 of 12 samples" in message
    assert "first error: KeyError: 'answer' (batch 0)" in message
    assert "The cause is the reward function, not the data" in message and "reward.custom_function.path" in message
    assert "too easy or too hard" not in message


def test_a_few_reward_failures_are_mentioned_next_to_the_data():
    buf = DynamicSamplingBuffer(train_batch_size=2, n_samples_per_prompt=2, max_num_gen_batches=1)
    batch, acc, uids = make_generation_batch(0, [WRONG, RIGHT, WRONG], seq_len=3, n=2)
    failures = [None] * len(uids)
    failures[1] = "TimeoutError: sample took longer than reward.timeout_s=10s"
    with pytest.raises(DynamicSamplingExhausted) as info:
        buf.add(batch, acc, uids, failures=failures)
    message = str(info.value)
    assert "Also, the reward function failed on 1 of 6 samples (first error: TimeoutError" in message
    assert "too easy or too hard" in message
    with pytest.raises(ValueError, match="2 reward failure entries for 6 samples"):
        DynamicSamplingBuffer(train_batch_size=2, n_samples_per_prompt=2).add(batch, acc, uids, failures=[None, None])


def test_unlimited_generation_batches_never_raise():
    buf = DynamicSamplingBuffer(train_batch_size=1, n_samples_per_prompt=3, max_num_gen_batches=0)
    for i in range(60):
        batch, acc, uids = make_generation_batch(i, [[0, 0, 0]], seq_len=1, n=3)
        buf.add(batch, acc, uids)
    assert not buf.is_full and buf.num_gen_batches == 60
    batch, acc, uids = make_generation_batch(1000, [[0, 1, 0]], seq_len=1, n=3)
    buf.add(batch, acc, uids)
    assert buf.take()["uid"] == [1000] * 3


def test_disabled_buffer_keeps_every_group_and_trims():
    buf = DynamicSamplingBuffer(train_batch_size=2, n_samples_per_prompt=2, max_num_gen_batches=1, enabled=False)
    batch, acc, uids = make_generation_batch(5, [RIGHT, WRONG, MIXED], seq_len=2, n=2)
    buf.add(batch, acc, uids)
    out = buf.take()
    assert out["uid"] == [5, 5, 6, 6] and out["input_ids"].shape == (4, 2)


def test_wrong_group_size_is_an_error():
    buf = DynamicSamplingBuffer(train_batch_size=2, n_samples_per_prompt=2)
    with pytest.raises(ValueError, match="n_samples_per_prompt=2"):
        buf.add({"x": torch.zeros(3)}, [1, 0, 1], ["a", "a", "b"])


def test_repeated_group_ids_across_batches_are_an_error():
    buf = DynamicSamplingBuffer(train_batch_size=3, n_samples_per_prompt=2)
    buf.add({"x": [1, 2]}, [1, 0], ["u", "u"])
    with pytest.raises(ValueError, match="already stored"):
        buf.add({"x": [3, 4]}, [1, 0], ["u", "u"])


def test_batch_shape_errors():
    buf = DynamicSamplingBuffer(train_batch_size=1, n_samples_per_prompt=2)
    with pytest.raises(ValueError, match="2 samples"):
        buf.add({"x": torch.zeros(3)}, [1, 0], ["a", "a"])
    with pytest.raises(TypeError):
        buf.add({"x": {"not": "indexable"}}, [1, 0], ["a", "a"])
    with pytest.raises(RuntimeError, match="is_full"):
        buf.take()
    buf.add({"x": torch.zeros(2)}, [1, 1], ["a", "a"])
    with pytest.raises(ValueError, match="fields changed"):
        buf.add({"y": torch.zeros(2)}, [1, 0], ["b", "b"])
    with pytest.raises(ValueError):
        DynamicSamplingBuffer(train_batch_size=0, n_samples_per_prompt=2)
    with pytest.raises(ValueError):
        DynamicSamplingBuffer(train_batch_size=1, n_samples_per_prompt=2, max_num_gen_batches=-1)
