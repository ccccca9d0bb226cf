"""Tests for token-budget micro-batches and packed / padded inputs (megatron_dapo/data/micro_batches.py)."""

from __future__ import annotations

import math
import random
import warnings

import pytest
import torch

from megatron_dapo.data.micro_batches import (
    micro_batch_cost,
    pack_sequences,
    pad_overhead,
    pad_sequences,
    split_into_micro_batches,
    unpack,
    unpad,
)


def dapo_like_lengths(n: int, seed: int, max_len: int = 20480) -> list[int]:
    """Prompts 50-300 tokens; responses mostly short-to-medium, 10% truncated at the maximum."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        prompt = rng.randint(50, 300)
        response = max_len if rng.random() < 0.1 else min(max_len, 1 + int(rng.expovariate(1 / 3000)))
        out.append(prompt + response)
    return out


def costs(bins, lengths, packed):
    return [micro_batch_cost([lengths[i] for i in b], packed) for b in bins]


def assert_partition(bins, n):
    flat = [i for b in bins for i in b]
    assert sorted(flat) == list(range(n)), "every index exactly once"
    assert all(b == sorted(b) for b in bins), "indices ascending inside a micro-batch"


@pytest.mark.parametrize("packed", [True, False])
@pytest.mark.parametrize("seed", range(6))
def test_partition_and_budget_on_random_data(packed, seed):
    rng = random.Random(seed)
    n = rng.choice([1, 2, 7, 64, 300])
    lengths = [rng.randint(1, 5000) for _ in range(n)]
    budget = rng.choice([5000, 8192, 20000])
    bins = split_into_micro_batches(lengths, budget, packed=packed)
    assert_partition(bins, n)
    assert all(b for b in bins)
    assert max(costs(bins, lengths, packed)) <= budget
    # Not wasteful: never more micro-batches than sequences, and close to the lower bound when packed.
    lower = math.ceil(sum(lengths) / budget)
    assert lower <= len(bins) <= n
    if packed:
        assert len(bins) <= lower + 2
    # Ordered costliest first.
    c = costs(bins, lengths, packed)
    assert c == sorted(c, reverse=True)


def test_cost_models():
    assert micro_batch_cost([3, 5, 2], packed=True) == 10
    assert micro_batch_cost([3, 5, 2], packed=False) == 15
    assert micro_batch_cost([], packed=False) == 0
    # Three sequences of 4 with budget 10: packed holds two per micro-batch (8), padded too (2*4);
    # 6+4: packed fits together (10), padded needs 2*6=12 > 10.
    assert len(split_into_micro_batches([6, 4], 10, packed=True)) == 1
    assert len(split_into_micro_batches([6, 4], 10, packed=False)) == 2


def test_packed_balance_on_dapo_like_lengths():
    lengths = dapo_like_lengths(1024, seed=3)
    for budget in (20480 + 512, 2 * 20480 + 1024, 65536):
        bins = split_into_micro_batches(lengths, budget, packed=True)
        c = costs(bins, lengths, True)
        assert max(c) <= budget
        assert max(c) / min(c) < 1.1, f"budget {budget}: token counts {min(c)}..{max(c)} are not balanced"
        assert len(bins) <= math.ceil(sum(lengths) / budget) + 2


def test_padded_split_keeps_similar_lengths_together():
    lengths = dapo_like_lengths(512, seed=4)
    budget = 2 * 20480 + 1024
    padded = split_into_micro_batches(lengths, budget, packed=False)
    assert max(costs(padded, lengths, False)) <= budget
    # Sorted, consecutive runs waste little; a naive fixed micro-batch of 2 in arrival order wastes a lot.
    naive = [list(range(i, min(i + 2, len(lengths)))) for i in range(0, len(lengths), 2)]
    assert pad_overhead(padded, lengths, packed=False) < 0.05
    assert pad_overhead(naive, lengths, packed=False) > 0.2


def _set_partitions(items):
    """Every way to split ``items`` into non-empty groups (Bell-number many)."""
    if not items:
        yield []
        return
    first, rest = items[0], items[1:]
    for partition in _set_partitions(rest):
        yield [[first]] + partition
        for g in range(len(partition)):
            yield partition[:g] + [[first] + partition[g]] + partition[g + 1 :]


def _best_max_padded_cost_per_count(lengths):
    """Brute force: for each micro-batch count k, the smallest possible costliest padded micro-batch."""
    best = {}
    for partition in _set_partitions(list(lengths)):
        worst = max(micro_batch_cost(g, False) for g in partition)
        k = len(partition)
        best[k] = min(best.get(k, worst), worst)
    return best


@pytest.mark.parametrize("seed", range(8))
def test_padded_costliest_micro_batch_is_optimal_for_its_count(seed):
    rng = random.Random(100 + seed)
    lengths = [rng.randint(1, 40) for _ in range(rng.randint(3, 8))]
    budget = rng.randint(max(lengths), 2 * sum(lengths))
    best = _best_max_padded_cost_per_count(lengths)
    for k in range(1, len(lengths) + 1):
        bins = split_into_micro_batches(lengths, budget, min_num_micro_batches=k, packed=False)
        assert_partition(bins, len(lengths))
        if len(bins) == k:
            assert max(costs(bins, lengths, False)) == best[k]


@pytest.mark.parametrize("packed", [True, False])
def test_min_num_micro_batches_gives_exactly_that_many(packed):
    lengths = dapo_like_lengths(64, seed=5)
    budget = 2 * 20480 + 1024
    needed = len(split_into_micro_batches(lengths, budget, packed=packed))
    for k in (1, needed, needed + 1, needed + 9, 63, 64):
        bins = split_into_micro_batches(lengths, budget, min_num_micro_batches=k, packed=packed)
        assert len(bins) == max(k, needed)
        assert_partition(bins, len(lengths))
        assert all(bins), "non-empty while there are at least k samples"
        assert max(costs(bins, lengths, packed)) <= budget


def test_min_num_micro_batches_as_the_trainer_uses_it():
    """Each DP rank splits its own data; MAX of the counts, re-split: every rank gets the same count."""
    budget = 2 * 20480 + 1024
    ranks = [dapo_like_lengths(n, seed=10 + r) for r, n in enumerate([40, 64, 64, 17])]
    for packed in (True, False):
        target = max(len(split_into_micro_batches(lens, budget, packed=packed)) for lens in ranks)
        for lens in ranks:
            bins = split_into_micro_batches(lens, budget, min_num_micro_batches=target, packed=packed)
            assert len(bins) == target
            assert_partition(bins, len(lens))
            assert max(costs(bins, lens, packed)) <= budget


def test_fewer_samples_than_micro_batches_ends_with_empty_ones():
    bins = split_into_micro_batches([5, 9, 7], 100, min_num_micro_batches=5)
    assert bins == [[1], [2], [0], [], []]
    assert split_into_micro_batches([], 100, min_num_micro_batches=3) == [[], [], []]
    assert split_into_micro_batches([], 100) == [[]]


def test_over_long_sequence_gets_its_own_micro_batch_with_a_warning():
    lengths = [50, 300, 40, 30, 250]
    with pytest.warns(UserWarning, match=r"2 sequence\(s\) exceed 'trainer.max_tokens_per_micro_batch'=100"):
        bins = split_into_micro_batches(lengths, 100)
    assert_partition(bins, len(lengths))
    assert [1] in bins and [4] in bins
    assert all(micro_batch_cost([lengths[i] for i in b], True) <= 100 for b in bins if len(b) > 1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        split_into_micro_batches([100, 100], 100)  # exactly at the budget: no warning


def test_deterministic_and_input_errors():
    lengths = dapo_like_lengths(200, seed=6)
    for packed in (True, False):
        first = split_into_micro_batches(lengths, 30000, packed=packed)
        assert split_into_micro_batches(list(lengths), 30000, packed=packed) == first
    with pytest.raises(ValueError, match="max_tokens_per_micro_batch"):
        split_into_micro_batches([1], 0)
    with pytest.raises(ValueError, match="min_num_micro_batches"):
        split_into_micro_batches([1], 10, min_num_micro_batches=0)
    with pytest.raises(ValueError, match=">= 0"):
        split_into_micro_batches([-1], 10)


def test_zero_length_sequences_do_not_create_empty_micro_batches():
    bins = split_into_micro_batches([0, 0, 0, 5], 10, min_num_micro_batches=3)
    assert len(bins) == 3 and all(bins)
    assert_partition(bins, 4)


def test_pad_overhead():
    lengths = [10, 4, 6]
    assert pad_overhead([[0, 1], [2]], lengths, packed=True) == 0.0
    # [10, 4] padded to 2 x 10 = 20 computed, 14 real; [6]: 6 and 6 -> 1 - 20/26.
    assert pad_overhead([[0, 1], [2]], lengths, packed=False) == pytest.approx(1 - 20 / 26)
    assert pad_overhead([], lengths, packed=False) == 0.0


# ----------------------------------------------------------------------------- packed / padded inputs


def _sequences():
    return [torch.tensor([5, 6, 7]), torch.tensor([8]), torch.tensor([9, 10, 11, 12, 13])]


def test_pack_sequences_layout():
    packed = pack_sequences(_sequences())
    assert packed.input_ids.tolist() == [[5, 6, 7, 8, 9, 10, 11, 12, 13]]
    assert packed.position_ids.tolist() == [[0, 1, 2, 0, 0, 1, 2, 3, 4]]
    assert packed.cu_seqlens.dtype == torch.int32
    assert packed.cu_seqlens.tolist() == [0, 3, 4, 9]
    assert torch.equal(packed.cu_seqlens_padded, packed.cu_seqlens)
    assert packed.max_seqlen == 5
    assert packed.lengths.tolist() == [3, 1, 5]
    assert packed.loss_mask.tolist() == [[1.0] * 9]
    params = packed.packed_seq_params()
    assert params.qkv_format == "thd" and params.max_seqlen_q == params.max_seqlen_kv == 5
    assert params.cu_seqlens_q.tolist() == [0, 3, 4, 9]  # no padding: the slot offsets are the real ones


def test_pack_with_per_sequence_padding_and_loss_masks():
    masks = [torch.tensor([0, 1, 1]), torch.tensor([1]), torch.tensor([0, 0, 1, 1, 1])]
    packed = pack_sequences(_sequences(), pad_to_multiple_of=4, pad_token_id=-1, loss_masks=masks)
    assert packed.cu_seqlens.tolist() == [0, 3, 4, 9]
    assert packed.cu_seqlens_padded.tolist() == [0, 4, 8, 16]
    assert packed.input_ids.tolist() == [[5, 6, 7, -1, 8, -1, -1, -1, 9, 10, 11, 12, 13, -1, -1, -1]]
    assert packed.position_ids.tolist() == [[0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3, 4, 5, 6, 7]]
    assert packed.loss_mask.tolist() == [[0, 1, 1, 0, 1, 0, 0, 0, 0, 0, 1, 1, 1, 0, 0, 0]]
    assert packed.max_seqlen == 8
    params = packed.packed_seq_params()
    assert params.cu_seqlens_q.tolist() == params.cu_seqlens_kv.tolist() == [0, 4, 8, 16]  # slots, not [0, 3, 4, 9]
    assert params.max_seqlen_q == params.max_seqlen_kv == 8
    # Round trip drops the padding slots.
    parts = unpack(packed.input_ids, packed.cu_seqlens, packed.cu_seqlens_padded)
    assert [p.tolist() for p in parts] == [s.tolist() for s in _sequences()]


def test_pack_unpack_round_trip_random():
    gen = torch.Generator().manual_seed(0)
    seqs = [torch.randint(0, 1000, (int(n),), generator=gen) for n in torch.randint(1, 50, (20,), generator=gen)]
    packed = pack_sequences(seqs)
    assert packed.input_ids.shape == (1, sum(len(s) for s in seqs))
    for values in (packed.input_ids, packed.input_ids[0], packed.input_ids.unsqueeze(-1).expand(1, -1, 3)):
        parts = unpack(values, packed.cu_seqlens)
        assert len(parts) == len(seqs)
        for part, seq in zip(parts, seqs):
            assert torch.equal(part.reshape(len(seq), -1)[:, 0], seq)
    # Per-token values of a packed forward (e.g. log-probs) come back per sequence.
    fake_log_probs = packed.position_ids.float()
    for part, seq in zip(unpack(fake_log_probs, packed.cu_seqlens), seqs):
        assert torch.equal(part, torch.arange(len(seq)).float())


def test_pad_sequences_and_unpad():
    masks = [torch.tensor([0, 1, 1]), torch.tensor([1]), torch.tensor([0, 0, 1, 1, 1])]
    padded = pad_sequences(_sequences(), pad_token_id=0, loss_masks=masks, pad_to_multiple_of=2)
    assert padded.input_ids.tolist() == [[5, 6, 7, 0, 0, 0], [8, 0, 0, 0, 0, 0], [9, 10, 11, 12, 13, 0]]
    assert padded.valid_mask.tolist() == [
        [True, True, True, False, False, False],
        [True, False, False, False, False, False],
        [True, True, True, True, True, False],
    ]
    assert padded.loss_mask.tolist() == [[0, 1, 1, 0, 0, 0], [1, 0, 0, 0, 0, 0], [0, 0, 1, 1, 1, 0]]
    assert padded.position_ids.tolist() == [list(range(6))] * 3
    assert padded.lengths.tolist() == [3, 1, 5]
    assert [p.tolist() for p in unpad(padded.input_ids, padded.lengths)] == [s.tolist() for s in _sequences()]
    default = pad_sequences(_sequences())
    assert torch.equal(default.loss_mask.bool(), default.valid_mask)
    assert default.input_ids.shape == (3, 5)


def test_input_validation():
    with pytest.raises(ValueError, match="loss mask 1"):
        pack_sequences(_sequences(), loss_masks=[torch.ones(3), torch.ones(2), torch.ones(5)])
    with pytest.raises(ValueError, match="1-D"):
        pad_sequences([torch.zeros(2, 2)])
    with pytest.raises(ValueError, match="pad_to_multiple_of"):
        pack_sequences(_sequences(), pad_to_multiple_of=0)


# ----------------------------------------------------------------------------- what TE attention gets


@pytest.mark.parametrize("pad_to_multiple_of", [1, 4])
def test_packed_seq_params_pass_the_padded_offsets_for_q_and_kv_as_one_object(pad_to_multiple_of):
    """Every offset field is the slot boundaries (one tensor object), as Megatron-LM's data schedule and
    verl's preprocess_packed_seqs pass them; the real offsets stay on the batch for `unpack`."""
    from megatron.core.packed_seq_params import PackedSeqParams

    packed = pack_sequences(_sequences(), pad_to_multiple_of=pad_to_multiple_of)
    params = packed.packed_seq_params()
    assert isinstance(params, PackedSeqParams)
    offsets = packed.cu_seqlens_padded
    for field in ("cu_seqlens_q", "cu_seqlens_kv", "cu_seqlens_q_padded", "cu_seqlens_kv_padded"):
        assert getattr(params, field) is offsets, field
    assert offsets.dtype == torch.int32 and offsets.tolist()[-1] == packed.input_ids.shape[1]
    assert params.max_seqlen_q == params.max_seqlen_kv == max((offsets[1:] - offsets[:-1]).tolist())


