"""The HF <-> Megatron mapping table of each supported architecture (see `mapping.py` for the rules).

Qwen2, Llama and Qwen3 share the dense decoder layout; they differ in QKV biases (Qwen2) and per-head
q/k RMSNorm (Qwen3). A tied model has no `lm_head.weight` / `output_layer.weight` row.
"""

from __future__ import annotations

from megatron_dapo.model.mapping import (
    GATE_UP,
    QKV_INTERLEAVED,
    REPLICATED,
    TP_SPLIT,
    VOCAB_PAD,
    Map,
    MappingTable,
)

__all__ = ["ARCH_TABLES", "LLAMA", "QWEN2", "QWEN3", "mapping_for"]

_ATTN = "model.layers.{i}.self_attn"
_MLP = "model.layers.{i}.mlp"
_LAYER = "decoder.layers.{i}"

EMBEDDING = Map(
    hf=("model.embed_tokens.weight",),
    megatron="embedding.word_embeddings.weight",
    transform=VOCAB_PAD,
    tp_dim=0,
)
INPUT_NORM = Map(
    hf=("model.layers.{i}.input_layernorm.weight",),
    megatron=f"{_LAYER}.input_layernorm.weight",
    megatron_te=f"{_LAYER}.self_attention.linear_qkv.layer_norm_weight",
    transform=REPLICATED,
)
QKV_WEIGHT = Map(
    hf=(f"{_ATTN}.q_proj.weight", f"{_ATTN}.k_proj.weight", f"{_ATTN}.v_proj.weight"),
    megatron=f"{_LAYER}.self_attention.linear_qkv.weight",
    transform=QKV_INTERLEAVED,
    tp_dim=0,
)
QKV_BIAS = Map(
    hf=(f"{_ATTN}.q_proj.bias", f"{_ATTN}.k_proj.bias", f"{_ATTN}.v_proj.bias"),
    megatron=f"{_LAYER}.self_attention.linear_qkv.bias",
    transform=QKV_INTERLEAVED,
    tp_dim=0,
)
Q_NORM = Map(
    hf=(f"{_ATTN}.q_norm.weight",),
    megatron=f"{_LAYER}.self_attention.q_layernorm.weight",
    transform=REPLICATED,
)
K_NORM = Map(
    hf=(f"{_ATTN}.k_norm.weight",),
    megatron=f"{_LAYER}.self_attention.k_layernorm.weight",
    transform=REPLICATED,
)
O_PROJ = Map(
    hf=(f"{_ATTN}.o_proj.weight",),
    megatron=f"{_LAYER}.self_attention.linear_proj.weight",
    transform=TP_SPLIT,
    tp_dim=1,
)
POST_ATTN_NORM = Map(
    hf=("model.layers.{i}.post_attention_layernorm.weight",),
    megatron=f"{_LAYER}.pre_mlp_layernorm.weight",
    megatron_te=f"{_LAYER}.mlp.linear_fc1.layer_norm_weight",
    transform=REPLICATED,
)
GATE_UP_PROJ = Map(
    hf=(f"{_MLP}.gate_proj.weight", f"{_MLP}.up_proj.weight"),
    megatron=f"{_LAYER}.mlp.linear_fc1.weight",
    transform=GATE_UP,
    tp_dim=0,
)
DOWN_PROJ = Map(
    hf=(f"{_MLP}.down_proj.weight",),
    megatron=f"{_LAYER}.mlp.linear_fc2.weight",
    transform=TP_SPLIT,
    tp_dim=1,
)
FINAL_NORM = Map(hf=("model.norm.weight",), megatron="decoder.final_layernorm.weight", transform=REPLICATED)
OUTPUT = Map(hf=("lm_head.weight",), megatron="output_layer.weight", transform=VOCAB_PAD, tp_dim=0, untied_only=True)

QWEN2 = (EMBEDDING, INPUT_NORM, QKV_WEIGHT, QKV_BIAS, O_PROJ, POST_ATTN_NORM, GATE_UP_PROJ, DOWN_PROJ, FINAL_NORM, OUTPUT)
LLAMA = (EMBEDDING, INPUT_NORM, QKV_WEIGHT, O_PROJ, POST_ATTN_NORM, GATE_UP_PROJ, DOWN_PROJ, FINAL_NORM, OUTPUT)
QWEN3 = (EMBEDDING, INPUT_NORM, QKV_WEIGHT, Q_NORM, K_NORM, O_PROJ, POST_ATTN_NORM, GATE_UP_PROJ, DOWN_PROJ, FINAL_NORM, OUTPUT)

ARCH_TABLES: dict[str, tuple[Map, ...]] = {
    "Qwen2ForCausalLM": QWEN2,
    "LlamaForCausalLM": LLAMA,
    "Qwen3ForCausalLM": QWEN3,
}


def mapping_for(cfg) -> MappingTable:
    """The mapping table for an `HFModelConfig` (architecture, tied or not)."""
    try:
        rows = ARCH_TABLES[cfg.architecture]
    except KeyError:
        raise ValueError(f"no mapping table for architecture {cfg.architecture!r}; have {sorted(ARCH_TABLES)}") from None
    if cfg.tie_word_embeddings:
        rows = tuple(r for r in rows if not r.untied_only)
    return MappingTable(cfg.architecture, rows, cfg.tie_word_embeddings)
