"""`megatron-dapo check-sync` as a user runs it, in a subprocess from the repository root, and the
log-prob mismatch it prints (the check-sync tests of tests/rollout/sync)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def run_check_sync(*args: str, script: bool = False, timeout: float = 240) -> subprocess.CompletedProcess:
    """`python -m megatron_dapo.cli check-sync args`, or `tools/check_sync.py args` with `script`."""
    entry = [str(REPO / "tools" / "check_sync.py")] if script else ["-m", "megatron_dapo.cli", "check-sync"]
    return subprocess.run([sys.executable, *entry, *args], cwd=REPO, capture_output=True, text=True, timeout=timeout)


def printed_mismatch(stdout: str) -> tuple[float, float]:
    """The mean and the largest |diff| of the log-probs that the command printed."""
    match = re.search(r"mean \|diff\| (\S+)\s+max \|diff\| (\S+)", stdout)
    assert match, stdout
    return float(match.group(1)), float(match.group(2))
