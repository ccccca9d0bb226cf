"""`actor.routing`'s pure layout functions against hand-built references: where each token's routing
sits in a micro-batch and in the order a Megatron router sees this rank's tokens."""

from __future__ import annotations

import pytest
import torch

from megatron_dapo.actor.batch import PolicyBatch, build_micro_batch
from megatron_dapo.actor.routing import (
    fill_routing,
    local_token_order,
    micro_batch_routing,
    routing_mismatch,
    scatter_recorded,
)


def _batch():
    batch = PolicyBatch.from_token_lists([[1, 2, 3], [4]], [[5, 6], [7, 8, 9, 10]], response_width=4)
    n, width = batch.num_sequences, batch.sequence_width  # T = 3 + 4 - 1 = 6
    # Routing value = 100 * sequence + 10 * position + layer, in both top-k slots (+0, +1000).
    base = torch.arange(n)[:, None, None] * 100 + torch.arange(width)[None, :, None] * 10 + torch.arange(2)[None, None, :]
    batch.routed_experts = torch.stack([base, base + 1000], dim=-1).to(torch.int32)
    return batch


def test_micro_batch_routing_follows_the_tokens_and_fills_padding():
    batch = _batch()
    mb = build_micro_batch(batch, [1, 0], pad_to_multiple_of=8)  # rows: sequence 1 (4 tokens read), then 0 (4)
    assert mb.token_source.tolist() == [[6, 7, 8, 9, -1, -1, -1, -1], [0, 1, 2, 3, -1, -1, -1, -1]]  # T = 6
    routed = mb.routed_experts
    assert routed.shape == (2, 8, 2, 2)
    assert routed[0, 2, 1].tolist() == [100 + 20 + 1, 1000 + 100 + 20 + 1]  # sequence 1, position 2, layer 1
    assert torch.equal(routed[0, 5], fill_routing((2, 2)))  # padding: experts 0..k-1
    batch.routed_experts[0, 1] = -1  # a position the routing does not cover: filled, never indexed with -1
    assert torch.equal(micro_batch_routing(batch.routed_experts, mb.token_source)[1, 1], fill_routing((2, 2)))


def test_local_token_order_is_sequence_major_after_cp_and_sp_splits():
    rows, seq = 2, 8
    positions = torch.arange(rows * seq).view(rows, seq)  # value = row * seq + s
    plain = local_token_order(positions)
    assert plain.tolist() == [r * seq + s for s in range(seq) for r in range(rows)]
    # CP=2, rank 1 keeps chunks 1 and 2 of 4 (positions 2,3 and 4,5); SP=2, rank 1 keeps the second half.
    cp = local_token_order(positions, cp_size=2, cp_rank=1)
    assert cp.tolist() == [r * seq + s for s in (2, 3, 4, 5) for r in range(rows)]
    both = local_token_order(positions, cp_size=2, cp_rank=1, sp_size=2, sp_rank=1)
    assert both.tolist() == [r * seq + s for s in (4, 5) for r in range(rows)]
    with pytest.raises(ValueError, match="not a multiple of the sequence-parallel size 3"):
        local_token_order(positions, sp_size=3)


def test_scatter_recorded_inverts_the_layout():
    batch = _batch()
    mb = build_micro_batch(batch, [0, 1], pad_to_multiple_of=8)  # CP=2 x SP=2: a multiple of 2 * 2 * 2
    target = torch.full_like(batch.routed_experts, -1)
    for cp_rank in range(2):
        for sp_rank in range(2):
            order = dict(cp_size=2, cp_rank=cp_rank, sp_size=2, sp_rank=sp_rank)
            local = local_token_order(mb.routed_experts, **order)  # what this rank's routers would choose
            positions = local_token_order(mb.token_source, **order)
            for layer in range(2):
                scatter_recorded(target, local[:, layer], positions, layer)
    read = batch.read_mask()
    assert torch.equal(target[read], batch.routed_experts[read])
    assert bool((target[~read] == -1).all())


def test_routing_mismatch_ignores_expert_order_and_other_stages_layers():
    engine = torch.tensor([[[[0, 1], [2, 3]], [[4, 5], [6, 7]]]])  # [n=1, T=2, L=2, k=2]
    actor = torch.tensor([[[[1, 0], [2, 4]], [[4, 5], [-1, -1]]]])  # token 0 differs in layer 1; token 1's layer 1 elsewhere
    differs, layers = routing_mismatch(engine, actor, torch.tensor([[True, True]]))
    assert differs.tolist() == [[True, False]] and layers.tolist() == [[1, 0]]
    differs, _ = routing_mismatch(engine, actor, torch.tensor([[False, True]]))
    assert differs.tolist() == [[False, False]]
