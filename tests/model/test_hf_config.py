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
