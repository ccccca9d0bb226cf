"""Every command, in this process: its --help exits 0 and names its options, and bad input ends in the
one prefix and exit code 2, before anything expensive starts."""

from __future__ import annotations

from pathlib import Path

import pytest

from megatron_dapo.cli.main import SUBCOMMANDS, main

REPO = Path(__file__).resolve().parents[2]
CONFIG = str(REPO / "configs" / "tiny_cpu.yaml")

HELP_MENTIONS = {
    "demo": "--workspace",
    "train": "--resume",
    "sft": "sft",
    "prepare-data": "--val-size",
    "plan": "--nodes",
    "doctor": "exit status",
    "config": "--world-size",
    "convert": "hf-to-megatron",
    "check-sync": "--tolerance",
    "smoke": "one table",
}


@pytest.mark.parametrize("command", sorted(SUBCOMMANDS))
def test_every_command_has_help(command, capsys):
    with pytest.raises(SystemExit) as exited:
        main([command, "--help"])
    assert exited.value.code == 0
    assert HELP_MENTIONS[command] in capsys.readouterr().out


@pytest.mark.parametrize("direction", ["hf-to-megatron", "megatron-to-hf"])
def test_convert_directions_have_help(direction, capsys):
    with pytest.raises(SystemExit) as exited:
        main(["convert", direction, "--help"])
    assert exited.value.code == 0 and "--output" in capsys.readouterr().out


def test_no_command_prints_the_list_and_exits_2(capsys):
    assert main([]) == 2
    out = capsys.readouterr().out
    assert all(command in out for command in SUBCOMMANDS)


def _bad_input_cases(tmp: Path) -> dict[str, tuple[list[str], str]]:
    not_a_model = tmp / "not_a_model"
    not_a_model.mkdir(exist_ok=True)
    return {
        "demo": (["--workspace", str(tmp / "ws"), "rollout.nn=4"], "Did you mean 'rollout.n'"),
        "train": (["trainer.total_steps=1"], "no config file"),
        "sft": ([CONFIG, "sft.nope=1"], "sft.nope"),
        "prepare-data": (["--input", str(tmp / "none.jsonl"), "--output", str(tmp / "o.parquet")], "none.jsonl: input file not found"),
        "doctor": ([CONFIG, "--world-size", "0"], "--world-size must be >= 1"),
        "config": ([CONFIG, "rollout.nn=4"], "Did you mean 'rollout.n'"),
        "convert": (["hf-to-megatron", "--hf-dir", str(tmp / "missing"), "--output", str(tmp / "o")], "does not exist"),
        "check-sync": (["--hf-dir", str(not_a_model)], "is not an HF model directory (no config.json)"),
    }


@pytest.mark.parametrize("command", ["demo", "train", "sft", "prepare-data", "doctor", "config", "convert", "check-sync"])
def test_bad_input_is_one_line_and_exit_2(command, tmp_path, capsys, one_process):
    argv, message = _bad_input_cases(tmp_path)[command]
    assert main([command, *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("megatron-dapo: error: ") and message in err and "Traceback" not in err, err
    assert not (tmp_path / "ws").exists()  # the demo stops before it builds its workspace

