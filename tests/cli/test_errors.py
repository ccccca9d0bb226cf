"""The one error handler every command returns through (`cli.main.run_command`, `megatron_dapo.errors`):
bad input -> "megatron-dapo: error: ..." and exit 2, a reason to stop -> the same prefix and exit 1,
a rank suffix in a job of several ranks, and a bug keeps its traceback. The library's error classes
carry their kind, so no command keeps its own list of what to catch."""

from __future__ import annotations

import argparse
import errno

import pytest

from megatron_dapo.cli.main import rank_suffix, run_command
from megatron_dapo.errors import EXIT_FAILURE, EXIT_USAGE, InputError, StopError, describe, exit_code

def _raising(error: BaseException):
    def run(args: argparse.Namespace) -> int:
        raise error

    return run


def test_input_error_is_one_line_and_exit_2(one_process, capsys):
    assert run_command(_raising(InputError("'rollout.nn' is not a key")), argparse.Namespace()) == EXIT_USAGE == 2
    captured = capsys.readouterr()
    assert captured.err == "megatron-dapo: error: 'rollout.nn' is not a key\n" and captured.out == ""


def test_stop_error_is_one_line_and_exit_1(one_process, capsys):
    assert run_command(_raising(StopError("dynamic sampling ran dry")), argparse.Namespace()) == EXIT_FAILURE == 1
    assert capsys.readouterr().err == "megatron-dapo: error: dynamic sampling ran dry\n"


def test_a_missing_file_is_bad_input(one_process, capsys):
    assert run_command(_raising(FileNotFoundError("HF model directory /x does not exist")), argparse.Namespace()) == 2
    assert capsys.readouterr().err == "megatron-dapo: error: HF model directory /x does not exist\n"


def test_a_stop_error_wins_over_a_missing_file(one_process, capsys):
    """A damaged checkpoint is both a FileNotFoundError and a reason to stop: exit 1."""

    class Damaged(StopError, FileNotFoundError):
        pass

    assert run_command(_raising(Damaged("no intact checkpoint in runs/x")), argparse.Namespace()) == 1
    assert "megatron-dapo: error: no intact checkpoint in runs/x" in capsys.readouterr().err


def test_several_ranks_name_the_rank(one_process, capsys):
    one_process.setenv("RANK", "3")
    one_process.setenv("WORLD_SIZE", "4")
    assert rank_suffix() == " (rank 3)"
    assert run_command(_raising(InputError("bad")), argparse.Namespace()) == 2
    assert capsys.readouterr().err == "megatron-dapo: error (rank 3): bad\n"
    one_process.setenv("WORLD_SIZE", "1")  # a world of one: no suffix
    assert rank_suffix() == ""
    for name in ("RANK", "WORLD_SIZE"):
        one_process.delenv(name)
    one_process.setenv("SLURM_PROCID", "5")
    one_process.setenv("SLURM_NTASKS", "8")
    assert rank_suffix() == " (rank 5)"


def test_a_bug_keeps_its_traceback(one_process, capsys):
    with pytest.raises(KeyError, match="'lost'"):
        run_command(_raising(KeyError("lost")), argparse.Namespace())
    with pytest.raises(ValueError):  # a plain ValueError is not bad input: it carries no kind
        run_command(_raising(ValueError("internal")), argparse.Namespace())
    assert capsys.readouterr().err == ""


def test_a_result_is_returned_as_is(one_process):
    assert run_command(lambda args: 1, argparse.Namespace()) == 1  # e.g. doctor: a check failed
    assert run_command(lambda args: None, argparse.Namespace()) == 0


def test_describe_an_os_error_without_errno_noise():
    assert describe(OSError(errno.ENOSPC, "no space left on the disk of trainer.output_dir=/r")) == (
        "no space left on the disk of trainer.output_dir=/r"
    )
    assert describe(PermissionError(errno.EACCES, "Permission denied", "/r/x")) == "Permission denied: /r/x"
    assert exit_code(KeyboardInterrupt()) is None


def _library_errors() -> dict[type, int]:
    from megatron_dapo.algorithm.sampling import DynamicSamplingExhausted
    from megatron_dapo.checkpoint.conversion import ConversionError, ConversionWriteError
    from megatron_dapo.checkpoint.errors import CheckpointCorruptError, CheckpointError, NoIntactCheckpointError
    from megatron_dapo.config import ConfigError
    from megatron_dapo.data.dataset import DatasetError
    from megatron_dapo.doctor.preflight import LaunchEnvironmentError
    from megatron_dapo.compat.versions import IncompatibleVersionError
    from megatron_dapo.model.hf_config import ModelFileError, UnsupportedModelError
    from megatron_dapo.distributed.placement import PlacementError
    from megatron_dapo.trainer.check_sync import CheckSyncError
    from megatron_dapo.checkpoint.disk_full import DiskFullError

    return {
        ConfigError: 2, DatasetError: 2, UnsupportedModelError: 2, ModelFileError: 2, PlacementError: 2,
        ConversionError: 2, CheckSyncError: 2, LaunchEnvironmentError: 2,
        DynamicSamplingExhausted: 1, DiskFullError: 1, CheckpointError: 1, CheckpointCorruptError: 1,
        NoIntactCheckpointError: 1, IncompatibleVersionError: 1, ConversionWriteError: 1,
    }  # fmt: skip


def test_library_errors_carry_their_kind():
    """Each keeps the built-in base its callers catch (ValueError, OSError, RuntimeError)."""
    for cls, code in _library_errors().items():
        kind = StopError if code == EXIT_FAILURE else InputError
        assert issubclass(cls, kind) and not (kind is InputError and issubclass(cls, StopError)), cls.__name__
    from megatron_dapo.checkpoint.errors import NoIntactCheckpointError
    from megatron_dapo.config import ConfigError
    from megatron_dapo.checkpoint.disk_full import DiskFullError

    assert exit_code(ConfigError("x")) == 2 and isinstance(ConfigError("x"), ValueError)
    assert exit_code(DiskFullError(errno.ENOSPC, "no space")) == 1 and isinstance(DiskFullError(errno.ENOSPC, "x"), OSError)
    assert exit_code(NoIntactCheckpointError("none intact")) == 1  # also a FileNotFoundError: the stop wins


def test_demo_waiting_for_rank_0_in_vain_is_a_stop_error(tmp_path):
    """Ranks > 0 wait for rank 0's workspace; in vain, the user gets one line, not a TimeoutError traceback."""
    from megatron_dapo import errors
    from megatron_dapo.cli import demo

    with pytest.raises(errors.StopError, match="rank 0 did not finish preparing") as caught:
        demo._wait_for(tmp_path / "workspace" / "ready.json", timeout_s=0.0)
    assert errors.exit_code(caught.value) == errors.EXIT_FAILURE
