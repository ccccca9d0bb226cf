"""tools/plan_memory.py runs `megatron-dapo plan` from a checkout, without installing."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_tools_script_runs_from_a_checkout():
    result = subprocess.run(
        [sys.executable, str(REPO / "tools" / "plan_memory.py"), "--model", "qwen2.5-0.5b", "--gpus-per-node", "2"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
    )
    assert result.returncode == 0, result.stderr
    assert "memory plan: qwen2.5-0.5b" in result.stdout
    assert int(result.stdout.split("largest trainer.max_tokens_per_micro_batch: ")[1].split()[0]) > 22528
