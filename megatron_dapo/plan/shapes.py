"""What a plan is for: the model's shape and the cluster's (nodes, GPUs per node, the GPU's memory).

The model shape comes from `model.hf_dir`'s config.json or, to plan without downloading anything,
from `KNOWN_MODELS` (`--model`).

The GPU is what `torch.cuda.get_device_properties(i).total_memory` reports, not the marketing size:
an "80 GB" H100 reports about 79.1 GiB (PyTorch's out-of-memory messages say "total capacity of
79.10 GiB", vLLM logs "total_gpu_memory (79.11GiB)" to 79.25 with the driver), an H200 139.8 GiB
(vLLM: "total_gpu_memory (139.81GiB)"), an A100 80GB 79.15 to 79.25 and an A100 40GB 39.4 to 39.5
GiB; `GPU_MODELS` keeps the lowest such figure, rounded down (`--gpu`, or `--gpu-memory-gib`).
vLLM's pool is `gpu_memory_utilization` times that same figure (`request_memory` in
vllm/v1/worker/utils.py).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

from megatron_dapo.config import Config, validate_model_shape
from megatron_dapo.errors import ConfigError

if TYPE_CHECKING:  # megatron_dapo.model imports torch: kept out of `megatron-dapo --help`
    from megatron_dapo.model.hf_config import HFModelConfig

GIB = float(2**30)


@dataclass(frozen=True)
class GPUModel:
    """A GPU as software sees it."""

    label: str
    memory_gib: float
    """`torch.cuda.get_device_properties(i).total_memory` in GiB: the lowest published figure, rounded down."""


# Sources (module doc): PyTorch's "total capacity" in out-of-memory messages and vLLM's
# "total_gpu_memory (...)" start-up line on these GPUs.
GPU_MODELS: dict[str, GPUModel] = {
    "h100": GPUModel("H100 80GB", 79.1),  # 79.10 (PyTorch) .. 79.25 (vLLM) GiB
    "h200": GPUModel("H200 141GB", 139.8),  # 139.81 GiB (vLLM)
    "a100-80gb": GPUModel("A100 80GB", 79.1),  # 79.15 .. 79.25 GiB
    "a100-40gb": GPUModel("A100 40GB", 39.3),  # 39.38 .. 39.50 GiB
}
DEFAULT_GPU = "h100"


@dataclass(frozen=True)
class ClusterShape:
    nodes: int = 1
    gpus_per_node: int = 8
    gpu_memory_gib: float = GPU_MODELS[DEFAULT_GPU].memory_gib
    """What the GPU reports (`GPU_MODELS`), not its marketing size."""
    gpu: str = DEFAULT_GPU
    """A `GPU_MODELS` key or any name (vLLM's batch defaults depend on it: see `memory.vllm_batch_defaults`)."""

    @property
    def world_size(self) -> int:
        return self.nodes * self.gpus_per_node

    @property
    def gpu_memory_bytes(self) -> float:
        return self.gpu_memory_gib * GIB


def _config(arch: str, **fields: Any) -> dict[str, Any]:
    return {"architectures": [arch], "hidden_act": "silu", **fields}


# The architecture fields of the public Hugging Face config.json of each base model
# (https://huggingface.co/<repo>/blob/main/config.json for Qwen/Qwen2.5-{0.5B,1.5B,7B,14B,32B,72B},
# meta-llama/Llama-3.1-{8B,70B}, Qwen/Qwen3-{8B,32B}, Qwen/Qwen3-30B-A3B, Qwen/Qwen3-235B-A22B),
# enough for `read_hf_config`. The parameter counts they give equal the totals published on the model
# pages, and for the mixtures of experts the activated parameters too (tests/plan/test_parameters.py).
# A Qwen3-MoE's `intermediate_size` is unused (every layer is sparse); it is kept as published.
KNOWN_MODELS: dict[str, dict[str, Any]] = {
    "qwen2.5-0.5b": _config(
        "Qwen2ForCausalLM", hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
        num_attention_heads=14, num_key_value_heads=2, vocab_size=151936, max_position_embeddings=32768,
        rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=True,
    ),
    "qwen2.5-1.5b": _config(
        "Qwen2ForCausalLM", hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
        num_attention_heads=12, num_key_value_heads=2, vocab_size=151936, max_position_embeddings=131072,
        rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=True,
    ),
    "qwen2.5-7b": _config(
        "Qwen2ForCausalLM", hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
        num_attention_heads=28, num_key_value_heads=4, vocab_size=152064, max_position_embeddings=131072,
        rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=False,
    ),
    "qwen2.5-14b": _config(
        "Qwen2ForCausalLM", hidden_size=5120, intermediate_size=13824, num_hidden_layers=48,
        num_attention_heads=40, num_key_value_heads=8, vocab_size=152064, max_position_embeddings=131072,
        rope_theta=1000000.0, rms_norm_eps=1e-5, tie_word_embeddings=False,
    ),
    "qwen2.5-32b": _config(
        "Qwen2ForCausalLM", hidden_size=5120, intermediate_size=27648, num_hidden_layers=64,
        num_attention_heads=40, num_key_value_heads=8, vocab_size=152064, max_position_embeddings=131072,
        rope_theta=1000000.0, rms_norm_eps=1e-5, tie_word_embeddings=False,
    ),
    "qwen2.5-72b": _config(
        "Qwen2ForCausalLM", hidden_size=8192, intermediate_size=29568, num_hidden_layers=80,
        num_attention_heads=64, num_key_value_heads=8, vocab_size=152064, max_position_embeddings=131072,
        rope_theta=1000000.0, rms_norm_eps=1e-5, tie_word_embeddings=False,
    ),
    "llama-3.1-8b": _config(
        "LlamaForCausalLM", hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, vocab_size=128256, max_position_embeddings=131072,
        rope_theta=500000.0, rms_norm_eps=1e-5, tie_word_embeddings=False,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 8192},
    ),
    "llama-3.1-70b": _config(
        "LlamaForCausalLM", hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
        num_attention_heads=64, num_key_value_heads=8, vocab_size=128256, max_position_embeddings=131072,
        rope_theta=500000.0, rms_norm_eps=1e-5, tie_word_embeddings=False,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 8192},
    ),
    "qwen3-8b": _config(
        "Qwen3ForCausalLM", hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
        num_attention_heads=32, num_key_value_heads=8, head_dim=128, vocab_size=151936,
        max_position_embeddings=40960, rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=False,
    ),
    "qwen3-32b": _config(
        "Qwen3ForCausalLM", hidden_size=5120, intermediate_size=25600, num_hidden_layers=64,
        num_attention_heads=64, num_key_value_heads=8, head_dim=128, vocab_size=151936,
        max_position_embeddings=40960, rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=False,
    ),
    "qwen3-30b-a3b": _config(
        "Qwen3MoeForCausalLM", hidden_size=2048, intermediate_size=6144, num_hidden_layers=48,
        num_attention_heads=32, num_key_value_heads=4, head_dim=128, vocab_size=151936,
        max_position_embeddings=40960, rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=False,
        num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768, norm_topk_prob=True,
        decoder_sparse_step=1, mlp_only_layers=[], router_aux_loss_coef=0.001,
    ),
    "qwen3-235b-a22b": _config(
        "Qwen3MoeForCausalLM", hidden_size=4096, intermediate_size=12288, num_hidden_layers=94,
        num_attention_heads=64, num_key_value_heads=4, head_dim=128, vocab_size=151936,
        max_position_embeddings=40960, rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=False,
        num_experts=128, num_experts_per_tok=8, moe_intermediate_size=1536, norm_topk_prob=True,
        decoder_sparse_step=1, mlp_only_layers=[], router_aux_loss_coef=0.001,
    ),
}  # fmt: skip


