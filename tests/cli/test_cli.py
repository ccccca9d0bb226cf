"""The console entry point as a shell runs it: help (and what it imports), the config command, the
train command's arguments, and the demo (the README's main command)."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def run_cli(*args, timeout=300):
    return subprocess.run(
        [sys.executable, "-m", "megatron_dapo.cli", *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout
    )


def test_help_lists_commands():
    out = run_cli("--help")
    assert out.returncode == 0
    assert "demo" in out.stdout and "config" in out.stdout


def test_help_imports_no_torch():
    """cli/ is the one place with lazy imports: building every command's parser (what `--help` does)
    loads no library module that imports torch."""
    probe = (
        "import sys\n"
        "from megatron_dapo.cli.main import SUBCOMMANDS, build_parser\n"
        "build_parser()\n"
        "assert all(module in sys.modules for module, _ in SUBCOMMANDS.values())\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'numpy', 'transformers', 'megatron', 'pyarrow')))\n"
    )
    out = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]", out.stdout[-2000:]


def test_train_refused_by_the_pre_flight_imports_no_torch(tmp_path):
    """A config or model directory the pre-flight refuses costs a fraction of a second: `train` checks
    before it imports the trainer (torch, Megatron, transformers: ~10 s here)."""
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text('{"architectures": [')
    probe = (
        "import sys\n"
        "from megatron_dapo.cli.main import main\n"
        f"code = main(['train', 'configs/tiny_cpu.yaml', 'model.hf_dir={model}', 'trainer.output_dir={tmp_path / 'run'}'])\n"
        "print(code, sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'transformers', 'megatron')))\n"
    )
    out = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert "config.json is not valid JSON" in out.stderr, out.stderr[-2000:]
    assert out.stdout.strip() == "2 []", out.stdout[-2000:]


_EXIT_PROBE = """
import atexit, sys, threading, time
import torch  # a command that loaded the libraries: the fast exit applies
from megatron_dapo.cli.main import exit_without_teardown

class SaysWhenCollected:
    def __del__(self):
        print("torn down", flush=True)

kept = SaysWhenCollected()  # collected only by the interpreter's module teardown
atexit.register(lambda: print("exit handler", flush=True))
threading.Thread(target=lambda: (time.sleep(0.5), print("thread done", flush=True))).start()
from concurrent.futures import ThreadPoolExecutor
pool = ThreadPoolExecutor(1)  # kept: its idle worker ends only through threading's exit hooks
pool.submit(lambda: None).result()
print("unflushed output", end="")
exit_without_teardown(3)
"""


def test_a_finished_command_exits_without_the_interpreters_teardown():
    """After a command returns, the process leaves as the interpreter would (non-daemon threads
    joined, exit handlers run, output flushed, the command's exit code), less the module teardown that
    costs a rank ~2.5 s of CPU: an object only that teardown collects is never collected."""
    out = subprocess.run([sys.executable, "-c", _EXIT_PROBE], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 3, out.stderr[-2000:]
    assert out.stdout == "unflushed outputthread done\nexit handler\n", out.stdout
    # Control: the same program ending with sys.exit is torn down.
    normal = subprocess.run([sys.executable, "-c", _EXIT_PROBE.replace("exit_without_teardown(3)", "sys.exit(3)")],
                            cwd=ROOT, capture_output=True, text=True, timeout=120)  # fmt: skip
    assert normal.returncode == 3 and normal.stdout.endswith("exit handler\ntorn down\n"), normal.stdout


def test_config_command_prints_resolved_config_or_error():
    out = run_cli("config", "configs/tiny_cpu.yaml", "rollout.n=4")
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["rollout"]["n"] == 4
    bad = run_cli("config", "configs/tiny_cpu.yaml", "rollout.nn=4")
    assert bad.returncode == 2
    assert "Did you mean 'rollout.n'" in bad.stderr


def test_train_takes_the_config_positionally_or_with_the_flag():
    import argparse

    import pytest

    from megatron_dapo.config import ConfigError
    from megatron_dapo.cli.job import resolve_config_argument
    from megatron_dapo.cli.train import add_arguments

    parser = argparse.ArgumentParser()
    add_arguments(parser)

    def resolved(*argv):
        args = parser.parse_args(list(argv))
        resolve_config_argument(args)
        return args.config, args.overrides

    assert resolved("c.yaml", "a.b=1") == ("c.yaml", ["a.b=1"])
    assert resolved("--config", "c.yaml", "a.b=1") == ("c.yaml", ["a.b=1"])
    assert resolved("a.b=1", "--config", "c.yaml") == ("c.yaml", ["a.b=1"])
    for argv, message in [(("a.b=1",), "no config file"), (("--config", "c.yaml", "d.yaml"), "two config files"),
                          (("c.yaml", "a.b=1", "oops"), "'oops' is not a KEY=VALUE")]:  # fmt: skip
        with pytest.raises(ConfigError, match=message):
            resolved(*argv)


def test_overrides_may_follow_options():
    """`config FILE --world-size 2 parallel.tp=2`, `train FILE --resume k=v`: overrides after an option count."""
    out = run_cli("config", "configs/tiny_cpu.yaml", "--world-size", "2", "parallel.tp=2", "rollout.n=4")
    assert out.returncode == 0, out.stderr
    resolved = json.loads(out.stdout)
    assert (resolved["parallel"]["tp"], resolved["rollout"]["n"]) == (2, 4)
    trained = run_cli("train", "configs/tiny_cpu.yaml", "--resume", "model.hf_dir=/nonexistent/model")
    assert trained.returncode == 2 and "'model.hf_dir'=/nonexistent/model" in trained.stderr, trained.stderr
    stray = run_cli("train", "configs/tiny_cpu.yaml", "--resume", "--bogus", "a.b=1")
    assert stray.returncode == 2 and "unrecognized arguments: --bogus" in stray.stderr


def test_train_without_a_config_says_how_to_give_one():
    out = run_cli("train", "trainer.total_steps=1")
    assert out.returncode == 2
    assert "no config file" in out.stderr and "Traceback" not in out.stderr


def test_demo_runs_sft_then_dapo(tmp_path):
    """The main job, shortened: workspace, 3 SFT steps, 2 DAPO steps with validation before and after."""
    out = run_cli("demo", "--workspace", str(tmp_path / "ws"), "sft.total_steps=3", "sft.batch_size=16",
                  "trainer.total_steps=2", "trainer.eval_every=2", "rollout.val_n=2", "trainer.loggers=[console,jsonl]",
                  "algorithm.filter_groups.enable=false", "trainer.gen_batch_size=8", "trainer.train_batch_size=8")  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    assert "validation accuracy (avg@2):" in out.stdout
    dapo = tmp_path / "ws" / "dapo"
    steps = [json.loads(line)["step"] for line in (dapo / "metrics.jsonl").read_text().splitlines()]
    assert steps == [0, 1, 2]
    assert (dapo / "plot.png").stat().st_size > 10_000
    assert (tmp_path / "ws" / "sft" / "checkpoints" / "latest").exists()
