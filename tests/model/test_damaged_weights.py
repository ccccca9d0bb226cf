"""Damaged safetensors (a copy cut short, an empty file, bytes overwritten, an index that does not
match its shards): a `ModelFileError` naming the file and the fix, found from the headers alone,
never the library's bare `SafetensorError`."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
from safetensors import SafetensorError, safe_open

from megatron_dapo.model.hf_config import ModelFileError
from megatron_dapo.model.hf_weights import HFWeightReader, check_safetensors_file, check_weight_files


@pytest.fixture
def single(tiny_model_dirs, tmp_path) -> Path:
    return Path(shutil.copytree(tiny_model_dirs["qwen2"], tmp_path / "single"))


@pytest.fixture
def sharded(tiny_model_dirs, tmp_path) -> Path:
    return Path(shutil.copytree(tiny_model_dirs["qwen3"], tmp_path / "sharded"))  # index + shards


def _cut(path: Path, drop: int) -> None:
    os.truncate(path, path.stat().st_size - drop)


def _overwrite_start(path: Path) -> None:
    with open(path, "r+b") as handle:
        handle.write(b"\xff" * 64)


def _garbage_header(path: Path) -> None:
    with open(path, "r+b") as handle:
        handle.seek(8)
        handle.write(b"\x00garbage")


DAMAGE = {
    "cut_short": (lambda p: _cut(p, 1000), r"has \d+ bytes but its header describes \d+: it is cut short"),
    "empty": (lambda p: p.write_bytes(b""), r"has 0 bytes, too few for a safetensors file"),
    "start_overwritten": (_overwrite_start, r"its first 8 bytes announce a header of \d+ bytes in a file of \d+ bytes"),
    "header_overwritten": (_garbage_header, r"the header is not a valid safetensors header"),
    "trailing_bytes": (lambda p: p.open("ab").write(b"\0" * 16), r"has trailing bytes"),
}


@pytest.mark.parametrize("damage", sorted(DAMAGE))
def test_damage_is_found_from_the_header_and_named(single, damage):
    path = single / "model.safetensors"
    names = check_safetensors_file(path)
    with safe_open(str(path), framework="pt") as handle:
        assert sorted(names) == sorted(handle.keys())  # the header check reads the library's own names
    make, expected = DAMAGE[damage]
    make(path)
    with pytest.raises(ModelFileError, match=expected) as info:
        check_weight_files(single)
    assert str(path) in str(info.value) and "copy or download it again" in str(info.value)


@pytest.mark.parametrize("damage", ["cut_short", "empty", "start_overwritten"])
def test_reader_raises_a_named_error_not_safetensor_error(single, damage):
    path = single / "model.safetensors"
    DAMAGE[damage][0](path)
    with pytest.raises(SafetensorError):  # what the library says on its own
        safe_open(str(path), framework="pt")
    with pytest.raises(ModelFileError, match=str(path).replace(".", r"\.")):
        HFWeightReader(single)


def test_sharded_checkpoint_index_and_shards(sharded):
    index = sharded / "model.safetensors.index.json"
    assert check_weight_files(sharded) == len(json.loads(index.read_text())["weight_map"])
    weight_map = json.loads(index.read_text())
    first_shard = sorted(set(weight_map["weight_map"].values()))[0]
    _cut(sharded / first_shard, 100)
    with pytest.raises(ModelFileError, match=f"{first_shard} has .* it is cut short"):
        check_weight_files(sharded)
    with HFWeightReader(sharded) as reader:  # the lazy reader names it when it opens that shard
        name = next(n for n in reader.names() if reader.file_of(n) == first_shard)
        with pytest.raises(ModelFileError, match=first_shard):
            reader.get(name)


def test_index_that_does_not_match_its_shards(sharded):
    index = sharded / "model.safetensors.index.json"
    original = json.loads(index.read_text())
    moved = dict(original)
    shards = sorted(set(original["weight_map"].values()))
    name = next(n for n, f in original["weight_map"].items() if f == shards[0])
    moved["weight_map"] = {**original["weight_map"], name: shards[1]}
    index.write_text(json.dumps(moved))
    with pytest.raises(ModelFileError, match=rf"{shards[1]} lacks 1 tensor\(s\) that model.safetensors.index.json places there"):
        check_weight_files(sharded)
    index.write_text('{"weight_map": {')
    with pytest.raises(ModelFileError, match="index.json is not a JSON object with a weight_map"):
        check_weight_files(sharded)
    with pytest.raises(ModelFileError, match="index.json is not a JSON object with a weight_map"):
        HFWeightReader(sharded)
    index.unlink()
    for shard in shards:
        (sharded / shard).unlink()
    with pytest.raises(FileNotFoundError, match="no model.safetensors or model.safetensors.index.json"):
        check_weight_files(sharded)
