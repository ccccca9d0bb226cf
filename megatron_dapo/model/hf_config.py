"""Read a HuggingFace `config.json` into the model description the rest of the code trusts.

Supported: Qwen2ForCausalLM (QKV bias), LlamaForCausalLM (plain RoPE or Llama 3 `rope_type: llama3`
scaling), Qwen3ForCausalLM (per-head q/k RMSNorm, head_dim may differ from hidden / heads), each with
or without tied embeddings and with grouped-query attention; and the mixtures of experts
Qwen3MoeForCausalLM (Qwen3 attention, every layer a top-k softmax router over `num_experts` SwiGLU
experts) and Qwen2MoeForCausalLM (Qwen2 attention, routed experts plus a sigmoid-gated shared
expert). Everything else is refused here with the name of the feature, so that an unsupported model
fails at start instead of training silently wrong: other architectures, sliding-window attention,
rope types other than default/llama3, activations other than SiLU, attention or MLP biases on
Llama/Qwen3, partial rotary, dropout, and MoE models with dense layers among the sparse ones
(`decoder_sparse_step` > 1 or `mlp_only_layers`: the mapping tables hold one layer kind per model).

transformers 5.x writes the RoPE settings as `rope_parameters` (with `rope_theta` inside), older
versions as top-level `rope_theta` + `rope_scaling` (with `type` or `rope_type`); both are read.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Optional, Union

from megatron_dapo.errors import InputError

__all__ = [
    "HFModelConfig",
    "ModelFileError",
    "SUPPORTED_ARCHITECTURES",
    "UnsupportedModelError",
    "MOE_ARCHITECTURES",
    "load_config_json",
    "read_hf_config",
]

MOE_ARCHITECTURES = ("Qwen3MoeForCausalLM", "Qwen2MoeForCausalLM")
SUPPORTED_ARCHITECTURES = ("Qwen2ForCausalLM", "LlamaForCausalLM", "Qwen3ForCausalLM") + MOE_ARCHITECTURES
_LLAMA3_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


class UnsupportedModelError(InputError, ValueError):
    """The HF model uses an architecture or a feature this trainer does not implement."""


class ModelFileError(InputError, ValueError):
    """A file of the HF model directory is missing, unreadable or corrupt; the message names the file."""


@dataclass(frozen=True)
class HFModelConfig:
    """The architecture facts Megatron needs, normalised across HF config versions."""

    architecture: str
    hidden_size: int
    num_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    ffn_hidden_size: int
    vocab_size: int
    max_position_embeddings: int
    rope_theta: float
    rope_scaling: Optional[dict[str, Any]]
    """None for plain RoPE, else {"rope_type": "llama3", "factor", "low_freq_factor",
    "high_freq_factor", "original_max_position_embeddings"}."""
    rms_norm_eps: float
    tie_word_embeddings: bool
    qkv_bias: bool
    qk_norm: bool
    hidden_act: str = "silu"
    torch_dtype: Optional[str] = None
    """The dtype the checkpoint was saved in, if the config says."""
    num_experts: int = 0
    """Routed experts per layer; 0 for a dense model (every layer of an MoE model is sparse)."""
    num_experts_per_tok: int = 0
    """Experts each token is routed to (the router's top-k)."""
    moe_ffn_hidden_size: Optional[int] = None
    """One expert's SwiGLU width (`moe_intermediate_size`)."""
    norm_topk_prob: bool = True
    """True: the top-k routing weights are renormalised to sum to 1 (softmax over the top-k logits);
    False: they are the softmax over all experts, kept as they are."""
    router_aux_loss_coef: float = 0.0
    """The load-balancing loss coefficient the model was trained with (HF `router_aux_loss_coef`)."""
    shared_expert_ffn_hidden_size: Optional[int] = None
    """Width of the sigmoid-gated shared expert every token also goes through (Qwen2-MoE); None if none."""

    @property
    def heads_per_group(self) -> int:
        return self.num_attention_heads // self.num_key_value_heads

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0


def _load(source: Union[str, os.PathLike, Mapping[str, Any]]) -> dict[str, Any]:
    if isinstance(source, Mapping):
        return dict(source)
    return load_config_json(source)


def load_config_json(source: Union[str, os.PathLike]) -> dict[str, Any]:
    """The JSON object in a model directory's config.json (or at a config.json path).

    FileNotFoundError when there is none; ModelFileError naming the file (and the line) when it is
    not a JSON object: a hand edit gone wrong or a download cut short."""
    path = Path(source)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"no HF config.json at {path}")
    fix = "restore it from the model's source (e.g. download it again)"
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as error:
        raise ModelFileError(f"{path} is not valid JSON (line {error.lineno}, column {error.colno}: {error.msg}): {fix}") from None
    except UnicodeDecodeError as error:
        raise ModelFileError(f"{path} is not UTF-8 text (byte {error.start}): {fix}") from None
    if not isinstance(raw, dict):
        raise ModelFileError(f"{path} holds a JSON {type(raw).__name__}, not an object of model settings: {fix}")
    return raw


