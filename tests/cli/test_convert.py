"""`megatron-dapo convert` and tools/convert_*.py, in this process: the help of both directions, and
every bad input as one line with exit code 2 before anything is written (missing directory, no
config.json, a TP / PP that does not divide the model, a non-empty output without --overwrite, a
truncated weight file, nothing complete to export). They fail before any Megatron state exists.
Conversions that run, and the errors a shell sees: tests/checkpoint/test_convert_cli.py."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest

from megatron_dapo.cli.main import main

REPO = Path(__file__).resolve().parents[2]


def _tool(name: str):
    """The `main(argv)` of a tools/ script, imported from its file."""
    spec = importlib.util.spec_from_file_location(name, REPO / "tools" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.main


def _help(capsys, entry, *argv: str) -> str:
    with pytest.raises(SystemExit) as exited:
        entry([*argv, "--help"])
    assert exited.value.code == 0
    return capsys.readouterr().out


def test_help_explains_both_directions(capsys):
    forward = _help(capsys, _tool("convert_hf_to_megatron"))
    for text in ("--hf-dir", "--tp", "--pp", "--vpp", "--ep", "--overwrite", "--verify-logits", "ANY tensor"):
        assert text in forward
    backward = _help(capsys, _tool("convert_megatron_to_hf"))
    for text in ("--megatron-dir", "--max-shard-size", "--hf-config-dir", "latest complete"):
        assert text in backward
    top = _help(capsys, main, "convert")
    assert "hf-to-megatron" in top and "megatron-to-hf" in top


def test_the_dtype_choices_are_the_librarys():
    from megatron_dapo.checkpoint.conversion import DTYPES
    from megatron_dapo.cli.convert import DTYPES as CHOICES

    assert CHOICES == DTYPES


def test_a_direction_is_required(capsys):
    with pytest.raises(SystemExit) as exited:
        main(["convert"])
    assert exited.value.code == 2 and "hf-to-megatron" in capsys.readouterr().err


@pytest.fixture()
def not_a_model(tmp_path) -> Path:
    path = tmp_path / "not_a_model"
    path.mkdir()
    (path / "README.md").write_text("no config here")
    return path


@pytest.mark.parametrize(
    "case, message",
    [
        ("missing_dir", "does not exist"),
        ("no_config", "no config.json in"),
        ("tp3", "'parallel.tp'=3 does not divide the model's num_attention_heads=4: use parallel.tp in {1, 2, 4}"),
        ("pp3", "the model's num_hidden_layers=4 is not divisible by parallel.pp x parallel.vpp = 3: use parallel.pp in {1, 2, 4}"),
        ("ep2_dense", "parallel.ep=2 needs a mixture-of-experts model (the model has no experts): set parallel.ep=1"),
        ("non_empty_output", "is not empty: choose another one or pass --overwrite"),
        ("truncated_weights", "bytes but its header describes"),
    ],
)
def test_hf_to_megatron_errors(case, message, tiny_model_dirs, not_a_model, tmp_path, capsys):
    hf_dir, output, extra = tiny_model_dirs["qwen2"], tmp_path / "out", []
    if case == "truncated_weights":  # a copy cut short: named from the header, before anything is written
        import shutil

        hf_dir = Path(shutil.copytree(hf_dir, tmp_path / "cut"))
        os.truncate(hf_dir / "model.safetensors", (hf_dir / "model.safetensors").stat().st_size - 1000)
    if case == "missing_dir":
        hf_dir = tmp_path / "missing"
    elif case == "no_config":
        hf_dir = not_a_model
    elif case == "tp3":
        extra = ["--tp", "3"]
    elif case == "pp3":
        extra = ["--pp", "3"]
    elif case == "ep2_dense":
        extra = ["--ep", "2"]
    elif case == "non_empty_output":
        output.mkdir()
        (output / "something").write_text("x")
    code = _tool("convert_hf_to_megatron")(["--hf-dir", str(hf_dir), "--output", str(output), *extra])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("megatron-dapo: error: ") and message in err, err
    if case != "non_empty_output":
        assert not output.exists()  # nothing is written before the inputs are checked


def test_megatron_to_hf_errors(tmp_path, tiny_model_dirs, capsys):
    export = _tool("convert_megatron_to_hf")
    assert export(["--megatron-dir", str(tmp_path / "missing"), "--output", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("megatron-dapo: error: Megatron checkpoint") and "does not exist" in err, err
    root = tmp_path / "root"
    (root / ".tmp-step_00000005" / "dist").mkdir(parents=True)
    assert export(["--megatron-dir", str(root), "--output", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert "no complete checkpoint" in err and ".tmp-step_00000005" in err