def _te_pad_between_seqs(params) -> bool:
    """Transformer Engine's auto-detection of padding between packed sequences (thd), transcribed from
    transformer_engine/pytorch/attention/dot_product_attention/dot_product_attention.py of
    NVIDIA/TransformerEngine at d0067d0da6cb01811b8072a7d304f0e00344ce2b (DotProductAttention.forward,
    ``pad_between_seqs=None``). True disables FlashAttention 2/4 and the unfused backend."""
    if params.cu_seqlens_q_padded is params.cu_seqlens_q and params.cu_seqlens_kv_padded is params.cu_seqlens_kv:
        return False
    return params.cu_seqlens_q_padded is not None or params.cu_seqlens_kv_padded is not None


def test_contract_megatron_hands_the_fields_to_te_unchanged_and_te_sees_no_padding_between_sequences():
    """Megatron-Core (installed: 0.16.1) forwards PackedSeqParams' fields to TE by getattr (the same
    objects) and rotates THD queries/keys with the padded offsets; TE then sees no padding between
    sequences. The previous form (real offsets next to padded ones) would have, with FlashAttention
    ruled out."""
    import dataclasses
    import importlib.util
    from pathlib import Path

    from megatron.core.packed_seq_params import PackedSeqParams

    fields = {f.name for f in dataclasses.fields(PackedSeqParams)}
    assert {"qkv_format", "cu_seqlens_q", "cu_seqlens_kv", "cu_seqlens_q_padded", "cu_seqlens_kv_padded",
            "max_seqlen_q", "max_seqlen_kv"} <= fields  # fmt: skip
    core = Path(importlib.util.find_spec("megatron.core").origin).parent
    te_wrapper = (core / "extensions" / "transformer_engine.py").read_text()
    assert "field.name for field in dataclasses.fields(PackedSeqParams)" in te_wrapper  # every field is kept ...
    assert "{key: getattr(packed_seq_params, key) for key in self.kept_packed_seq_params}" in te_wrapper  # ... as is
    attention = (core / "transformer" / "attention.py").read_text()
    assert "cu_seqlens_q = packed_seq_params.cu_seqlens_q_padded" in attention  # RoPE restarts per slot

    padded = pack_sequences(_sequences(), pad_to_multiple_of=4)
    assert _te_pad_between_seqs(padded.packed_seq_params()) is False
    old_form = PackedSeqParams(
        qkv_format="thd", cu_seqlens_q=padded.cu_seqlens, cu_seqlens_kv=padded.cu_seqlens,
        cu_seqlens_q_padded=padded.cu_seqlens_padded, cu_seqlens_kv_padded=padded.cu_seqlens_padded,
        max_seqlen_q=padded.max_seqlen, max_seqlen_kv=padded.max_seqlen,
    )  # fmt: skip
    assert _te_pad_between_seqs(old_form) is True


