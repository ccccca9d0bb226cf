"""Parameter counts of a model shape: the HF total, what one rank of a pipeline stage holds in
Megatron, and what one GPU of a rollout engine holds.

Parameters are counted per pipeline stage: the first holds the (vocab-padded) embedding, the last
the output layer (a copy of the embedding when tied and PP > 1) and the final norm. A rollout engine
splits the weights over `rollout.tp` with the vocabulary unpadded, and replicates KV heads when
rollout.tp exceeds their number, as vLLM and SGLang do.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from megatron_dapo.config import ConfigError

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


def check_tensor_parallel(model: HFModelConfig, tp: int, key: str) -> None:
    """`tp` (the config value named `key`) must split the heads and the FFN; the actor's TP must also
    split the query groups, an engine's must divide or be a multiple of them."""
    h, a, g, d, f = model_dims(model)
    if a % tp:
        raise ConfigError(f"'{key}'={tp} does not divide the model's num_attention_heads={a}")
    if f % tp:
        raise ConfigError(f"'{key}'={tp} does not divide the model's intermediate_size={f}")
    if key == "parallel.tp" and g % tp:
        raise ConfigError(f"'{key}'={tp} does not divide the model's num_key_value_heads={g} (query groups)")
    if g % tp and tp % g:
        raise ConfigError(
            f"'{key}'={tp} and the model's num_key_value_heads={g}: one must divide the other "
            "(rollout engines replicate KV heads only when rollout.tp is a multiple of their number)"
        )


@dataclass(frozen=True)
class LayerParameters:
    """Parameters of one transformer layer, by how tensor parallelism stores them."""

    tensor_parallel: int
    """Split over TP ranks: q/k/v/o and MLP weights, the q/k/v biases."""
    replicated: int
    """On every TP rank: the two RMSNorm weights (and Qwen3's per-head q/k norms)."""

    @property
    def total(self) -> int:
        return self.tensor_parallel + self.replicated


def layer_parameters(model: HFModelConfig) -> LayerParameters:
    """Parameters of one layer: attention (GQA, optional QKV bias), SwiGLU MLP, RMSNorms."""
    h, a, g, d, f = model_dims(model)
    qkv = h * (a + 2 * g) * d + ((a + 2 * g) * d if model.qkv_bias else 0)
    attention_out = a * d * h
    mlp = 3 * h * f  # gate, up (h -> f each) and down (f -> h)
    norms = 2 * h + (2 * d if model.qk_norm else 0)
    return LayerParameters(tensor_parallel=qkv + attention_out + mlp, replicated=norms)


def hf_parameter_count(model: HFModelConfig) -> int:
    """Parameters of the HF model (unpadded vocabulary): what `sum(p.numel())` gives in transformers."""
    embedding = model.vocab_size * model.hidden_size
    output = 0 if model.tie_word_embeddings else embedding
    return embedding + output + model.num_layers * layer_parameters(model).total + model.hidden_size


def stage_parameters(model: HFModelConfig, tp: int, pp: int, stage: int) -> int:
    """Parameters one rank of pipeline stage `stage` holds in Megatron (all its virtual chunks together).

    Layers split evenly over stages and their matrices over TP ranks; the first stage adds the
    vocab-padded embedding shard, the last the final norm and the output-layer shard (with tied
    embeddings and PP > 1 Megatron keeps a copy of the embedding there; with PP = 1 it is shared).
    """
    if model.num_layers % pp:
        raise ConfigError(f"the model's num_hidden_layers={model.num_layers} is not divisible by parallel.pp={pp}")
    if not 0 <= stage < pp:
        raise ValueError(f"stage {stage} is not in [0, {pp})")
    check_tensor_parallel(model, tp, "parallel.tp")
    layer = layer_parameters(model)
    count = model.num_layers // pp * (layer.tensor_parallel // tp + layer.replicated)
    vocab_shard = padded_vocab(model, tp) * model.hidden_size // tp
    if stage == 0:
        count += vocab_shard
    if stage == pp - 1:
        count += model.hidden_size
        if not model.tie_word_embeddings or pp > 1:
            count += vocab_shard
    return count


def rollout_weight_parameters(model: HFModelConfig, rollout_tp: int) -> int:
    """Parameters one GPU of a rollout engine holds (unpadded vocabulary, KV heads replicated if needed)."""
    check_tensor_parallel(model, rollout_tp, "rollout.tp")
    h, a, g, d, f = model_dims(model)
    kv = kv_heads_per_rank(model, rollout_tp)
    q_and_o = 2 * h * a * d // rollout_tp + (a * d // rollout_tp if model.qkv_bias else 0)
    k_and_v = 2 * h * kv * d + (2 * kv * d if model.qkv_bias else 0)
    norms = 2 * h + (2 * d if model.qk_norm else 0)
    per_layer = q_and_o + k_and_v + 3 * h * f // rollout_tp + norms
    vocab = model.vocab_size * h // rollout_tp * (1 if model.tie_word_embeddings else 2)
    return model.num_layers * per_layer + vocab + h
