"""Context-parallel (CP) sequence layout: padding, Megatron's load-balanced chunks, causal mask, gathers.

Megatron splits a sequence of length S (a multiple of 2*CP) into 2*CP equal chunks and gives rank r the
chunks r and 2*CP-1-r (`megatron.core.utils.get_batch_on_this_cp_rank`): under a causal mask an early
chunk is cheap and a late one expensive, so pairing them balances the work. Everything here uses that
exact layout so that Transformer Engine's CP attention and the SDPA path are interchangeable.

Pure helpers (no process group) are tested in one process; the two autograd gathers take a group.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def cp_pad_multiple(cp_size: int, tp_size: int = 1, sequence_parallel: bool = False) -> int:
    """Sequence lengths must be a multiple of this: 2*CP chunks, each split again over TP under SP."""
    if cp_size < 1 or tp_size < 1:
        raise ValueError(f"cp_size={cp_size} and tp_size={tp_size} must be >= 1")
    multiple = 2 * cp_size if cp_size > 1 else 1
    if sequence_parallel and tp_size > 1:
        multiple *= tp_size
    return multiple


def padded_length(seq_len: int, multiple: int) -> int:
    """Smallest length >= seq_len divisible by `multiple` (padded tokens must be loss-masked)."""
    return -(-seq_len // multiple) * multiple


def cp_chunk_positions(seq_len: int, cp_size: int, cp_rank: int) -> torch.Tensor:
    """Global token positions held by `cp_rank`, in its local order (chunk r then chunk 2*CP-1-r)."""
    if cp_size == 1:
        return torch.arange(seq_len)
    if seq_len % (2 * cp_size):
        raise ValueError(f"sequence length {seq_len} is not a multiple of 2*CP={2 * cp_size}: pad it first")
    if not 0 <= cp_rank < cp_size:
        raise ValueError(f"cp_rank={cp_rank} outside [0, {cp_size})")
    chunk = seq_len // (2 * cp_size)
    first = torch.arange(cp_rank * chunk, (cp_rank + 1) * chunk)
    last_index = 2 * cp_size - 1 - cp_rank
    second = torch.arange(last_index * chunk, (last_index + 1) * chunk)
    return torch.cat([first, second])


def split_for_cp_rank(tensor: torch.Tensor, seq_dim: int, cp_size: int, cp_rank: int) -> torch.Tensor:
    """This rank's part of a full-sequence tensor (same result as Megatron's get_batch_on_this_cp_rank)."""
    if cp_size == 1:
        return tensor
    positions = cp_chunk_positions(tensor.shape[seq_dim], cp_size, cp_rank).to(tensor.device)
    return tensor.index_select(seq_dim, positions)


def full_order_from_rank_parts(parts: list[torch.Tensor], seq_dim: int) -> torch.Tensor:
    """Inverse of split_for_cp_rank: rank parts (in CP-rank order) back to full sequence order."""
    cp_size = len(parts)
    if cp_size == 1:
        return parts[0]
    seq_len = parts[0].shape[seq_dim] * cp_size
    positions = torch.cat([cp_chunk_positions(seq_len, cp_size, r) for r in range(cp_size)])
    stacked = torch.cat(parts, dim=seq_dim)
    inverse = torch.empty_like(positions)
    inverse[positions] = torch.arange(seq_len)
    return stacked.index_select(seq_dim, inverse.to(stacked.device))


def local_causal_mask(seq_len: int, cp_size: int, cp_rank: int, device=None) -> torch.Tensor:
    """Boolean [local_len, seq_len] mask, True where a local query may attend a key in full order.

    Per local chunk this is the lower-right-aligned causal mask against the key prefix that ends with
    that chunk; keys after the chunk are masked.
    """
    query_positions = cp_chunk_positions(seq_len, cp_size, cp_rank).to(device)
    key_positions = torch.arange(seq_len, device=device)
    return query_positions[:, None] >= key_positions[None, :]


class _GatherSequence(torch.autograd.Function):
    """All-gather rank parts along `seq_dim` into full order; backward keeps the sum's rank slice.

    The backward is a reduce-scatter (sum of every rank's gradient for this rank's tokens). Gloo has no
    reduce_scatter, so it is an all-reduce followed by selecting the rank's positions.
    """

    @staticmethod
    def forward(ctx, local: torch.Tensor, seq_dim: int, group) -> torch.Tensor:
        cp_size = dist.get_world_size(group)
        ctx.seq_dim, ctx.group = seq_dim, group
        ctx.cp_rank = dist.get_rank(group)
        ctx.cp_size = cp_size
        parts = [torch.empty_like(local) for _ in range(cp_size)]
        dist.all_gather(parts, local.contiguous(), group=group)
        return full_order_from_rank_parts(parts, seq_dim)

    @staticmethod
    def backward(ctx, grad_full: torch.Tensor):
        grad_sum = grad_full.contiguous().clone()
        dist.all_reduce(grad_sum, group=ctx.group)
        return split_for_cp_rank(grad_sum, ctx.seq_dim, ctx.cp_size, ctx.cp_rank), None, None


class _GatherSequenceKeepSlice(torch.autograd.Function):
    """All-gather per-token values (log-probs, entropy); backward keeps only this rank's slice.

    Use when every rank computes the same loss from the gathered values: each rank's gradient for its
    own tokens is then already complete, and summing over ranks would count it CP times.
    """

    @staticmethod
    def forward(ctx, local: torch.Tensor, seq_dim: int, group) -> torch.Tensor:
        cp_size = dist.get_world_size(group)
        ctx.seq_dim, ctx.cp_size, ctx.cp_rank = seq_dim, cp_size, dist.get_rank(group)
        parts = [torch.empty_like(local) for _ in range(cp_size)]
        dist.all_gather(parts, local.contiguous(), group=group)
        return full_order_from_rank_parts(parts, seq_dim)

    @staticmethod
    def backward(ctx, grad_full: torch.Tensor):
        return split_for_cp_rank(grad_full, ctx.seq_dim, ctx.cp_size, ctx.cp_rank), None, None


def gather_sequence_sum_grads(local: torch.Tensor, seq_dim: int, group) -> torch.Tensor:
    """For K/V: every rank uses the full K/V, so each rank's dK/dV is the sum over ranks (reduce-scatter)."""
    if group is None or dist.get_world_size(group) == 1:
        return local
    return _GatherSequence.apply(local, seq_dim, group)


def gather_sequence_keep_slice(local: torch.Tensor, seq_dim: int, group) -> torch.Tensor:
    """For per-token outputs consumed identically on every rank: backward keeps this rank's slice."""
    if group is None or dist.get_world_size(group) == 1:
        return local
    return _GatherSequenceKeepSlice.apply(local, seq_dim, group)