def _known_config(name: str) -> dict[str, Any]:
    key = name.lower()
    if key not in KNOWN_MODELS:
        raise ConfigError(f"unknown model {name!r}: known models are {', '.join(KNOWN_MODELS)}")
    return KNOWN_MODELS[key]


def known_model(name: str) -> HFModelConfig:
    """The `HFModelConfig` of a model in `KNOWN_MODELS` (case-insensitive name)."""
    # The megatron_dapo.model package imports torch, which `megatron-dapo plan` / --help must not load.
    from megatron_dapo.model.hf_config import read_hf_config

    return read_hf_config(_known_config(name))


def resolve_model(cfg: Config, model_name: Optional[str] = None) -> tuple[str, HFModelConfig]:
    """The model to plan for: `model_name` from `KNOWN_MODELS`, else `model.hf_dir`'s config.json.

    The parallel sizes are checked against the shape with the config's own messages
    (`validate_model_shape`).
    """
    from megatron_dapo.model.hf_config import read_hf_config

    if model_name:
        raw, name = _known_config(model_name), model_name.lower()
    else:
        config_json = Path(cfg.model.hf_dir) / "config.json" if cfg.model.hf_dir else None
        if config_json is None or not config_json.is_file():
            raise ConfigError(
                f"no model shape: 'model.hf_dir'={cfg.model.hf_dir!r} has no config.json; set model.hf_dir to a "
                f"HuggingFace model directory or pass --model with one of {', '.join(KNOWN_MODELS)}"
            )
        raw, name = json.loads(config_json.read_text()), Path(cfg.model.hf_dir).name
    validate_model_shape(cfg, raw)
    return name, read_hf_config(raw)
