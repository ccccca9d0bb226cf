"""`sglang_engine.hf_tensors_from_sglang_shards` (how `SGLangEngine.named_weights` turns SGLang's
per-TP-rank parameters back into HF tensors), pure: HF tensors are sharded the way SGLang 0.5.23's
parallel layers hold them (QKVParallelLinear: [q_r; k_r; v_r] per rank, a KV head replicated on
tp / kv_heads ranks when TP exceeds the KV heads; MergedColumnParallelLinear: [gate_r; up_r];
RowParallelLinear: split on dim 1; VocabParallelEmbedding / ParallelLMHead: rows padded to a
multiple of 64, split on dim 0; norms replicated; a tied embedding saved once as lm_head.weight),
then converted back. The real engine's export is checked bit for bit at TP = 1 and 2 by the
check-sync tests (test_sglang_check_sync.py) and test_sglang_engine.py.
"""

from __future__ import annotations

import pytest
import torch

from megatron_dapo.rollout.engines.sglang.engine import hf_tensors_from_sglang_shards

HEADS, KV_HEADS, HEAD_DIM, HIDDEN, FFN, VOCAB = 4, 2, 8, 32, 48, 100


def _hf_model(tied: bool) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    prefix = "model.layers.0."
    tensors = {
        "model.embed_tokens.weight": torch.randn(VOCAB, HIDDEN, generator=g),
        prefix + "input_layernorm.weight": torch.randn(HIDDEN, generator=g),
        prefix + "self_attn.q_proj.weight": torch.randn(HEADS * HEAD_DIM, HIDDEN, generator=g),
        prefix + "self_attn.k_proj.weight": torch.randn(KV_HEADS * HEAD_DIM, HIDDEN, generator=g),
        prefix + "self_attn.v_proj.weight": torch.randn(KV_HEADS * HEAD_DIM, HIDDEN, generator=g),
        prefix + "self_attn.q_proj.bias": torch.randn(HEADS * HEAD_DIM, generator=g),
        prefix + "self_attn.k_proj.bias": torch.randn(KV_HEADS * HEAD_DIM, generator=g),
        prefix + "self_attn.v_proj.bias": torch.randn(KV_HEADS * HEAD_DIM, generator=g),
        prefix + "self_attn.o_proj.weight": torch.randn(HIDDEN, HEADS * HEAD_DIM, generator=g),
        prefix + "mlp.gate_proj.weight": torch.randn(FFN, HIDDEN, generator=g),
        prefix + "mlp.up_proj.weight": torch.randn(FFN, HIDDEN, generator=g),
        prefix + "mlp.down_proj.weight": torch.randn(HIDDEN, FFN, generator=g),
        "model.norm.weight": torch.randn(HIDDEN, generator=g),
    }
    if not tied:
        tensors["lm_head.weight"] = torch.randn(VOCAB, HIDDEN, generator=g)
    return tensors


