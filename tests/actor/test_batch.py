"""PolicyBatch, micro-batch planning and the model inputs of a micro-batch (no Megatron, no processes).

The key property: whatever the layout (right-padded rows or THD packing), position
``gather_index[k, j]`` of the flattened labels holds response token ``j`` of sequence ``k``, and the
model input at that position is the token just before it - so the log-prob read there is that of
the response token given everything before it.
"""

from __future__ import annotations

import pytest
import torch

from megatron_dapo.actor.batch import PolicyBatch, build_micro_batch, plan_micro_batches, split_mini_batches


def _random_batch(n: int = 6, seed: int = 0, width: int = 9) -> PolicyBatch:
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(1, 100, (int(torch.randint(1, 6, (1,), generator=g)),), generator=g) for _ in range(n)]
    responses = [torch.randint(1, 100, (int(torch.randint(0, width + 1, (1,), generator=g)),), generator=g) for _ in range(n)]
    batch = PolicyBatch.from_token_lists(prompts, responses, response_width=width)
    batch.old_log_probs = -torch.rand(n, width, generator=g)
    batch.advantages = torch.randn(n, generator=g)
    return batch


def test_from_token_lists_layout():
    batch = PolicyBatch.from_token_lists([[5, 6, 7], [8]], [[1, 2], [3, 4, 9, 9]], pad_token_id=0)
    assert batch.prompt_ids.tolist() == [[5, 6, 7], [0, 0, 8]]  # left-padded
    assert batch.response_ids.tolist() == [[1, 2, 0, 0], [3, 4, 9, 9]]  # right-padded
    assert batch.prompt_lengths.tolist() == [3, 1] and batch.response_lengths.tolist() == [2, 4]
    assert batch.tokens_of(0).tolist() == [5, 6, 7, 1, 2] and batch.tokens_of(1).tolist() == [8, 3, 4, 9, 9]
    assert batch.model_lengths() == [4, 4]
    assert batch.loss_mask().tolist() == [[True, True, False, False], [True] * 4]


def test_validation_errors():
    batch = PolicyBatch.from_token_lists([[1, 2]], [[3, 4]])
    with pytest.raises(ValueError, match="past the end"):
        PolicyBatch.from_token_lists([[1]], [[2]], response_width=2, response_mask=torch.tensor([[True, True]]))
    with pytest.raises(ValueError, match="old_log_probs"):
        PolicyBatch.from_token_lists([[1]], [[2]], old_log_probs=torch.zeros(1, 3))
    with pytest.raises(ValueError, match="advantages"):
        PolicyBatch.from_token_lists([[1]], [[2]], advantages=torch.zeros(2))
    with pytest.raises(ValueError, match="prompt_lengths"):
        PolicyBatch(batch.prompt_ids, torch.tensor([0]), batch.response_ids, batch.response_lengths)
    with pytest.raises(ValueError, match="response_lengths"):
        PolicyBatch(batch.prompt_ids, batch.prompt_lengths, batch.response_ids, torch.tensor([3]))


def test_select_and_split_mini_batches():
    batch = _random_batch(7)
    part = batch.select([4, 1])
    assert part.num_sequences == 2 and torch.equal(part.old_log_probs, batch.old_log_probs[[4, 1]])
    assert part.tokens_of(0).tolist() == batch.tokens_of(4).tolist()
    sizes = [p.num_sequences for p in split_mini_batches(batch, 3)]
    assert sum(sizes) == 7 and max(sizes) - min(sizes) <= 1
    few = split_mini_batches(batch.select([0, 1]), 4)  # more mini-batches than sequences: empty parts
    assert [p.num_sequences for p in few].count(0) == 2
    assert few[0].response_width == batch.response_width


def test_plan_micro_batches():
    lengths = [5, 9, 3, 7, 2]
    assert plan_micro_batches(lengths, max_tokens=0, micro_batch_size=2, packed=False) == [[0, 1], [2, 3], [4]]
    assert plan_micro_batches(lengths, max_tokens=0, micro_batch_size=2, packed=False, min_count=5)[3:] == [[], []]
    for packed in (True, False):
        plan = plan_micro_batches(lengths, max_tokens=10, micro_batch_size=1, packed=packed, min_count=1)
        assert sorted(i for mb in plan for i in mb) == list(range(5))
        for mb in plan:
            cost = sum(lengths[i] for i in mb) if packed else max(lengths[i] for i in mb) * len(mb)
            assert cost <= 10 or len(mb) == 1
    assert plan_micro_batches([], max_tokens=10, micro_batch_size=1, packed=True, min_count=3) == [[], [], []]


