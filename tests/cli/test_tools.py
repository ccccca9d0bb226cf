"""tools/*.py: thin entry points to the commands, run as plain scripts from any directory of a
checkout that is not installed (no PYTHONPATH, another working directory)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]

# script -> the `megatron-dapo` command it is, and a line of that command's --help
TOOLS = {
    "check_sync.py": ("megatron-dapo check-sync", "bit for bit"),
    "convert_hf_to_megatron.py": ("megatron-dapo convert hf-to-megatron", "ANY tensor"),
    "convert_megatron_to_hf.py": ("megatron-dapo convert megatron-to-hf", "latest complete"),
    "plan_memory.py": ("megatron-dapo plan", "--nodes"),
    "prepare_data.py": ("megatron-dapo prepare-data", "reward_model"),
}


def test_every_tool_is_listed():
    assert sorted(p.name for p in (REPO_ROOT / "tools").glob("*.py")) == sorted(TOOLS)


@pytest.mark.parametrize("script", sorted(TOOLS))
def test_tool_help_is_its_commands(script, tmp_path):
    command, text = TOOLS[script]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    result = subprocess.run([sys.executable, str(REPO_ROOT / "tools" / script), "--help"], capture_output=True, text=True,
                            cwd=tmp_path, env=env, timeout=120)  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith(f"usage: {command} ") and text in result.stdout, result.stdout[:500]


def test_prepare_data_help_explains_the_schema():
    result = subprocess.run(
        [sys.executable, str(REPO_ROOT / "tools" / "prepare_data.py"), "--help"], capture_output=True, text=True, cwd="/"
    )
    assert result.returncode == 0, result.stderr
    for needle in ("reward_model", "ground_truth", "data_source", "extra_info", "--val-size", "Answer: $Answer"):
        assert needle in result.stdout


def test_convert_tools_help_explains_both_directions():
    forward = subprocess.run([sys.executable, str(REPO_ROOT / "tools" / "convert_hf_to_megatron.py"), "--help"],
                             capture_output=True, text=True, cwd=REPO_ROOT)  # fmt: skip
    assert forward.returncode == 0
    for text in ("--hf-dir", "--tp", "--pp", "--vpp", "--overwrite", "--verify-logits", "ANY tensor"):
        assert text in forward.stdout
    backward = subprocess.run([sys.executable, str(REPO_ROOT / "tools" / "convert_megatron_to_hf.py"), "--help"],
                              capture_output=True, text=True, cwd=REPO_ROOT)  # fmt: skip
    assert backward.returncode == 0
    for text in ("--megatron-dir", "--max-shard-size", "--hf-config-dir", "latest complete"):
        assert text in backward.stdout
