"""HF config.json -> HFModelConfig: supported architectures, both RoPE formats, clear refusals."""

from __future__ import annotations

import json

import pytest

from megatron_dapo.model.hf_config import UnsupportedModelError, read_hf_config

# Shapes of real checkpoints (config.json as published), trimmed to the keys that matter.
QWEN25_7B = {
    "architectures": ["Qwen2ForCausalLM"], "hidden_act": "silu", "hidden_size": 3584, "intermediate_size": 18944,
    "max_position_embeddings": 32768, "max_window_layers": 28, "model_type": "qwen2", "num_attention_heads": 28,
    "num_hidden_layers": 28, "num_key_value_heads": 4, "rms_norm_eps": 1e-06, "rope_theta": 1000000.0,
    "sliding_window": 131072, "tie_word_embeddings": False, "torch_dtype": "bfloat16", "use_sliding_window": False,
    "vocab_size": 152064, "attention_dropout": 0.0,
}  # fmt: skip
LLAMA31_8B = {
    "architectures": ["LlamaForCausalLM"], "attention_bias": False, "attention_dropout": 0.0, "hidden_act": "silu",
    "hidden_size": 4096, "intermediate_size": 14336, "max_position_embeddings": 131072, "mlp_bias": False,
    "model_type": "llama", "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 8,
    "pretraining_tp": 1, "rms_norm_eps": 1e-05,
    "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    "rope_theta": 500000.0, "tie_word_embeddings": False, "vocab_size": 128256,
}  # fmt: skip
QWEN3_06B = {
    "architectures": ["Qwen3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0, "head_dim": 128,
    "hidden_act": "silu", "hidden_size": 1024, "intermediate_size": 3072, "max_position_embeddings": 40960,
    "max_window_layers": 28, "model_type": "qwen3", "num_attention_heads": 16, "num_hidden_layers": 28,
    "num_key_value_heads": 8, "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 1000000,
    "sliding_window": None, "tie_word_embeddings": True, "use_sliding_window": False, "vocab_size": 151936,
}  # fmt: skip


def test_qwen25_7b():
    cfg = read_hf_config(QWEN25_7B)
    assert cfg.architecture == "Qwen2ForCausalLM"
    assert (cfg.hidden_size, cfg.num_layers, cfg.num_attention_heads, cfg.num_key_value_heads) == (3584, 28, 28, 4)
    assert (cfg.head_dim, cfg.ffn_hidden_size, cfg.vocab_size) == (128, 18944, 152064)
    assert cfg.qkv_bias is True and cfg.qk_norm is False and cfg.tie_word_embeddings is False
    assert cfg.rope_theta == 1e6 and cfg.rope_scaling is None
    assert cfg.torch_dtype == "bfloat16" and cfg.heads_per_group == 7


def test_llama31_old_rope_format():
    cfg = read_hf_config(LLAMA31_8B)
    assert cfg.qkv_bias is False and cfg.qk_norm is False
    assert cfg.rope_theta == 500000.0 and cfg.rms_norm_eps == 1e-5
    assert cfg.rope_scaling == {
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }  # fmt: skip


def test_llama31_transformers5_rope_parameters_format():
    raw = dict(LLAMA31_8B)
    scaling = raw.pop("rope_scaling")
    raw.pop("rope_theta")
    raw["rope_parameters"] = {**scaling, "rope_theta": 500000.0}
    assert read_hf_config(raw) == read_hf_config(LLAMA31_8B)


def test_llama3_original_context_falls_back_to_max_positions_like_hf():
    raw = dict(LLAMA31_8B, rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0})
    assert read_hf_config(raw).rope_scaling["original_max_position_embeddings"] == 131072


def test_old_type_key_and_plain_llama():
    raw = dict(LLAMA31_8B, rope_scaling={"type": "default"})
    assert read_hf_config(raw).rope_scaling is None
    raw = dict(LLAMA31_8B)
    del raw["rope_scaling"]
    assert read_hf_config(raw).rope_scaling is None


def test_qwen3_head_dim_differs_and_tied():
    cfg = read_hf_config(QWEN3_06B)
    assert cfg.head_dim == 128 and cfg.hidden_size // cfg.num_attention_heads == 64
    assert cfg.qk_norm is True and cfg.qkv_bias is False and cfg.tie_word_embeddings is True
    assert cfg.rope_theta == 1e6


