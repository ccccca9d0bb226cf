"""The on-disk rules of checkpoints, in one process without torch.distributed.

Complete vs incomplete directories, the `latest` pointer and its fallback, pruning, atomic
writes, which HF files are carried over, and the errors a load reports before it touches a model.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from megatron_dapo.checkpoint.layout import (
    CHECKPOINT_FORMAT,
    atomic_write_text,
    copy_hf_side_files,
    find_latest,
    is_complete_checkpoint,
    list_checkpoints,
    parse_step_dir,
    prune_checkpoints,
    read_metadata,
    resolve_checkpoint_dir,
    step_dir_name,
    write_latest_pointer,
)


def _complete(root: Path, step: int) -> Path:
    path = root / step_dir_name(step)
    (path / "dist").mkdir(parents=True)
    (path / "metadata.json").write_text(json.dumps({"format": CHECKPOINT_FORMAT, "step": step}))
    return path


def _incomplete(root: Path, name: str) -> Path:
    path = root / name
    (path / "dist").mkdir(parents=True)
    (path / "dist" / "__0_0.distcp").write_bytes(b"partial")
    return path


def test_step_names_sort_like_steps():
    names = [step_dir_name(s) for s in (9, 10, 100)]
    assert names == sorted(names) == ["step_00000009", "step_00000010", "step_00000100"]
    assert parse_step_dir("step_00000100") == 100
    assert parse_step_dir(".tmp-step_00000100") is None and parse_step_dir("latest") is None
    with pytest.raises(ValueError):
        step_dir_name(-1)


def test_find_latest_follows_the_pointer_and_ignores_incomplete_saves(tmp_path):
    _complete(tmp_path, 10)
    _complete(tmp_path, 20)
    _incomplete(tmp_path, ".tmp-step_00000030")
    _incomplete(tmp_path, "step_00000040")  # renamed but without metadata: never happens, still not complete
    assert [s for s, _ in list_checkpoints(tmp_path)] == [10, 20]
    assert find_latest(tmp_path) == tmp_path / "step_00000020"  # no pointer: highest complete step
    write_latest_pointer(tmp_path, "step_00000010")
    assert find_latest(tmp_path) == tmp_path / "step_00000010"  # the pointer wins
    write_latest_pointer(tmp_path, "step_00000099")  # names a directory that is gone
    assert find_latest(tmp_path) == tmp_path / "step_00000020"


def test_damaged_or_foreign_metadata_is_not_a_checkpoint(tmp_path):
    path = _complete(tmp_path, 5)
    (path / "metadata.json").write_text("{not json")
    assert not is_complete_checkpoint(path)
    with pytest.raises(ValueError, match="not valid JSON"):
        read_metadata(path)
    (path / "metadata.json").write_text(json.dumps({"format": "something-else"}))
    with pytest.raises(ValueError, match="not a megatron-dapo checkpoint"):
        read_metadata(path)
    assert find_latest(tmp_path) is None


def test_resolve_checkpoint_dir_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        resolve_checkpoint_dir(tmp_path / "missing")
    (tmp_path / "file").write_text("x")
    with pytest.raises(FileNotFoundError, match="not a directory"):
        resolve_checkpoint_dir(tmp_path / "file")
    root = tmp_path / "root"
    root.mkdir()
    with pytest.raises(FileNotFoundError, match="no complete checkpoint"):
        resolve_checkpoint_dir(root)
    _incomplete(root, ".tmp-step_00000007")
    with pytest.raises(FileNotFoundError, match=r"incomplete saves, ignored: \.tmp-step_00000007"):
        resolve_checkpoint_dir(root)
    step = _complete(root, 3)
    assert resolve_checkpoint_dir(root) == step
    assert resolve_checkpoint_dir(step) == step


def test_load_checkpoint_reports_missing_or_incomplete_before_touching_models(tmp_path):
    from megatron_dapo.checkpoint import load_checkpoint

    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_checkpoint(tmp_path / "nothing", models=[])
    _incomplete(tmp_path, ".tmp-step_00000001")
    with pytest.raises(FileNotFoundError, match="no complete checkpoint"):
        load_checkpoint(tmp_path, models=[])


def test_prune_keeps_the_newest_and_the_pointer_target(tmp_path):
    for step in (1, 2, 3, 4):
        _complete(tmp_path, step)
    write_latest_pointer(tmp_path, "step_00000001")
    removed = prune_checkpoints(tmp_path, keep_last=2, protect=tmp_path / "step_00000004")
    assert sorted(p.name for p in removed) == ["step_00000002"]
    assert [s for s, _ in list_checkpoints(tmp_path)] == [1, 3, 4]
    assert prune_checkpoints(tmp_path, keep_last=0) == []  # 0 keeps everything
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".tmp-")]


def test_atomic_write_replaces_without_leftovers(tmp_path):
    target = tmp_path / "latest"
    atomic_write_text(target, "step_00000001\n")
    atomic_write_text(target, "step_00000002\n")
    assert target.read_text() == "step_00000002\n"
    assert [p.name for p in tmp_path.iterdir()] == ["latest"]


def test_hf_side_files_exclude_weights(tmp_path):
    source = tmp_path / "hf"
    source.mkdir()
    for name in ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                 "model.safetensors", "model-00001-of-00002.safetensors", "model.safetensors.index.json",
                 "pytorch_model.bin", "README.md"):  # fmt: skip
        (source / name).write_text(name)
    (source / "subdir").mkdir()
    copied = copy_hf_side_files(source, tmp_path / "out")
    assert copied == ["README.md", "config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"]
    assert (tmp_path / "out" / "tokenizer.json").read_text() == "tokenizer.json"