def test_attention_over_padded_slots_equals_attention_over_the_real_sequences():
    """Why the padded offsets are exact: causal attention run per padded slot (what TE computes when the
    slots are the sequences) gives every real token the output of attention over its own sequence."""
    gen = torch.Generator().manual_seed(0)
    lengths = [3, 1, 5, 7, 2]
    packed = pack_sequences([torch.zeros(n, dtype=torch.long) for n in lengths], pad_to_multiple_of=4)
    heads, dim, total = 2, 8, packed.input_ids.shape[1]
    q, k, v = (torch.randn(heads, total, dim, generator=gen, dtype=torch.float64) for _ in range(3))

    def causal(qs, ks, vs):
        return torch.nn.functional.scaled_dot_product_attention(qs, ks, vs, is_causal=True)

    offsets = packed.packed_seq_params().cu_seqlens_q.tolist()
    per_slot = torch.cat([causal(q[:, a:b], k[:, a:b], v[:, a:b]) for a, b in zip(offsets[:-1], offsets[1:])], dim=1)
    starts = packed.cu_seqlens_padded[:-1].tolist()
    for start, n in zip(starts, lengths):
        real = causal(q[:, start : start + n], k[:, start : start + n], v[:, start : start + n])
        torch.testing.assert_close(per_slot[:, start : start + n], real, rtol=0, atol=1e-12)