def test_reads_a_directory_and_a_file(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(QWEN3_06B))
    assert read_hf_config(tmp_path) == read_hf_config(tmp_path / "config.json") == read_hf_config(QWEN3_06B)
    with pytest.raises(FileNotFoundError):
        read_hf_config(tmp_path / "missing")


def test_tiny_test_models_parse(tiny_model_dirs):
    cfgs = {arch: read_hf_config(path) for arch, path in tiny_model_dirs.items()}
    assert cfgs["qwen2_tied"].tie_word_embeddings and not cfgs["qwen2"].tie_word_embeddings
    assert cfgs["llama3"].rope_scaling["original_max_position_embeddings"] == 64
    assert cfgs["qwen3"].head_dim == 32


@pytest.mark.parametrize(
    "base,change,message",
    [
        (QWEN25_7B, {"architectures": ["MistralForCausalLM"]}, r"unsupported architecture \['MistralForCausalLM'\]: supported are"),
        (QWEN25_7B, {"architectures": None, "model_type": "gpt2"}, "unsupported architecture 'gpt2'"),
        (QWEN25_7B, {"use_sliding_window": True}, r"Qwen2ForCausalLM: sliding-window attention \(use_sliding_window=true\)"),
        (QWEN25_7B, {"hidden_act": "gelu"}, "hidden_act 'gelu' is not supported"),
        (QWEN25_7B, {"rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}},
         "rope_type 'yarn' is not supported"),
        (LLAMA31_8B, {"rope_scaling": {"rope_type": "linear", "factor": 2.0}}, "rope_type 'linear' is not supported"),
        (LLAMA31_8B, {"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}, "rope_type 'dynamic'"),
        (LLAMA31_8B, {"attention_bias": True}, r"LlamaForCausalLM: attention_bias=true"),
        (LLAMA31_8B, {"mlp_bias": True}, "mlp_bias=true is not supported"),
        (QWEN3_06B, {"attention_bias": True}, "Qwen3ForCausalLM: attention_bias=true"),
        (LLAMA31_8B, {"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "llama3 rope scaling without low_freq_factor, high_freq_factor"),
        (QWEN25_7B, {"attention_dropout": 0.1}, "attention_dropout=0.1 is not supported"),
        (QWEN25_7B, {"partial_rotary_factor": 0.5}, "partial_rotary_factor=0.5"),
        (QWEN25_7B, {"layer_types": ["full_attention", "sliding_attention"]}, "layer types"),
        (QWEN25_7B, {"num_key_value_heads": 5}, "not a multiple of num_key_value_heads=5"),
        (QWEN25_7B, {"hidden_size": None}, "config.json has no 'hidden_size'"),
    ],
)  # fmt: skip
def test_refusals_name_the_feature(base, change, message):
    with pytest.raises(UnsupportedModelError, match=message):
        read_hf_config(dict(base, **change))


# Mixtures of experts (config.json as published, trimmed to the keys that matter).
QWEN3_30B_A3B = {
    "architectures": ["Qwen3MoeForCausalLM"], "attention_bias": False, "attention_dropout": 0.0, "decoder_sparse_step": 1,
    "head_dim": 128, "hidden_act": "silu", "hidden_size": 2048, "intermediate_size": 6144, "max_position_embeddings": 40960,
    "max_window_layers": 48, "mlp_only_layers": [], "model_type": "qwen3_moe", "moe_intermediate_size": 768,
    "norm_topk_prob": True, "num_attention_heads": 32, "num_experts": 128, "num_experts_per_tok": 8,
    "num_hidden_layers": 48, "num_key_value_heads": 4, "output_router_logits": False, "rms_norm_eps": 1e-06,
    "rope_scaling": None, "rope_theta": 1000000.0, "router_aux_loss_coef": 0.001, "sliding_window": None,
    "tie_word_embeddings": False, "torch_dtype": "bfloat16", "use_sliding_window": False, "vocab_size": 151936,
}  # fmt: skip
QWEN15_MOE_A27B = {
    "architectures": ["Qwen2MoeForCausalLM"], "attention_dropout": 0.0, "hidden_act": "silu", "hidden_size": 2048,
    "intermediate_size": 5632, "max_position_embeddings": 8192, "max_window_layers": 21, "model_type": "qwen2_moe",
    "num_attention_heads": 16, "num_hidden_layers": 24, "num_key_value_heads": 16, "rms_norm_eps": 1e-06,
    "rope_theta": 1000000.0, "sliding_window": 32768, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "use_sliding_window": False, "vocab_size": 151936, "decoder_sparse_step": 1, "moe_intermediate_size": 1408,
    "shared_expert_intermediate_size": 5632, "num_experts_per_tok": 4, "num_experts": 60, "norm_topk_prob": False,
    "output_router_logits": False, "router_aux_loss_coef": 0.001,
}  # fmt: skip


def test_qwen3_30b_a3b():
    cfg = read_hf_config(QWEN3_30B_A3B)
    assert cfg.architecture == "Qwen3MoeForCausalLM" and cfg.is_moe
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_ffn_hidden_size) == (128, 8, 768)
    assert cfg.norm_topk_prob is True and cfg.router_aux_loss_coef == 0.001
    assert cfg.shared_expert_ffn_hidden_size is None
    assert cfg.qk_norm is True and cfg.qkv_bias is False and cfg.head_dim == 128
    assert cfg.ffn_hidden_size == 6144  # the dense width; every layer of this model is MoE


def test_qwen15_moe_shared_expert():
    cfg = read_hf_config(QWEN15_MOE_A27B)
    assert cfg.architecture == "Qwen2MoeForCausalLM" and cfg.is_moe
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_ffn_hidden_size) == (60, 4, 1408)
    assert cfg.shared_expert_ffn_hidden_size == 5632 and cfg.norm_topk_prob is False
    assert cfg.qkv_bias is True and cfg.qk_norm is False


def test_dense_models_have_no_experts():
    cfg = read_hf_config(QWEN3_06B)
    assert not cfg.is_moe and cfg.num_experts == 0 and cfg.moe_ffn_hidden_size is None


def test_moe_config_variants():
    # transformers 5 writes the expert count as num_local_experts.
    raw = dict(QWEN3_30B_A3B, num_local_experts=128)
    del raw["num_experts"]
    assert read_hf_config(raw) == read_hf_config(QWEN3_30B_A3B)
    # norm_topk_prob absent: each config class's transformers default (Qwen3-MoE True, Qwen2-MoE False).
    assert read_hf_config({k: v for k, v in QWEN3_30B_A3B.items() if k != "norm_topk_prob"}).norm_topk_prob is True
    assert read_hf_config({k: v for k, v in QWEN15_MOE_A27B.items() if k != "norm_topk_prob"}).norm_topk_prob is False
    assert read_hf_config(dict(QWEN3_30B_A3B, mlp_only_layers=None, decoder_sparse_step=None)).num_experts == 128


def test_tiny_moe_test_models_parse():
    from tests.support.tiny_models import MOE_ARCHS, tiny_moe_config

    cfgs = {arch: read_hf_config(tiny_moe_config(arch).to_dict()) for arch in MOE_ARCHS}
    assert cfgs["qwen3_moe"].num_experts == cfgs["qwen2_moe"].num_experts == 4
    assert cfgs["qwen2_moe"].shared_expert_ffn_hidden_size == 48 and not cfgs["qwen2_moe"].norm_topk_prob


@pytest.mark.parametrize(
    "base,change,message",
    [
        (QWEN3_30B_A3B, {"decoder_sparse_step": 2}, r"Qwen3MoeForCausalLM: decoder_sparse_step=2 \(dense MLP layers"),
        (QWEN3_30B_A3B, {"mlp_only_layers": [0, 47]}, r"mlp_only_layers=\[0, 47\] \(dense MLP layers in an MoE model\)"),
        (QWEN3_30B_A3B, {"num_experts_per_tok": 129}, "num_experts_per_tok=129 exceeds num_experts=128"),
        (QWEN3_30B_A3B, {"moe_intermediate_size": None}, "needs a positive integer 'moe_intermediate_size'"),
        (QWEN3_30B_A3B, {"num_experts": None}, r"no 'num_experts' \(or 'num_local_experts'\)"),
        (QWEN3_30B_A3B, {"attention_bias": True}, "Qwen3MoeForCausalLM: attention_bias=true"),
        (QWEN15_MOE_A27B, {"shared_expert_intermediate_size": 0}, "'shared_expert_intermediate_size'"),
        (QWEN15_MOE_A27B, {"qkv_bias": False}, "qkv_bias=false is not supported"),
        (QWEN3_06B, {"num_experts": 8}, r"Qwen3ForCausalLM: mixture-of-experts layers \(num_experts=8\)"),
        (QWEN25_7B, {"num_local_experts": 8}, "mixture-of-experts layers"),
    ],
)  # fmt: skip
def test_moe_refusals_name_the_feature(base, change, message):
    with pytest.raises(UnsupportedModelError, match=message):
        read_hf_config(dict(base, **change))
