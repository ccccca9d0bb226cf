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


def test_demo_runs_the_algorithm_core():
    out = run_cli("demo", "--steps", "2")
    assert out.returncode == 0, out.stderr[-2000:]
    records = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    assert [r["step"] for r in records] == [1, 2]
    for record in records:
        # Dynamic sampling filled exactly train_batch_size x n sequences from informative groups.
        assert record["train/num_sequences"] == 8 * 8
        assert record["num_groups_kept"] >= 8
    assert "SCRIPTED" in out.stdout
