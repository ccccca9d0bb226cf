"""What a plan is for (plan/shapes.py): the GPU capacities torch and vLLM report, and the model shape."""

from __future__ import annotations

import json

import pytest

from megatron_dapo import plan as mp
from megatron_dapo.config import ConfigError, load_config
from tests.support.plans import known, plan_for


def test_gpu_capacity_is_what_torch_reports_not_the_marketing_size():
    """The table keeps the lowest published `total_memory` of each GPU (module doc: PyTorch's
    "total capacity of 79.10 GiB" on an H100 80GB, vLLM's "total_gpu_memory (79.11GiB)".."(79.25GiB)",
    H200 "(139.81GiB)"); the default cluster is H100s and the CLI takes --gpu or --gpu-memory-gib."""
    assert {k: v.memory_gib for k, v in mp.GPU_MODELS.items()} == {
        "h100": 79.1, "h200": 139.8, "a100-80gb": 79.1, "a100-40gb": 39.3,
    }  # fmt: skip
    for model in mp.GPU_MODELS.values():
        marketed = float(model.label.split()[-1].removesuffix("GB"))
        assert marketed - 1.3 < model.memory_gib < marketed  # what the driver leaves of the size on the box
    assert mp.ClusterShape().gpu_memory_bytes == pytest.approx(79.1 * mp.GIB)
    default = plan_for([])
    h200 = mp.plan_memory(load_config(None, []), known("qwen2.5-7b"), mp.ClusterShape(2, 8, 139.8, "h200"))
    assert h200.gpu_memory == pytest.approx(139.8 * mp.GIB) and h200.rollout.pool > default.rollout.pool


def test_model_shape_from_the_table_or_the_model_directory(tmp_path):
    """`--model` picks a built-in shape (any case); without it the shape is `model.hf_dir`'s config.json.
    Either way the layout is checked against it with the config's own messages."""
    cfg = load_config(None, ["parallel.tp=4"])
    name, model = mp.resolve_model(cfg, "Qwen2.5-7B")
    assert name == "qwen2.5-7b" and mp.hf_parameter_count(model) == mp.hf_parameter_count(known("qwen2.5-7b"))
    with pytest.raises(ConfigError, match="unknown model 'gpt-2': known models are qwen2.5-0.5b, "):
        mp.known_model("gpt-2")
    with pytest.raises(ConfigError, match="unknown model 'gpt-2'"):
        mp.resolve_model(cfg, "gpt-2")
    model_dir = tmp_path / "qwen-7b-copy"
    model_dir.mkdir()
    (model_dir / "config.json").write_text(json.dumps(mp.KNOWN_MODELS["qwen2.5-7b"]))
    name, from_dir = mp.resolve_model(load_config(None, ["parallel.tp=4", f"model.hf_dir={model_dir}"]))
    assert name == "qwen-7b-copy" and from_dir == model
    with pytest.raises(ConfigError, match="'parallel.tp'=8 does not divide the model's num_attention_heads=28"):
        mp.resolve_model(load_config(None, ["parallel.tp=8"]), "qwen2.5-7b")
    with pytest.raises(ConfigError, match="has no config.json; set model.hf_dir"):
        mp.resolve_model(load_config(None, [f"model.hf_dir={tmp_path / 'missing'}"]))
