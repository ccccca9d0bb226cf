"""Builder helpers that need no process group: RoPE inverse frequencies vs HF, masks (TE selection:
test_gpu_kernels.py)."""

from __future__ import annotations

import pytest
import torch

from megatron_dapo.model import builder
from megatron_dapo.model.hf_config import read_hf_config
from tests.support.tiny_models import tiny_config


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


def _moe_cfg(arch: str):
    from tests.support.tiny_models import tiny_moe_config

    return read_hf_config(tiny_moe_config(arch).to_dict())


def test_moe_transformer_config():
    from megatron_dapo.distributed.layout import ParallelLayout

    qwen3 = builder.build_transformer_config(_moe_cfg("qwen3_moe"), ParallelLayout(ep=2), torch.float32)
    assert (qwen3.num_moe_experts, qwen3.moe_router_topk, qwen3.moe_ffn_hidden_size) == (4, 2, 32)
    assert qwen3.expert_model_parallel_size == 2 and qwen3.moe_token_dispatcher_type == "alltoall"
    # Qwen3-MoE renormalises the top-k weights: softmax over the top-k logits (not pre-softmax).
    assert qwen3.moe_router_score_function == "softmax" and qwen3.moe_router_pre_softmax is False
    assert qwen3.moe_router_load_balancing_type == "aux_loss" and qwen3.moe_aux_loss_coeff == 0.001
    assert qwen3.moe_grouped_gemm is False  # sequential experts on the local spec
    assert qwen3.moe_shared_expert_intermediate_size is None
    qwen2 = builder.build_transformer_config(
        _moe_cfg("qwen2_moe"), ParallelLayout(), torch.float32, use_te=True, moe_token_dispatcher="allgather", moe_aux_loss_coeff=0.0
    )
    assert qwen2.moe_router_pre_softmax is True  # norm_topk_prob=false: softmax over all experts, kept
    assert qwen2.moe_shared_expert_intermediate_size == 48 and qwen2.moe_shared_expert_gate is True
    assert qwen2.moe_grouped_gemm is True and qwen2.moe_token_dispatcher_type == "allgather"
    assert qwen2.moe_aux_loss_coeff == 0.0 and qwen2.expert_model_parallel_size == 1
    dense = builder.build_transformer_config(read_hf_config(tiny_config("qwen3").to_dict()), ParallelLayout(), torch.float32)
    assert dense.num_moe_experts is None


@pytest.mark.parametrize(
    "arch,kwargs,layout,message",
    [
        ("qwen3_moe", {}, {"ep": 3}, r"parallel.ep=3 does not divide the model's num_experts=4: use parallel.ep in \{1, 2, 4\}"),
        ("qwen3", {}, {"ep": 2}, "parallel.ep=2 needs a mixture-of-experts model"),
        ("qwen3_moe", {"moe_token_dispatcher": "flex"}, {}, "MoE token dispatcher 'flex' is not supported"),
        ("qwen3_moe", {"moe_token_dispatcher": "allgather"}, {"pp": 2}, "allgather MoE token dispatcher does not take"),
    ],
)  # fmt: skip
def test_moe_transformer_config_refusals(arch, kwargs, layout, message):
    from megatron_dapo.distributed.layout import ExpertParallelError, ParallelLayout

    cfg = _moe_cfg(arch) if arch.endswith("_moe") else read_hf_config(tiny_config(arch).to_dict())
    with pytest.raises(ExpertParallelError, match=message):
        builder.build_transformer_config(cfg, ParallelLayout(**layout), torch.float32, **kwargs)


def test_local_moe_spec_stores_the_pre_mlp_norm_under_its_own_key():
    dense = builder._layer_spec(read_hf_config(tiny_config("qwen3").to_dict()), use_te=False)
    moe = builder._layer_spec(_moe_cfg("qwen3_moe"), use_te=False)
    assert dense.submodules.sharded_state_dict_keys_map["pre_mlp_layernorm."] == "mlp.linear_fc1.layer_norm_"
    # TE's MoE spec keeps `pre_mlp_layernorm.weight`: CPU-made MoE checkpoints load on TE GPUs.
    assert "pre_mlp_layernorm." not in moe.submodules.sharded_state_dict_keys_map
    assert moe.submodules.sharded_state_dict_keys_map["input_layernorm."] == "self_attention.linear_qkv.layer_norm_"
