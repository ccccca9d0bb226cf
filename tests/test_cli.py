"""The console entry point: help, config command, and the demo (the README's main command today)."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run_cli(*args, timeout=300):
    return subprocess.run(
        [sys.executable, "-m", "megatron_dapo.cli", *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout
    )


def test_help_lists_commands():
    out = run_cli("--help")
    assert out.returncode == 0
    assert "demo" in out.stdout and "config" in out.stdout


def test_config_command_prints_resolved_config_or_error():
    out = run_cli("config", "configs/tiny_cpu.yaml", "rollout.n=4")
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["rollout"]["n"] == 4
    bad = run_cli("config", "configs/tiny_cpu.yaml", "rollout.nn=4")
    assert bad.returncode == 1
    assert "Did you mean 'rollout.n'" in bad.stderr


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