def _heads(tensor: torch.Tensor, rank: int, tp: int, heads: int) -> torch.Tensor:
    """Rank `rank`'s heads of a [heads * HEAD_DIM, ...] tensor; replicated when tp > heads."""
    if tp <= heads:
        return tensor.chunk(tp, dim=0)[rank]
    return tensor.chunk(heads, dim=0)[rank // (tp // heads)]


def _sglang_shards(hf: dict[str, torch.Tensor], tp: int, tied: bool) -> list[dict[str, torch.Tensor]]:
    padded = -(-VOCAB // 64) * 64
    ranks = []
    for rank in range(tp):
        state = {}
        for name, tensor in hf.items():
            if ".k_proj." in name or ".v_proj." in name or ".up_proj." in name:
                continue
            if ".q_proj." in name:
                parts = [_heads(hf[name.replace("q_proj", part)], rank, tp, heads)
                         for part, heads in (("q_proj", HEADS), ("k_proj", KV_HEADS), ("v_proj", KV_HEADS))]  # fmt: skip
                state[name.replace("q_proj", "qkv_proj")] = torch.cat(parts)
            elif ".gate_proj." in name:
                parts = [hf[name].chunk(tp)[rank], hf[name.replace("gate_proj", "up_proj")].chunk(tp)[rank]]
                state[name.replace("gate_proj", "gate_up_proj")] = torch.cat(parts)
            elif "o_proj" in name or "down_proj" in name:
                state[name] = tensor.chunk(tp, dim=1)[rank]
            elif name in ("model.embed_tokens.weight", "lm_head.weight"):
                rows = torch.cat([tensor, torch.zeros(padded - VOCAB, HIDDEN)]).chunk(tp)[rank]
                state["lm_head.weight" if tied else name] = rows  # tied: saved once, under the LM head's name
            else:
                state[name] = tensor.clone()
        state["model.layers.0.self_attn.rotary_emb.cos_sin_cache"] = torch.zeros(3)  # not an HF tensor
        ranks.append(state)
    return ranks


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("tp", [1, 2, 4])  # 4 > KV heads: each KV head on two ranks
def test_shards_convert_back_to_the_hf_tensors(tp, tied):
    hf = _hf_model(tied)
    shapes = {name: tuple(tensor.shape) for name, tensor in hf.items()}
    exported = dict(hf_tensors_from_sglang_shards(_sglang_shards(hf, tp, tied), shapes))
    assert sorted(exported) == sorted(hf)
    for name, tensor in hf.items():
        assert torch.equal(exported[name], tensor), name


def test_layouts_it_cannot_read_are_left_out_or_named():
    hf = _hf_model(tied=False)
    shapes = {name: tuple(tensor.shape) for name, tensor in hf.items()}
    shapes["model.layers.0.mlp.experts.0.gate_proj.weight"] = (FFN, HIDDEN)  # SGLang fuses experts (w13_weight)
    exported = dict(hf_tensors_from_sglang_shards(_sglang_shards(hf, 1, False), shapes))
    assert "model.layers.0.mlp.experts.0.gate_proj.weight" not in exported and len(exported) == len(hf)
    broken = _sglang_shards(hf, 2, False)
    for state in broken:
        state["model.norm.weight"] = torch.zeros(3, 3)
    with pytest.raises(RuntimeError, match="model.norm.weight"):
        dict(hf_tensors_from_sglang_shards(broken, shapes))


def test_fused_experts_come_back_one_matrix_at_a_time_over_tp_ranks():
    """SGLang's FusedMoE: `experts.w13_weight` [E, 2 x I / TP, H] (gate rows then up rows per rank) and
    `experts.w2_weight` [E, H, I / TP]: each HF expert matrix is rebuilt from both TP ranks' slices."""
    import torch

    from megatron_dapo.rollout.engines.sglang.engine import hf_tensors_from_sglang_shards

    experts, inter, hidden, tp = 2, 4, 3, 2
    gen = torch.Generator().manual_seed(0)
    full = {}
    for e in range(experts):
        for part, shape in (("gate_proj", (inter, hidden)), ("up_proj", (inter, hidden)), ("down_proj", (hidden, inter))):
            full[f"model.layers.0.mlp.experts.{e}.{part}.weight"] = torch.randn(shape, generator=gen)
    ranks = []
    for r in range(tp):
        rows = slice(r * inter // tp, (r + 1) * inter // tp)
        w13 = torch.stack([torch.cat([full[f"model.layers.0.mlp.experts.{e}.gate_proj.weight"][rows],
                                      full[f"model.layers.0.mlp.experts.{e}.up_proj.weight"][rows]]) for e in range(experts)])  # fmt: skip
        w2 = torch.stack([full[f"model.layers.0.mlp.experts.{e}.down_proj.weight"][:, rows] for e in range(experts)])
        ranks.append({"model.layers.0.mlp.experts.w13_weight": w13, "model.layers.0.mlp.experts.w2_weight": w2})
    back = dict(hf_tensors_from_sglang_shards(ranks, {name: tuple(t.shape) for name, t in full.items()}))
    assert back.keys() == full.keys()
    assert all(torch.equal(back[name], full[name]) for name in full)
