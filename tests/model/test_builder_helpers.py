"""Builder helpers that need no process group: RoPE inverse frequencies vs HF, masks (TE selection:
test_gpu_kernels.py)."""

from __future__ import annotations

import pytest
import torch

from megatron_dapo.model import builder
from megatron_dapo.model.hf_config import read_hf_config
from tiny_models import tiny_config


def _hf_inv_freq(hf_cfg) -> torch.Tensor:
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    rope_type = hf_cfg.rope_parameters.get("rope_type", "default")
    if rope_type == "default":
        dim = getattr(hf_cfg, "head_dim", None) or hf_cfg.hidden_size // hf_cfg.num_attention_heads
        base = hf_cfg.rope_parameters["rope_theta"]
        return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    inv_freq, attention_scaling = ROPE_INIT_FUNCTIONS[rope_type](hf_cfg, "cpu")
    assert attention_scaling == 1.0
    return inv_freq


@pytest.mark.parametrize("arch", ["qwen2", "llama3", "qwen3"])
def test_rope_inv_freq_equals_hf(arch):
    hf_cfg = tiny_config(arch)
    ours = builder.rope_inv_freq(read_hf_config(hf_cfg.to_dict()))
    assert torch.equal(ours, _hf_inv_freq(hf_cfg))


def test_llama3_scaling_uses_the_configs_parameters():
    # The tiny llama3 config's original context (64) differs from Megatron's built-in 8192, and its
    # frequencies fall in all three llama3 regimes: kept, interpolated, divided by the factor.
    cfg = read_hf_config(tiny_config("llama3").to_dict())
    plain = builder.rope_inv_freq(read_hf_config(tiny_config("qwen2").to_dict()))  # same theta and head_dim
    scaled = builder.rope_inv_freq(cfg)
    ratio = plain / scaled
    assert torch.isclose(ratio[0], torch.tensor(1.0))
    assert torch.isclose(ratio[-1], torch.tensor(8.0))
    assert ((ratio > 1.0 + 1e-6) & (ratio < 8.0 - 1e-6)).any()


def test_causal_attention_mask():
    mask = builder.causal_attention_mask(4)
    assert mask.shape == (1, 1, 4, 4) and mask.dtype == torch.bool
    assert mask[0, 0].tolist() == [
        [False, True, True, True],
        [False, False, True, True],
        [False, False, False, True],
        [False, False, False, False],
    ]
