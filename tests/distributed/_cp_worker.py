"""Subprocess body for test_context_parallel_dist.py: CP=2 attention and per-token gathers vs one process."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F


def attention_and_gathers() -> dict:
    from megatron_dapo.distributed.context_parallel import (
        gather_sequence_keep_slice,
        gather_sequence_sum_grads,
        local_causal_mask,
        split_for_cp_rank,
    )

    dist.init_process_group("gloo")
    rank, cp = dist.get_rank(), dist.get_world_size()
    group = dist.group.WORLD
    torch.manual_seed(0)  # same full tensors on every rank: the single-process reference
    seq = 12  # 3 tokens per chunk at CP=2
    q, k, v = (torch.randn(1, 4, seq, 8, dtype=torch.float64, requires_grad=True) for _ in range(3))
    upstream = torch.randn(1, 4, seq, 8, dtype=torch.float64)
    token_weights = torch.randn(1, seq, dtype=torch.float64)

    full = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    (full * upstream).sum().backward()

    # CP: each rank holds its chunks of q, k, v; K/V are all-gathered (backward sums dK/dV over ranks).
    local_q, local_k, local_v = (split_for_cp_rank(t.detach(), 2, cp, rank).requires_grad_() for t in (q, k, v))
    gathered_k = gather_sequence_sum_grads(local_k, 2, group)
    gathered_v = gather_sequence_sum_grads(local_v, 2, group)
    local_out = F.scaled_dot_product_attention(local_q, gathered_k, gathered_v, attn_mask=local_causal_mask(seq, cp, rank))
    (local_out * split_for_cp_rank(upstream, 2, cp, rank)).sum().backward()

    # Per-token values gathered to full order, the same loss on every rank; backward keeps the slice.
    local_tokens = split_for_cp_rank(torch.arange(seq, dtype=torch.float64)[None], 1, cp, rank).requires_grad_()
    gathered_tokens = gather_sequence_keep_slice(local_tokens, 1, group)
    (gathered_tokens * token_weights).sum().backward()

    def err(a, b):
        return (a - b).abs().max().item()

    out = {
        "out": err(local_out, split_for_cp_rank(full.detach(), 2, cp, rank)),
        "dq": err(local_q.grad, split_for_cp_rank(q.grad, 2, cp, rank)),
        "dk": err(local_k.grad, split_for_cp_rank(k.grad, 2, cp, rank)),
        "dv": err(local_v.grad, split_for_cp_rank(v.grad, 2, cp, rank)),
        "tokens_full_order": gathered_tokens.detach()[0].tolist() == list(range(seq)),
        "token_grad": err(local_tokens.grad, split_for_cp_rank(token_weights, 1, cp, rank)),
    }
    dist.destroy_process_group()
    return out


def sdpa_module_cp() -> dict:
    """SDPADotProductAttention at CP=2 (GQA, length 12 = 3 tokens per chunk) vs the module at CP=1."""
    from types import SimpleNamespace

    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_dapo.distributed.context_parallel import split_for_cp_rank
    from megatron_dapo.model.sdpa_attention import SDPADotProductAttention

    dist.init_process_group("gloo")
    rank, cp = dist.get_rank(), dist.get_world_size()

    def module(cp_size):
        config = TransformerConfig(
            num_layers=1, hidden_size=64, num_attention_heads=4, num_query_groups=2, kv_channels=16,
            attention_dropout=0.0, hidden_dropout=0.0, use_cpu_initialization=True,
        )  # fmt: skip
        config.context_parallel_size = cp_size  # after validation, which checks CP against Megatron's groups
        return SDPADotProductAttention(
            config, layer_number=1, attn_mask_type=AttnMaskType.causal, attention_type="self",
            pg_collection=SimpleNamespace(tp=None, cp=dist.group.WORLD),
        ).eval()  # fmt: skip

    torch.manual_seed(0)
    seq = 12
    q = torch.randn(seq, 2, 4, 16, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(seq, 2, 2, 16, dtype=torch.float64, requires_grad=True) for _ in range(2))
    upstream = torch.randn(seq, 2, 64, dtype=torch.float64)
    reference = module(1)(q, k, v, None)
    (reference * upstream).sum().backward()

    local = [split_for_cp_rank(t.detach(), 0, cp, rank).requires_grad_() for t in (q, k, v)]
    out = module(cp)(*local, None)
    (out * split_for_cp_rank(upstream, 0, cp, rank)).sum().backward()
    errors = {"out": (out - split_for_cp_rank(reference.detach(), 0, cp, rank)).abs().max().item()}
    for name, full, part in zip(("dq", "dk", "dv"), (q, k, v), local):
        errors[name] = (part.grad - split_for_cp_rank(full.grad, 0, cp, rank)).abs().max().item()
    dist.destroy_process_group()
    return errors
