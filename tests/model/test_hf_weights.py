"""HFWeightReader: single-file and sharded checkpoints, lazy by-name access, one open shard at a time."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from megatron_dapo.model.hf_weights import HFWeightReader


def _all_tensors(directory) -> dict[str, torch.Tensor]:
    tensors = {}
    for file in sorted(directory.glob("*.safetensors")):
        tensors.update(load_file(str(file)))
    return tensors


@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])  # qwen3 is saved sharded by the fixture
def test_reads_every_tensor_exactly(tiny_model_dirs, arch):
    directory = tiny_model_dirs[arch]
    expected = _all_tensors(directory)
    sharded = (directory / "model.safetensors.index.json").exists()
    assert sharded == (arch == "qwen3")
    with HFWeightReader(directory) as reader:
        assert reader.names() == sorted(expected)
        for name in reader.names():
            assert torch.equal(reader.get(name), expected[name])
        streamed = dict(reader.iter_tensors())
    assert streamed.keys() == expected.keys()


def test_iter_groups_by_shard_and_keeps_one_file_open(tiny_model_dirs):
    with HFWeightReader(tiny_model_dirs["qwen3"]) as reader:
        files = [reader.file_of(name) for name, _ in reader.iter_tensors()]
        assert files == sorted(files)  # each shard visited once
        assert len(set(files)) > 1
        reader.get(reader.names()[0])
        assert reader._open_name is not None
    assert reader._open_name is None and reader._open_handle is None


def test_missing_tensor_and_missing_files(tmp_path):
    save_file({"a": torch.zeros(2)}, str(tmp_path / "model.safetensors"))
    with HFWeightReader(tmp_path) as reader:
        assert "a" in reader and "b" not in reader
        with pytest.raises(KeyError, match="'b' is not in the checkpoint"):
            reader.get("b")
    with pytest.raises(FileNotFoundError, match="no model.safetensors"):
        HFWeightReader(tmp_path / "nothing")
    shard_dir = tmp_path / "sharded"
    shard_dir.mkdir()
    (shard_dir / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"a": "model-00001.safetensors"}}))
    with pytest.raises(FileNotFoundError, match="missing shard files"):
        HFWeightReader(shard_dir)
