"""HF -> Megatron -> HF conversion of the tiny models, and loading converted checkpoints at any layout.

- Round trip (one plain Python process converts every architecture with --tp 2 --pp 2 and back):
  every tensor bit-identical (names, dtypes, values; read with the safetensors library), config,
  generation config and tokenizer files restored byte for byte, sharded output + index for the
  model exported with a small --max-shard-size, a single model.safetensors otherwise.
- The converted checkpoint holds the same keys, global shapes and dtypes as Megatron's own save
  of the same model (vocabulary rows aside: they follow the TP padding, which Megatron reshapes).
- One 4-process torchrun launch loads every converted checkpoint at TP=2 x PP=2, TP=2, PP=2,
  TP=1 (DP=4) and PP=2 x VPP=2 and compares Megatron's logits with HF transformers' (max |diff|
  <= 1e-5, float32): the single-process checkpoint is layout-independent.
- The logits check of the converter names the first diverging block when a layer is wrong.
- --dtype casts; transformers itself loads a sharded export (index + shards).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from tests.support.tiny_models import ARCHS
from tests.support.torchrun_utils import run_torchrun_function

WORKER = Path(__file__).parent / "_convert_worker.py"
TOL = 1e-5
SHARD_SIZES = {"qwen2": "5GB", "qwen2_tied": "5GB", "llama3": "5GB", "qwen3": "60KB"}
LAYOUTS = [
    {"name": "tp2pp2", "tp": 2, "pp": 2},
    {"name": "tp2", "tp": 2, "pp": 1},
    {"name": "pp2", "tp": 1, "pp": 2},
    {"name": "tp1", "tp": 1, "pp": 1},
    {"name": "pp2vpp2", "tp": 1, "pp": 2, "vpp": 2},
]
TOKENIZER_FILES = {
    "tokenizer.json": '{"version": "1.0", "model": {"type": "BPE", "vocab": {"a": 0}}}\n',
    "tokenizer_config.json": '{"model_max_length": 256, "eos_token": "<eos>"}\n',
    "special_tokens_map.json": '{"eos_token": "<eos>"}\n',
}


def _tensors(directory: Path) -> dict[str, torch.Tensor]:
    tensors = {}
    for file in sorted(directory.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as handle:
            for name in handle.keys():
                assert name not in tensors, f"{name} stored twice"
                tensors[name] = handle.get_tensor(name)
    return tensors


@pytest.fixture(scope="module")
def hf_models(tiny_model_dirs, tmp_path_factory) -> dict[str, Path]:
    """The tiny models plus tokenizer files (conversion must carry them over)."""
    root = tmp_path_factory.mktemp("hf_with_tokenizer")
    dirs = {}
    for arch in ARCHS:
        target = root / arch
        shutil.copytree(tiny_model_dirs[arch], target)
        for name, text in TOKENIZER_FILES.items():
            (target / name).write_text(text)
        dirs[arch] = target
    return dirs


@pytest.fixture(scope="module")
def tampered_hf(hf_models, tmp_path_factory) -> Path:
    """qwen2 with layer 2's down projection changed."""
    target = tmp_path_factory.mktemp("tampered") / "qwen2"
    shutil.copytree(hf_models["qwen2"], target)
    weights = load_file(str(target / "model.safetensors"))
    weights["model.layers.2.mlp.down_proj.weight"] += 0.05
    save_file(weights, str(target / "model.safetensors"), metadata={"format": "pt"})
    return target


@pytest.fixture(scope="module")
def converted(hf_models, tampered_hf, tmp_path_factory) -> tuple[Path, dict]:
    out_root = tmp_path_factory.mktemp("converted")
    result = run_torchrun_function(
        WORKER,
        "convert_all",
        nproc=1,
        use_torchrun=False,
        timeout=300,
        kwargs={
            "hf_dirs": {arch: str(path) for arch, path in hf_models.items()},
            "out_root": str(out_root),
            "shard_sizes": SHARD_SIZES,
            "tampered": {"hf_dir": str(tampered_hf), "reference_dir": str(hf_models["qwen2"])},
        },
    )
    result.check()
    return out_root, result.rank_results[0]


@pytest.mark.parametrize("arch", ARCHS)
def test_round_trip_is_bit_identical(arch, hf_models, converted):
    out_root, _ = converted
    original, exported = _tensors(hf_models[arch]), _tensors(out_root / arch / "hf")
    assert sorted(exported) == sorted(original)
    for name, tensor in original.items():
        assert exported[name].dtype == tensor.dtype, name
        assert exported[name].shape == tensor.shape, name
        assert torch.equal(exported[name], tensor), f"{name} changed in the round trip"
    for name in ["config.json", "generation_config.json", *TOKENIZER_FILES]:
        assert (out_root / arch / "hf" / name).read_bytes() == (hf_models[arch] / name).read_bytes(), name
    # The checkpoint carries them too (that is where the reverse conversion takes them from).
    assert (out_root / arch / "megatron" / "hf" / "tokenizer.json").is_file()
    assert not (out_root / arch / "megatron" / "stale_file").exists()  # --overwrite emptied the output
    if arch == "qwen2_tied":
        assert "lm_head.weight" not in exported