def _refuse(arch: str, message: str) -> UnsupportedModelError:
    return UnsupportedModelError(f"{arch}: {message}")


def _rope(raw: dict[str, Any], arch: str, max_positions: int) -> tuple[float, Optional[dict[str, Any]]]:
    """(rope_theta, normalised rope_scaling) from either config format."""
    params = raw.get("rope_parameters")
    if isinstance(params, Mapping) and params:
        if any(isinstance(v, Mapping) for v in params.values()):
            raise _refuse(arch, f"per-layer-type rope_parameters {sorted(params)} are not supported")
        theta = params.get("rope_theta", raw.get("rope_theta", 10000.0))
        scaling = dict(params)
    else:
        theta = raw.get("rope_theta", 10000.0)
        scaling = dict(raw.get("rope_scaling") or {})
    scaling.pop("rope_theta", None)
    rope_type = scaling.pop("rope_type", None) or scaling.pop("type", None) or "default"
    scaling.pop("type", None)
    partial = scaling.pop("partial_rotary_factor", raw.get("partial_rotary_factor", 1.0))
    if partial not in (None, 1, 1.0):
        raise _refuse(arch, f"partial_rotary_factor={partial} is not supported (only full rotary)")
    if rope_type == "default":
        leftover = {k: v for k, v in scaling.items() if v is not None}
        if leftover:
            raise _refuse(arch, f"unexpected RoPE parameters {sorted(leftover)} for rope_type 'default'")
        return float(theta), None
    if rope_type != "llama3":
        raise _refuse(
            arch, f"rope_type '{rope_type}' is not supported (supported: default, llama3); remove rope_scaling or use another model"
        )
    missing = [k for k in ("factor", "low_freq_factor", "high_freq_factor") if scaling.get(k) is None]
    if missing:
        raise _refuse(arch, f"llama3 rope scaling without {', '.join(missing)}")
    unknown = sorted(set(scaling) - set(_LLAMA3_KEYS))
    if unknown:
        raise _refuse(arch, f"unexpected llama3 RoPE parameters {unknown}")
    original = scaling.get("original_max_position_embeddings") or max_positions  # HF's fallback
    return float(theta), {
        "rope_type": "llama3",
        "factor": float(scaling["factor"]),
        "low_freq_factor": float(scaling["low_freq_factor"]),
        "high_freq_factor": float(scaling["high_freq_factor"]),
        "original_max_position_embeddings": int(original),
    }


