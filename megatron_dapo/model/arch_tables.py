"""The HF <-> Megatron mapping table of each supported architecture (see `mapping.py` for the rules).

Qwen2, Llama and Qwen3 share the dense decoder layout; they differ in QKV biases (Qwen2) and per-head
q/k RMSNorm (Qwen3). A tied model has no `lm_head.weight` / `output_layer.weight` row.

The mixtures of experts keep their family's attention and replace the MLP: a router (`mlp.gate`
[E, hidden], replicated on every rank) and E SwiGLU experts (fc1 = gate/up fused as in the dense MLP,
fc2 = down); Qwen2-MoE adds a shared expert every token goes through, scaled by a sigmoid gate
(`shared_expert_gate` [1, hidden]). The pre-MLP norm of an MoE layer is its own module under both
layer specs (TE fuses it into `linear_fc1` only for a dense MLP).
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
    expand_experts,
)

__all__ = ["ARCH_TABLES", "LLAMA", "QWEN2", "QWEN2_MOE", "QWEN3", "QWEN3_MOE", "mapping_for"]

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
# Mixture-of-experts MLP rows.
_EXPERT = f"{_MLP}.experts.{{e}}"
_MCORE_MLP = f"{_LAYER}.mlp"
MOE_PRE_MLP_NORM = Map(
    hf=("model.layers.{i}.post_attention_layernorm.weight",),
    megatron=f"{_LAYER}.pre_mlp_layernorm.weight",
    transform=REPLICATED,
)
ROUTER = Map(hf=(f"{_MLP}.gate.weight",), megatron=f"{_MCORE_MLP}.router.weight", transform=REPLICATED)
EXPERT_GATE_UP = Map(
    hf=(f"{_EXPERT}.gate_proj.weight", f"{_EXPERT}.up_proj.weight"),
    megatron=f"{_MCORE_MLP}.experts.local_experts.{{e}}.linear_fc1.weight",  # SequentialMLP
    megatron_te=f"{_MCORE_MLP}.experts.linear_fc1.weight{{e}}",  # TEGroupedMLP (grouped GEMM)
    transform=GATE_UP,
    tp_dim=0,
)
EXPERT_DOWN = Map(
    hf=(f"{_EXPERT}.down_proj.weight",),
    megatron=f"{_MCORE_MLP}.experts.local_experts.{{e}}.linear_fc2.weight",
    megatron_te=f"{_MCORE_MLP}.experts.linear_fc2.weight{{e}}",
    transform=TP_SPLIT,
    tp_dim=1,
)
SHARED_EXPERT_GATE_UP = Map(
    hf=(f"{_MLP}.shared_expert.gate_proj.weight", f"{_MLP}.shared_expert.up_proj.weight"),
    megatron=f"{_MCORE_MLP}.shared_experts.linear_fc1.weight",
    transform=GATE_UP,
    tp_dim=0,
)
SHARED_EXPERT_DOWN = Map(
    hf=(f"{_MLP}.shared_expert.down_proj.weight",),
    megatron=f"{_MCORE_MLP}.shared_experts.linear_fc2.weight",
    transform=TP_SPLIT,
    tp_dim=1,
)
SHARED_EXPERT_GATE = Map(
    hf=(f"{_MLP}.shared_expert_gate.weight",), megatron=f"{_MCORE_MLP}.shared_experts.gate_weight", transform=REPLICATED
)

FINAL_NORM = Map(hf=("model.norm.weight",), megatron="decoder.final_layernorm.weight", transform=REPLICATED)
OUTPUT = Map(hf=("lm_head.weight",), megatron="output_layer.weight", transform=VOCAB_PAD, tp_dim=0, untied_only=True)

QWEN2 = (EMBEDDING, INPUT_NORM, QKV_WEIGHT, QKV_BIAS, O_PROJ, POST_ATTN_NORM, GATE_UP_PROJ, DOWN_PROJ, FINAL_NORM, OUTPUT)
LLAMA = (EMBEDDING, INPUT_NORM, QKV_WEIGHT, O_PROJ, POST_ATTN_NORM, GATE_UP_PROJ, DOWN_PROJ, FINAL_NORM, OUTPUT)
QWEN3 = (EMBEDDING, INPUT_NORM, QKV_WEIGHT, Q_NORM, K_NORM, O_PROJ, POST_ATTN_NORM, GATE_UP_PROJ, DOWN_PROJ, FINAL_NORM, OUTPUT)

_ROUTED_EXPERTS = (MOE_PRE_MLP_NORM, ROUTER, EXPERT_GATE_UP, EXPERT_DOWN)
QWEN3_MOE = (EMBEDDING, INPUT_NORM, QKV_WEIGHT, Q_NORM, K_NORM, O_PROJ, *_ROUTED_EXPERTS, FINAL_NORM, OUTPUT)
QWEN2_MOE = (EMBEDDING, INPUT_NORM, QKV_WEIGHT, QKV_BIAS, O_PROJ, *_ROUTED_EXPERTS,
             SHARED_EXPERT_GATE_UP, SHARED_EXPERT_DOWN, SHARED_EXPERT_GATE, FINAL_NORM, OUTPUT)  # fmt: skip

ARCH_TABLES: dict[str, tuple[Map, ...]] = {
    "Qwen2ForCausalLM": QWEN2,
    "LlamaForCausalLM": LLAMA,
    "Qwen3ForCausalLM": QWEN3,
    "Qwen3MoeForCausalLM": QWEN3_MOE,
    "Qwen2MoeForCausalLM": QWEN2_MOE,
}


def mapping_for(cfg) -> MappingTable:
    """The mapping table for an `HFModelConfig` (architecture, tied or not, its number of experts)."""
    try:
        rows = ARCH_TABLES[cfg.architecture]
    except KeyError:
        raise ValueError(f"no mapping table for architecture {cfg.architecture!r}; have {sorted(ARCH_TABLES)}") from None
    if cfg.tie_word_embeddings:
        rows = tuple(r for r in rows if not r.untied_only)
    num_experts = getattr(cfg, "num_experts", 0)
    return MappingTable(cfg.architecture, expand_experts(rows, num_experts), cfg.tie_word_embeddings, num_experts)
