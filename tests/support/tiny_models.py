"""Tiny randomly initialised HF models, built locally with transformers (no download).

    path = save_tiny_model("qwen2_tied", tmp_dir / "qwen2_tied")
    model = load_hf_model(path)          # float32, eager attention: the reference for tests

Sizes are chosen so that every mapping detail matters: grouped-query attention (4 heads, 2 KV
heads), a vocabulary of 300 (padded to 384 at TP=1 and 512 at TP=2), 4 layers (split by PP=2 and
PP=2 x VPP=2), Qwen3 with head_dim 32 != hidden/heads = 16, Llama with llama3 RoPE scaling whose
original context (64) puts RoPE frequencies in all three llama3 regimes. All weights, norm weights
and biases included, are drawn at random so that a swapped or missed tensor changes the logits.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import torch

ARCHS = ("qwen2", "qwen2_tied", "llama3", "qwen3")

_COMMON = dict(
    hidden_size=64,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=128,
    num_hidden_layers=4,
    vocab_size=300,
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
    hidden_act="silu",
)


def tiny_config(arch: str):
    """The transformers config of one tiny test architecture (see ARCHS)."""
    from transformers import LlamaConfig, Qwen2Config, Qwen3Config

    if arch in ("qwen2", "qwen2_tied"):
        cfg = Qwen2Config(**_COMMON, rope_theta=10000.0, tie_word_embeddings=arch == "qwen2_tied")
        cfg.architectures = ["Qwen2ForCausalLM"]
    elif arch == "llama3":
        cfg = LlamaConfig(
            **_COMMON,
            rope_parameters={
                "rope_type": "llama3",
                "rope_theta": 10000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
            tie_word_embeddings=False,
        )
        cfg.architectures = ["LlamaForCausalLM"]
    elif arch == "qwen3":
        cfg = Qwen3Config(**_COMMON, head_dim=32, rope_theta=1000000.0, tie_word_embeddings=False)
        cfg.architectures = ["Qwen3ForCausalLM"]
    elif arch in MOE_ARCHS:
        return tiny_moe_config(arch)
    else:
        raise ValueError(f"unknown tiny architecture {arch!r}; have {ARCHS + MOE_ARCHS}")
    return cfg


MOE_ARCHS = ("qwen3_moe", "qwen2_moe")
"""Mixture-of-experts models, kept out of ARCHS (the dense tests iterate over ARCHS)."""


def tiny_moe_config(arch: str = "qwen3_moe"):
    """A tiny mixture of experts: 4 experts, 2 routed per token, every layer sparse (2 layers, ~0.2 M parameters).

    "qwen3_moe": Qwen3-MoE (q/k norm, head_dim 32 != hidden/heads, top-k weights renormalised);
    "qwen2_moe": Qwen2-MoE (QKV biases, a sigmoid-gated shared expert of another width, top-k weights
    not renormalised), so that each router variant and the shared expert's rows matter.
    """
    from transformers import Qwen2MoeConfig, Qwen3MoeConfig

    common = {**_COMMON, "num_hidden_layers": 2}
    moe = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, decoder_sparse_step=1)
    if arch == "qwen3_moe":
        cfg = Qwen3MoeConfig(**common, **moe, head_dim=32, rope_theta=1000000.0, tie_word_embeddings=False, norm_topk_prob=True)
        cfg.architectures = ["Qwen3MoeForCausalLM"]
    elif arch == "qwen2_moe":
        cfg = Qwen2MoeConfig(**common, **moe, rope_theta=10000.0, tie_word_embeddings=False, norm_topk_prob=False,
                             shared_expert_intermediate_size=48, qkv_bias=True)  # fmt: skip
        cfg.architectures = ["Qwen2MoeForCausalLM"]
    else:
        raise ValueError(f"unknown tiny MoE architecture {arch!r}; have {MOE_ARCHS}")
    return cfg


def build_tiny_model(arch: str, seed: int = 0) -> torch.nn.Module:
    """A float32 HF causal LM with every parameter drawn at random (deterministic for a seed)."""
    model = build_random_model(tiny_config(arch), seed, attn_implementation="eager")
    model.eval()
    return model


def build_random_model(config, seed: int, **kwargs) -> torch.nn.Module:
    """A float32 HF causal LM for `config` with every parameter drawn at random (deterministic for a seed)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, **kwargs)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=generator, dtype=torch.float32)
            if "norm" in name:
                param.copy_(1.0 + 0.2 * noise)  # RMSNorm weights around 1
            elif name.endswith(".bias"):
                param.copy_(0.1 * noise)
            else:
                param.copy_(noise / param.shape[-1] ** 0.5)  # unit-variance activations
    return model


def save_tiny_model(arch: str, out_dir: Path, seed: int = 0, max_shard_size: Optional[str] = None) -> Path:
    """Build a tiny model and save it as an HF directory (config.json + safetensors)."""
    out_dir = Path(out_dir)
    model = build_tiny_model(arch, seed)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(out_dir, **kwargs)
    return out_dir


def load_hf_model(path: Path) -> torch.nn.Module:
    """Load a saved tiny model as the float32 eager-attention reference."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager", dtype=torch.float32)
    model.eval()
    return model