def test_sharded_export_has_a_complete_index(converted):
    out_root, _ = converted
    exported = out_root / "qwen3" / "hf"
    index = json.loads((exported / "model.safetensors.index.json").read_text())
    files = sorted(p.name for p in exported.glob("*.safetensors"))
    assert len(files) > 1 and all(f.startswith("model-") and f.endswith(f"-of-{len(files):05d}.safetensors") for f in files)
    assert sorted(set(index["weight_map"].values())) == files
    for file in files:
        with safe_open(str(exported / file), framework="pt") as handle:
            names = list(handle.keys())
            assert all(index["weight_map"][name] == file for name in names)
            data = sum(handle.get_tensor(n).numel() * handle.get_tensor(n).element_size() for n in names)
            assert data <= 60_000 or len(names) == 1, f"{file} holds {data} bytes"
    tensors = _tensors(exported)
    assert sorted(index["weight_map"]) == sorted(tensors)
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in tensors.values())
    single = out_root / "qwen2" / "hf"
    assert [p.name for p in single.glob("*.safetensors")] == ["model.safetensors"]
    assert not (single / "model.safetensors.index.json").exists()


def test_dtype_option_casts_the_weights(hf_models, converted):
    out_root, result = converted
    arch = result["bf16_arch"]
    original, exported = _tensors(hf_models[arch]), _tensors(out_root / "bf16" / "hf")
    assert sorted(exported) == sorted(original)
    assert all(exported[n].dtype == torch.bfloat16 and torch.equal(exported[n], t.to(torch.bfloat16)) for n, t in original.items())
    meta = json.loads((out_root / "bf16" / "megatron" / "metadata.json").read_text())
    assert meta["model"]["dtype"] == "bfloat16"


def test_transformers_loads_the_sharded_export(hf_models, converted):
    from tests.support.tiny_models import load_hf_model

    out_root, _ = converted
    original = load_hf_model(hf_models["qwen3"]).state_dict()
    exported = load_hf_model(out_root / "qwen3" / "hf").state_dict()
    assert sorted(exported) == sorted(original)
    assert all(torch.equal(exported[n], original[n]) for n in original)


def test_converted_checkpoint_metadata(hf_models, converted):
    out_root, _ = converted
    meta = json.loads((out_root / "qwen2" / "megatron" / "metadata.json").read_text())
    assert meta["format"] == "megatron-dapo-checkpoint" and meta["step"] == 0
    assert meta["contents"]["model"] is True and meta["contents"]["optimizer"] is None
    assert (meta["layout"]["tp"], meta["layout"]["pp"]) == (2, 2)
    assert meta["model"]["hf_config"] == json.loads((hf_models["qwen2"] / "config.json").read_text())
    assert meta["model"]["dtype"] == "float32"
    dist = json.loads((out_root / "qwen2" / "megatron" / "dist" / "metadata.json").read_text())
    assert dist["sharded_backend"] == "torch_dist"


def test_logits_check_names_the_tampered_layer(converted):
    _, result = converted
    assert "first divergence at layer 2" in result["tampered"], result["tampered"]
    assert "layers 0-1 match" in result["tampered"]


@pytest.fixture(scope="module")
def layout_results(hf_models, converted, tmp_path_factory):
    out_root, _ = converted
    result = run_torchrun_function(
        WORKER,
        "load_layouts",
        nproc=4,
        timeout=420,
        kwargs={
            "checkpoints": {arch: str(out_root / arch / "megatron") for arch in ARCHS},
            "hf_dirs": {arch: str(path) for arch, path in hf_models.items()},
            "layouts": LAYOUTS,
            "megatron_save_root": str(tmp_path_factory.mktemp("megatron_saves")),
        },
    )
    result.check()
    return result.rank_results


@pytest.mark.parametrize("layout", [spec["name"] for spec in LAYOUTS])
def test_converted_checkpoint_loads_at_any_layout(layout, layout_results):
    for rank, result in enumerate(layout_results):
        for arch in ARCHS:
            entry = result["layouts"][layout][arch]
            assert entry["max_abs_diff"] <= TOL, f"rank {rank} {arch} at {layout}: {entry}"
            assert entry["step"] == 0


@pytest.mark.parametrize("arch", ARCHS)
def test_converted_format_matches_megatron_save(arch, layout_results):
    formats = layout_results[0]["formats"][arch]
    megatron, converted = formats["megatron"], formats["converted"]
    assert sorted(converted) == sorted(megatron)
    vocab_keys = {"embedding.word_embeddings.weight", "output_layer.weight"}
    for key, entry in megatron.items():
        if entry is None:  # a ShardedObject (_extra_state)
            assert converted[key] is None, key
            continue
        (shape, dtype), (conv_shape, conv_dtype) = entry, converted[key]
        assert conv_dtype == dtype, key
        if key in vocab_keys:  # padded to 128 x TP rows: 512 at TP=2, 384 for the converted TP=1 layout
            assert conv_shape[1:] == shape[1:] and conv_shape[0] == 384 and shape[0] == 512, key
        else:
            assert conv_shape == shape, key
