"""Parameter counts of a model shape: the HF total, what one rank of a pipeline stage holds in
Megatron, and what one GPU of a rollout engine holds.

Parameters are counted per pipeline stage: the first holds the (vocab-padded) embedding, the last
the output layer (a copy of the embedding when tied and PP > 1) and the final norm. A rollout engine
splits the weights over `rollout.tp` with the vocabulary unpadded, and replicates KV heads when
rollout.tp exceeds their number, as vLLM and SGLang do.

Mixtures of experts (Qwen3-MoE, Qwen2-MoE) are counted in two parts. Dense: attention, embeddings,
norms, the router ([E, h], on every rank) and Qwen2-MoE's shared expert (split over TP like a dense
MLP) and its gate ([1, h], on every rank). Experts: the E routed SwiGLU experts of every layer,
whole experts split over `parallel.ep` ranks (E / EP each) and each expert's matrices over the
expert-tensor-parallel ranks, which are the TP ranks: Megatron's default
(`expert_tensor_parallel_size` = TP), which `model/builder.py` keeps. The two parts differ in where
the distributed optimizer shards them (`memory.py`). A token goes through the dense part and its
top-k experts only: `hf_active_parameter_count`, the figure training FLOPs scale with (about 6 x
active parameters per token, attention scores aside). A rollout engine splits each expert over
`rollout.tp` (vLLM's fused MoE without expert parallelism) and replicates the router.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from megatron_dapo.errors import ConfigError
from megatron_dapo.distributed.layout import ExpertParallelError, experts_per_rank

if TYPE_CHECKING:  # megatron_dapo.model imports torch: kept out of `megatron-dapo --help`
    from megatron_dapo.model.hf_config import HFModelConfig


def model_dims(model: HFModelConfig) -> tuple[int, int, int, int, int]:
    """(h, a, g, d, f): hidden size, attention heads, KV heads (query groups), head dim, FFN size."""
    return (
        model.hidden_size,
        model.num_attention_heads,
        model.num_key_value_heads,
        model.head_dim,
        model.ffn_hidden_size,
    )


def padded_vocab(model: HFModelConfig, tp: int) -> int:
    """The vocabulary as Megatron pads it for `tp` ranks."""
    # Megatron's padding rule, one source of truth; megatron_dapo.model imports torch, which `plan` must not load.
    from megatron_dapo.model.mapping import padded_vocab_size

    return padded_vocab_size(model.vocab_size, tp)


def kv_heads_per_rank(model: HFModelConfig, tp: int) -> int:
    """KV heads on one rank of a tensor-parallel engine; replicated when tp exceeds their number."""
    return max(1, model.num_key_value_heads // tp)


def mlp_widths(model: HFModelConfig) -> list[tuple[str, int]]:
    """The HF names and widths of the MLPs that TP splits: the FFN of a dense model; a mixture of
    experts' expert width and its shared expert's (its `intermediate_size` is unused)."""
    if not model.is_moe:
        return [("intermediate_size", model.ffn_hidden_size)]
    widths = [("moe_intermediate_size", expert_width(model))]
    if model.shared_expert_ffn_hidden_size:
        widths.append(("shared_expert_intermediate_size", model.shared_expert_ffn_hidden_size))
    return widths


def expert_width(model: HFModelConfig) -> int:
    """One routed expert's SwiGLU width (`moe_intermediate_size`); 0 for a dense model."""
    return (model.moe_ffn_hidden_size or 0) if model.is_moe else 0


def check_tensor_parallel(model: HFModelConfig, tp: int, key: str) -> None:
    """`tp` (the config value named `key`) must split the heads and the FFN (each expert's and the shared
    expert's width for a mixture of experts); the actor's TP must also split the query groups, an
    engine's must divide or be a multiple of them."""
    h, a, g, d, f = model_dims(model)
    if a % tp:
        raise ConfigError(f"'{key}'={tp} does not divide the model's num_attention_heads={a}")
    for name, width in mlp_widths(model):
        if width % tp:
            raise ConfigError(f"'{key}'={tp} does not divide the model's {name}={width}")
    if key == "parallel.tp" and g % tp:
        raise ConfigError(f"'{key}'={tp} does not divide the model's num_key_value_heads={g} (query groups)")
    if g % tp and tp % g:
        raise ConfigError(
            f"'{key}'={tp} and the model's num_key_value_heads={g}: one must divide the other "
            "(rollout engines replicate KV heads only when rollout.tp is a multiple of their number)"
        )


@dataclass(frozen=True)
class LayerParameters:
    """Parameters of one transformer layer, by how tensor (and expert) parallelism stores them."""

    tensor_parallel: int
    """Split over TP ranks: q/k/v/o and MLP weights (a mixture of experts: its shared expert), the q/k/v biases."""
    replicated: int
    """On every TP rank: the two RMSNorm weights (and Qwen3's per-head q/k norms); a mixture of experts'
    router and shared-expert gate."""
    expert: int = 0
    """The routed experts (mixtures of experts): whole experts over EP ranks, each split over expert-TP."""

    @property
    def total(self) -> int:
        return self.tensor_parallel + self.replicated + self.expert


def swiglu_parameters(hidden: int, width: int) -> int:
    """Gate, up (h -> width each) and down (width -> h)."""
    return 3 * hidden * width


def attention_parameters(model: HFModelConfig) -> int:
    """q/k/v/o weights and the q/k/v biases of one layer (all split over TP in Megatron)."""
    h, a, g, d, f = model_dims(model)
    qkv = h * (a + 2 * g) * d + ((a + 2 * g) * d if model.qkv_bias else 0)
    return qkv + a * d * h


