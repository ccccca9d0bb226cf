"""Context-parallel layout helpers in one process: Megatron's chunk layout, padding, local causal mask."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from megatron_dapo.distributed.context_parallel import (
    cp_chunk_positions,
    cp_pad_multiple,
    full_order_from_rank_parts,
    local_causal_mask,
    padded_length,
    split_for_cp_rank,
)


def test_pad_multiple_and_padded_length():
    assert cp_pad_multiple(1) == 1
    assert cp_pad_multiple(2) == 4
    assert cp_pad_multiple(2, tp_size=2, sequence_parallel=True) == 8
    assert cp_pad_multiple(2, tp_size=2, sequence_parallel=False) == 4
    assert padded_length(13, 4) == 16
    assert padded_length(16, 4) == 16


def test_chunks_pair_first_and_last_and_cover_sequence():
    assert cp_chunk_positions(8, 2, 0).tolist() == [0, 1, 6, 7]
    assert cp_chunk_positions(8, 2, 1).tolist() == [2, 3, 4, 5]
    everything = torch.cat([cp_chunk_positions(24, 3, r) for r in range(3)])
    assert sorted(everything.tolist()) == list(range(24))
    with pytest.raises(ValueError, match="not a multiple of 2\\*CP=4"):
        cp_chunk_positions(10, 2, 0)


class _FakeGroup:
    def __init__(self, size, rank):
        self._size, self._rank = size, rank

    def size(self):
        return self._size

    def rank(self):
        return self._rank


def _megatron_cp_split(monkeypatch):
    """Megatron's own CP split for a fake group of (size, rank), called as the installed release takes it:
    `(batch, cp_group)` up to 0.17, `(batch, is_hybrid_cp, cp_group=...)` from 0.18 on, where the group's
    size and rank are read through torch.distributed (answered for the fake group here)."""
    import inspect

    import torch.distributed as dist
    from megatron.core.utils import get_batch_on_this_cp_rank

    if "is_hybrid_cp" not in inspect.signature(get_batch_on_this_cp_rank).parameters:
        return lambda batch, group: get_batch_on_this_cp_rank(batch, group)
    for name, method in (("get_world_size", "size"), ("get_rank", "rank")):
        real = getattr(dist, name)
        monkeypatch.setattr(dist, name, lambda group=None, _real=real, _m=method: getattr(group, _m)() if isinstance(group, _FakeGroup) else _real(group))  # fmt: skip
    return lambda batch, group: get_batch_on_this_cp_rank(batch, is_hybrid_cp=False, cp_group=group)


def test_split_matches_megatron_get_batch_on_this_cp_rank(tmp_path, monkeypatch):
    import torch.distributed as dist

    created = not dist.is_initialized()
    if created:  # Megatron reads the group's size/rank only once torch.distributed is up
        dist.init_process_group("gloo", init_method=f"file://{tmp_path}/pg", rank=0, world_size=1)
    try:
        megatron_split = _megatron_cp_split(monkeypatch)
        tokens = torch.arange(2 * 24).view(2, 24)
        for cp in (2, 3):
            for rank in range(cp):
                ours = split_for_cp_rank(tokens, 1, cp, rank)
                theirs = megatron_split({"tokens": tokens.clone()}, _FakeGroup(cp, rank))["tokens"]
                assert theirs.shape[1] == 24 // cp  # Megatron did split (a whole batch back means the call was wrong)
                assert torch.equal(ours, theirs)
    finally:
        if created:
            dist.destroy_process_group()


def test_parts_reassemble_full_order():
    x = torch.randn(2, 12, 3)
    parts = [split_for_cp_rank(x, 1, 3, r) for r in range(3)]
    assert torch.equal(full_order_from_rank_parts(parts, 1), x)


def test_local_attention_with_local_mask_equals_slice_of_full_causal_attention():
    torch.manual_seed(0)
    seq, cp = 16, 2
    q, k, v = (torch.randn(1, 2, seq, 8, dtype=torch.float64) for _ in range(3))
    full = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    for rank in range(cp):
        local_q = split_for_cp_rank(q, 2, cp, rank)
        mask = local_causal_mask(seq, cp, rank)
        local = F.scaled_dot_product_attention(local_q, k, v, attn_mask=mask)
        assert torch.allclose(local, split_for_cp_rank(full, 2, cp, rank), atol=1e-12)
