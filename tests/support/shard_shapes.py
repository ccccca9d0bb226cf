"""A small GQA model's HF tensor shapes, for the pure TP-shard tests (test_weight_sync, test_shard_handover)."""

from __future__ import annotations

import torch

SHARD_SHAPE = dict(hidden=16, heads=8, groups=4, head_dim=4, ffn=24, vocab=300, experts=2)


def hf_tensor(name: str, g: torch.Generator) -> torch.Tensor:
    """A random full HF tensor for `name` in a small GQA model (SHARD_SHAPE), dense or mixture of experts."""
    s = SHARD_SHAPE
    q_rows, kv_rows = s["heads"] * s["head_dim"], s["groups"] * s["head_dim"]
    sizes = {
        "shared_expert_gate.weight": (1, s["hidden"]),
        "mlp.gate.weight": (s["experts"], s["hidden"]),  # the MoE router
        "embed_tokens.weight": (s["vocab"], s["hidden"]),
        "lm_head.weight": (s["vocab"], s["hidden"]),
        "q_proj.weight": (q_rows, s["hidden"]),
        "k_proj.weight": (kv_rows, s["hidden"]),
        "v_proj.weight": (kv_rows, s["hidden"]),
        "q_proj.bias": (q_rows,),
        "k_proj.bias": (kv_rows,),
        "v_proj.bias": (kv_rows,),
        "q_norm.weight": (s["head_dim"],),
        "k_norm.weight": (s["head_dim"],),
        "o_proj.weight": (s["hidden"], q_rows),
        "gate_proj.weight": (s["ffn"], s["hidden"]),
        "up_proj.weight": (s["ffn"], s["hidden"]),
        "down_proj.weight": (s["hidden"], s["ffn"]),
        "layernorm.weight": (s["hidden"],),
        "norm.weight": (s["hidden"],),
    }
    for suffix, shape in sizes.items():
        if name.endswith(suffix):
            return torch.randn(shape, generator=g)
    raise KeyError(name)
