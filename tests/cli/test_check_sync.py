"""`megatron-dapo check-sync`'s command line, in this process: the help explains the check and the
exit codes, bad arguments are one line and exit code 2 before any process starts, and the options
the command re-executes itself with under torch.distributed.run reproduce the ones given. The
check itself, end to end: tests/rollout/sync/test_check_sync.py."""

from __future__ import annotations

import argparse

import pytest

from megatron_dapo.cli.check_sync import add_arguments, launched_by_a_launcher, processes, to_argv
from megatron_dapo.cli.main import main


def test_help_explains_the_command(capsys):
    with pytest.raises(SystemExit) as exited:
        main(["check-sync", "--help"])
    out = capsys.readouterr().out
    assert exited.value.code == 0
    for text in ("bit for bit", "--tolerance", "--engine {embedded,vllm,sglang}", "Exit code", "torch.distributed.run"):
        assert text in out, text
    with pytest.raises(SystemExit):
        main(["--help"])
    assert "check-sync" in capsys.readouterr().out


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--tp", "0"], "--tp must be >= 1"),
        (["--num-prompts", "0"], "--num-prompts must be >= 1"),
        (["--placement", "spmd"], "--placement spmd needs --engine vllm"),
        (["--ep", "0"], "--ep must be >= 1"),
        (["--ep", "2"], "parallel.ep=2 needs a mixture-of-experts model"),  # config.json names no experts
        (["--ep", "3", "--moe"], "parallel.ep=3 does not divide the model's num_experts=4"),
        (["--ep", "2", "--moe", "--sync-mode", "shared_memory"], "at parallel.ep=2 a rank holds only its own experts"),
        (["--ep", "2", "--moe", "--engine", "vllm", "--placement", "spmd", "--sync-mode", "tp_shards"], "use auto or gather"),
        (["--rollout-ranks", "2"], "--rollout-ranks and --rollout-tp are for --placement separate"),
        (["--placement", "separate", "--rollout-ranks", "3", "--rollout-tp", "2"], "--rollout-ranks 3 is not a whole number of engines"),
        (["--placement", "separate", "--rollout-ranks", "0"], "--rollout-ranks must be >= 1"),
        (["--placement", "separate", "--sync-mode", "shared_memory"], "with rollout.placement=separate the weights travel"),
        ([], "is not an HF model directory (no config.json)"),
    ],
)
def test_bad_arguments_are_one_line_and_exit_2(argv, message, tmp_path, capsys, monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "SLURM_PROCID", "SLURM_NTASKS"):
        monkeypatch.delenv(name, raising=False)
    hf_dir = tmp_path / "model"
    hf_dir.mkdir()
    if argv:
        moe = "--moe" in argv  # a config.json with 4 experts
        (hf_dir / "config.json").write_text('{"num_experts": 4}' if moe else "{}")  # only the last case lacks it
        argv = [arg for arg in argv if arg != "--moe"]
    assert main(["check-sync", "--hf-dir", str(hf_dir), *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("megatron-dapo: error: ") and message in err and "starting" not in err, err
    assert "check-sync:" not in err  # the prefix names the program; the message does not repeat the command


def test_the_relaunched_processes_get_the_same_options():
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    given = ["--hf-dir", "m", "--engine", "vllm", "--tp", "2", "--placement", "spmd", "--only-failures", "--tolerance", "0.5"]
    args = parser.parse_args(given)
    args.command, args._module = "check-sync", "megatron_dapo.cli.check_sync"  # set by cli.main: not options
    again = parser.parse_args(to_argv(args))
    assert vars(again) == {k: v for k, v in vars(args).items() if k not in ("command", "_module")}


def test_launched_by_a_launcher():
    assert launched_by_a_launcher({"RANK": "0", "WORLD_SIZE": "2"})
    assert launched_by_a_launcher({"SLURM_STEP_ID": "0", "SLURM_PROCID": "0", "SLURM_NTASKS": "2"})
    assert not launched_by_a_launcher({"SLURM_PROCID": "0", "SLURM_NTASKS": "2"})  # a bare sbatch shell
    assert not launched_by_a_launcher({})


def test_the_plain_command_starts_the_engines_ranks_after_the_actors():
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert processes(parser.parse_args(["--hf-dir", "m", "--tp", "2", "--pp", "2"])) == 4
    assert processes(parser.parse_args(["--hf-dir", "m", "--tp", "2", "--placement", "separate"])) == 3
    separate = parser.parse_args(["--hf-dir", "m", "--tp", "2", "--placement", "separate", "--rollout-ranks", "4", "--rollout-tp", "2"])
    assert processes(separate) == 6
    from megatron_dapo.trainer.check_sync import check_layout, engine_tp

    layout = check_layout(separate).resolve(processes(separate))
    assert (layout.world_size, layout.rollout_engines, engine_tp(separate)) == (2, 2, 2)
    assert layout.engine_leaders() == [2, 4]