def read_hf_config(source: Union[str, os.PathLike, Mapping[str, Any]]) -> HFModelConfig:
    """Parse an HF config (a dict, a config.json path, or a model directory); refuse what we cannot run."""
    raw = _load(source)
    architectures = raw.get("architectures") or []
    if len(architectures) != 1 or architectures[0] not in SUPPORTED_ARCHITECTURES:
        raise UnsupportedModelError(
            f"unsupported architecture {architectures or raw.get('model_type')!r}: "
            f"supported are {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    arch = architectures[0]

    def need(key: str) -> Any:
        if raw.get(key) is None:
            raise _refuse(arch, f"config.json has no '{key}'")
        return raw[key]

    hidden = int(need("hidden_size"))
    heads = int(need("num_attention_heads"))
    kv_heads = int(raw.get("num_key_value_heads") or heads)
    head_dim = int(raw.get("head_dim") or hidden // heads)
    max_positions = int(need("max_position_embeddings"))

    act = raw.get("hidden_act", "silu")
    if act != "silu":
        raise _refuse(arch, f"hidden_act '{act}' is not supported (only silu / SwiGLU)")
    if heads % kv_heads != 0:
        raise _refuse(arch, f"num_attention_heads={heads} is not a multiple of num_key_value_heads={kv_heads}")
    if raw.get("use_sliding_window"):
        raise _refuse(arch, "sliding-window attention (use_sliding_window=true) is not supported")
    layer_types = raw.get("layer_types")
    if layer_types and any(t != "full_attention" for t in layer_types):
        raise _refuse(arch, f"layer types {sorted(set(layer_types))} are not supported (only full_attention)")
    for key in ("attention_dropout", "hidden_dropout"):
        if float(raw.get(key) or 0.0) != 0.0:
            raise _refuse(arch, f"{key}={raw[key]} is not supported (dropout must be 0)")
    moe = _moe_settings(raw, arch)

    if arch in ("Qwen2ForCausalLM", "Qwen2MoeForCausalLM"):
        if raw.get("qkv_bias") is False:
            raise _refuse(arch, "qkv_bias=false is not supported (Qwen2 attention has q/k/v biases)")
        qkv_bias, qk_norm = True, False  # Qwen2 always has q/k/v biases and no o_proj bias
    else:
        if raw.get("attention_bias"):
            raise _refuse(arch, "attention_bias=true (biases on q/k/v/o projections) is not supported")
        qkv_bias, qk_norm = False, arch in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM")
    if raw.get("mlp_bias"):
        raise _refuse(arch, "mlp_bias=true is not supported")

    theta, scaling = _rope(raw, arch, max_positions)
    return HFModelConfig(
        architecture=arch,
        hidden_size=hidden,
        num_layers=int(need("num_hidden_layers")),
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        ffn_hidden_size=int(need("intermediate_size")),
        vocab_size=int(need("vocab_size")),
        max_position_embeddings=max_positions,
        rope_theta=theta,
        rope_scaling=scaling,
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        qkv_bias=qkv_bias,
        qk_norm=qk_norm,
        hidden_act=act,
        torch_dtype=raw.get("torch_dtype") or raw.get("dtype"),
        **moe,
    )


def _moe_settings(raw: dict[str, Any], arch: str) -> dict[str, Any]:
    """The HFModelConfig fields of a mixture of experts ({} for a dense architecture).

    transformers writes the expert count as `num_local_experts` (5.x) or `num_experts` (published
    Qwen configs); both are read. Every layer must be sparse: `decoder_sparse_step` 1 and no
    `mlp_only_layers`, which is how every published Qwen3-MoE and Qwen2-MoE is configured.
    """
    experts = raw.get("num_experts") or raw.get("num_local_experts")
    if arch not in MOE_ARCHITECTURES:
        if experts:
            raise _refuse(arch, f"mixture-of-experts layers (num_experts={experts}) are not supported for this architecture")
        return {}

    def need(key: str) -> int:
        value = raw.get(key)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise _refuse(arch, f"config.json needs a positive integer '{key}', has {value!r}")
        return value

    if not experts:
        raise _refuse(arch, "config.json has no 'num_experts' (or 'num_local_experts')")
    experts = int(experts)
    topk = need("num_experts_per_tok")
    if topk > experts:
        raise _refuse(arch, f"num_experts_per_tok={topk} exceeds num_experts={experts}")
    step = raw.get("decoder_sparse_step", 1)
    if step not in (None, 1):
        raise _refuse(
            arch, f"decoder_sparse_step={step} (dense MLP layers between the MoE layers) is not supported: every layer must be MoE"
        )
    dense_layers = raw.get("mlp_only_layers") or []
    if dense_layers:
        raise _refuse(arch, f"mlp_only_layers={list(dense_layers)} (dense MLP layers in an MoE model) are not supported")
    shared = None
    if arch == "Qwen2MoeForCausalLM":
        shared = need("shared_expert_intermediate_size")
    default_norm = arch == "Qwen3MoeForCausalLM"  # the transformers defaults of each config class
    return {
        "num_experts": experts,
        "num_experts_per_tok": topk,
        "moe_ffn_hidden_size": need("moe_intermediate_size"),
        "norm_topk_prob": bool(raw.get("norm_topk_prob", default_norm)),
        "router_aux_loss_coef": float(raw.get("router_aux_loss_coef") or 0.0),
        "shared_expert_ffn_hidden_size": shared,
    }