def _check_alignment(batch: PolicyBatch, indices: list[int], mb) -> None:
    flat_labels = mb.labels.reshape(-1)
    flat_inputs = mb.input_ids.reshape(-1)
    for k, i in enumerate(indices):
        p, r = int(batch.prompt_lengths[i]), int(batch.response_lengths[i])
        tokens = batch.tokens_of(i)
        assert mb.response_valid[k].sum() == r
        assert flat_labels[mb.gather_index[k, :r]].tolist() == tokens[p:].tolist()
        assert flat_inputs[mb.gather_index[k, :r]].tolist() == tokens[p - 1 : p - 1 + r].tolist()
    assert mb.sequence_index.tolist() == indices


@pytest.mark.parametrize("seed", range(4))
def test_padded_micro_batch_alignment(seed):
    batch = _random_batch(6, seed)
    indices = [4, 0, 2]
    mb = build_micro_batch(batch, indices, pad_to_multiple_of=4)
    _check_alignment(batch, indices, mb)
    lengths = [batch.model_lengths()[i] for i in indices]
    assert mb.input_ids.shape == (3, -(-max(lengths) // 4) * 4) and mb.seq_length % 4 == 0
    assert mb.attention_mask is None and mb.packed_seq_params is None
    assert mb.position_ids[1].tolist() == list(range(mb.seq_length))
    assert mb.real_tokens == sum(lengths) and mb.computed_tokens == mb.input_ids.numel()
    width = max(int(batch.response_lengths[i]) for i in indices)
    assert mb.old_log_probs.shape == (3, width) and torch.equal(mb.old_log_probs, batch.old_log_probs[indices, :width])
    assert torch.equal(mb.advantages, batch.advantages[indices])


@pytest.mark.parametrize("pad_to_multiple_of", [1, 4])
def test_packed_micro_batch_alignment(pad_to_multiple_of):
    batch = _random_batch(6, seed=7)
    indices = [1, 3, 5, 0]
    mb = build_micro_batch(batch, indices, packed=True, pad_to_multiple_of=pad_to_multiple_of)
    _check_alignment(batch, indices, mb)
    assert mb.input_ids.shape[0] == 1 and mb.attention_mask is None
    params = mb.packed_seq_params
    assert params.qkv_format == "thd"
    assert params.cu_seqlens_q.tolist()[-1] == mb.input_ids.shape[1] == mb.computed_tokens  # padded slot offsets
    assert mb.real_tokens == sum(batch.model_lengths()[i] for i in indices)


def test_zero_token_micro_batch():
    batch = _random_batch(3)
    mb = build_micro_batch(batch, [], pad_to_multiple_of=2)
    assert mb.num_sequences == 0 and mb.input_ids.shape == (1, 2)
    assert mb.loss_mask.shape[0] == 0 and mb.gather_index.shape[0] == 0 and mb.real_tokens == 0


def test_masked_response_keeps_its_tokens_but_not_its_loss():
    batch = _random_batch(4, seed=3)
    mask = batch.response_valid_mask().clone()
    mask[2] = False
    batch.response_mask = mask
    mb = build_micro_batch(batch, [0, 1, 2, 3])
    assert torch.equal(mb.response_valid, batch.response_valid_mask()[:, : mb.response_valid.shape[1]])
    assert not mb.loss_mask[2].any()


def test_split_for_context_parallel_takes_megatrons_chunks():
    # (split_for_cp_rank itself is checked against Megatron's get_batch_on_this_cp_rank in tests/distributed.)
    from megatron_dapo.actor.batch import split_for_context_parallel
    from megatron_dapo.distributed.context_parallel import full_order_from_rank_parts

    batch = PolicyBatch.from_token_lists([[5, 6, 7], [8]], [[1, 2, 3, 4, 9], [3]])
    micro = build_micro_batch(batch, [0, 1], pad_to_multiple_of=4)  # 2*CP at CP=2
    assert micro.seq_length == 8 and micro.context_parallel == 1  # 7 tokens padded to a multiple of 4
    parts = [split_for_context_parallel(micro, 2, rank) for rank in range(2)]
    for rank, part in enumerate(parts):
        assert part.context_parallel == 2 and part.seq_length == 4
        chunks = [rank, 3 - rank]  # chunks r and 2*CP-1-r of 2-token chunks
        expected = torch.cat([micro.input_ids[:, 2 * c : 2 * c + 2] for c in chunks], dim=1)
        assert torch.equal(part.input_ids, expected)
        assert torch.equal(part.gather_index, micro.gather_index)  # response-aligned fields stay whole
        assert part.computed_tokens == micro.computed_tokens
    for name in ("input_ids", "position_ids", "labels"):
        assert torch.equal(full_order_from_rank_parts([getattr(p, name) for p in parts], 1), getattr(micro, name))
    with pytest.raises(ValueError, match="not a multiple of 2\\*CP"):
        split_for_context_parallel(build_micro_batch(batch, [0, 1]), 2, 0)
    with pytest.raises(ValueError, match="already split"):
        split_for_context_parallel(parts[0], 2, 0)