def layer_parameters(model: HFModelConfig) -> LayerParameters:
    """Parameters of one layer: attention (GQA, optional QKV bias), SwiGLU MLP or experts, RMSNorms."""
    h, a, g, d, f = model_dims(model)
    attention = attention_parameters(model)
    norms = 2 * h + (2 * d if model.qk_norm else 0)
    if not model.is_moe:
        return LayerParameters(tensor_parallel=attention + swiglu_parameters(h, f), replicated=norms)
    shared = model.shared_expert_ffn_hidden_size or 0
    router = model.num_experts * h  # [E, h], no bias
    shared_gate = h if shared else 0  # [1, h]: the sigmoid gate of the shared expert
    return LayerParameters(
        tensor_parallel=attention + swiglu_parameters(h, shared),
        replicated=norms + router + shared_gate,
        expert=model.num_experts * swiglu_parameters(h, expert_width(model)),
    )


def hf_parameter_count(model: HFModelConfig) -> int:
    """Parameters of the HF model (unpadded vocabulary): what `sum(p.numel())` gives in transformers."""
    embedding = model.vocab_size * model.hidden_size
    output = 0 if model.tie_word_embeddings else embedding
    return embedding + output + model.num_layers * layer_parameters(model).total + model.hidden_size


def hf_active_parameter_count(model: HFModelConfig) -> int:
    """Parameters one token goes through: all but the routed experts it is not sent to (it meets
    `num_experts_per_tok` of them); the whole model for a dense one. Training FLOPs per token are about
    6 x this (the published "activated parameters" of Qwen's MoE models, embeddings included)."""
    unused = (model.num_experts - model.num_experts_per_tok) * swiglu_parameters(model.hidden_size, expert_width(model))
    return hf_parameter_count(model) - model.num_layers * unused


@dataclass(frozen=True)
class StageParameters:
    """What one rank of a pipeline stage holds, by the data-parallel group its optimizer state is sharded over."""

    dense: int
    """Everything but the routed experts (all of a dense model): sharded over DP x CP."""
    expert: int
    """This rank's routed experts: sharded over the expert data-parallel group."""

    @property
    def total(self) -> int:
        return self.dense + self.expert


def local_experts(model: HFModelConfig, ep: int) -> int:
    """Experts per expert-parallel rank (num_experts / ep); the layout's message as a ConfigError."""
    try:
        return experts_per_rank(model.num_experts, ep)
    except ExpertParallelError as error:
        raise ConfigError(str(error)) from None


def stage_parameter_split(model: HFModelConfig, tp: int, pp: int, stage: int, ep: int = 1) -> StageParameters:
    """Parameters one rank of pipeline stage `stage` holds in Megatron (all its virtual chunks together),
    dense and expert.

    Layers split evenly over stages and their matrices over TP ranks; the first stage adds the
    vocab-padded embedding shard, the last the final norm and the output-layer shard (with tied
    embeddings and PP > 1 Megatron keeps a copy of the embedding there; with PP = 1 it is shared).
    The routed experts of a layer split over `ep` ranks, each expert over the TP ranks (expert-TP = TP).
    """
    if model.num_layers % pp:
        raise ConfigError(f"the model's num_hidden_layers={model.num_layers} is not divisible by parallel.pp={pp}")
    if not 0 <= stage < pp:
        raise ValueError(f"stage {stage} is not in [0, {pp})")
    check_tensor_parallel(model, tp, "parallel.tp")
    experts = local_experts(model, ep)
    layer = layer_parameters(model)
    layers = model.num_layers // pp
    count = layers * (layer.tensor_parallel // tp + layer.replicated)
    vocab_shard = padded_vocab(model, tp) * model.hidden_size // tp
    if stage == 0:
        count += vocab_shard
    if stage == pp - 1:
        count += model.hidden_size
        if not model.tie_word_embeddings or pp > 1:
            count += vocab_shard
    expert = layers * experts * swiglu_parameters(model.hidden_size, expert_width(model)) // tp
    return StageParameters(dense=count, expert=expert)


def stage_parameters(model: HFModelConfig, tp: int, pp: int, stage: int, ep: int = 1) -> int:
    """Parameters one rank of pipeline stage `stage` holds in Megatron: `stage_parameter_split`'s total."""
    return stage_parameter_split(model, tp, pp, stage, ep).total


def rollout_weight_parameters(model: HFModelConfig, rollout_tp: int) -> int:
    """Parameters one GPU of a rollout engine holds (unpadded vocabulary, KV heads replicated if needed;
    every expert split over rollout.tp, the router replicated)."""
    check_tensor_parallel(model, rollout_tp, "rollout.tp")
    h, a, g, d, f = model_dims(model)
    kv = kv_heads_per_rank(model, rollout_tp)
    q_and_o = 2 * h * a * d // rollout_tp + (a * d // rollout_tp if model.qkv_bias else 0)
    k_and_v = 2 * h * kv * d + (2 * kv * d if model.qkv_bias else 0)
    layer = layer_parameters(model)
    mlp = layer.tensor_parallel - attention_parameters(model) + layer.expert  # FFN, or experts + shared expert
    per_layer = q_and_o + k_and_v + mlp // rollout_tp + layer.replicated  # norms (+ router, shared gate)
    vocab = model.vocab_size * h // rollout_tp * (1 if model.tie_word_embeddings else 2)
    return model.num_layers * per_layer + vocab + h
