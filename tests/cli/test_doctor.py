"""`megatron-dapo doctor`'s command line, in this process: exit 1 is a result (a check failed), exit 2
bad arguments (one line, the one prefix); options may follow the overrides; --help names the exit
codes. What the doctor checks: tests/doctor/test_doctor.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from megatron_dapo.cli.main import main

REPO_ROOT = Path(__file__).resolve().parents[2]


def _doctor(capsys, *argv) -> tuple[int, str]:
    code = main(["doctor", *argv])
    out = capsys.readouterr()
    return code, out.out + out.err


def test_command_exit_codes(capsys, tmp_path):
    config = str(REPO_ROOT / "configs" / "tiny_cpu.yaml")
    code, out = _doctor(capsys, config, "parallel.tp=2", "--world-size", "3", f"trainer.output_dir={tmp_path}")
    assert code == 1 and "world size 3 is not divisible" in out and "-> exit 1" in out
    code, out = _doctor(capsys, config, "--world-size", "0")
    assert code == 2 and "megatron-dapo: error: --world-size must be >= 1, got 0" in out
    code, out = _doctor(capsys, config, "--bandwidth-mib", "0")
    assert code == 2 and "--bandwidth-mib must be >= 1" in out


def test_help_names_the_exit_codes(capsys):
    with pytest.raises(SystemExit):
        main(["doctor", "--help"])
    text = capsys.readouterr().out
    assert "exit status: 0 no check failed" in text and "1 a check failed" in text and "srun" in text




def test_options_may_follow_the_overrides(capsys, tmp_path):
    """`doctor FILE key=value --world-size 3`: the option after an override still counts."""
    config = str(REPO_ROOT / "configs" / "tiny_cpu.yaml")
    code, out = _doctor(capsys, config, "parallel.tp=2", f"trainer.output_dir={tmp_path}", "--world-size", "3")
    assert code == 1 and "world size 3 is not divisible" in out


def test_a_half_set_launch_environment_is_bad_input(capsys, monkeypatch):
    for name in ("MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_STEP_ID", "SLURM_STEPID"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("RANK", "0")  # torchrun sets MASTER_ADDR / MASTER_PORT with these
    monkeypatch.setenv("WORLD_SIZE", "2")
    code, out = _doctor(capsys, str(REPO_ROOT / "configs" / "tiny_cpu.yaml"))
    assert code == 2 and "Traceback" not in out, out
    assert "megatron-dapo: error (rank 0): RANK/WORLD_SIZE are set but MASTER_ADDR, MASTER_PORT is not" in out
