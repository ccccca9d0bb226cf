"""`megatron-dapo smoke` end to end on this CPU machine, as CI runs it: every step at CPU sizes with
the real engines (vLLM's and SGLang's CPU builds), one table, exit code 0. The same command sized for
a GPU is what a lent GPU runs first (docs/PERF.md)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_smoke_runs_every_step_and_prints_one_table(tmp_path, require_vllm, require_sglang):
    out = subprocess.run(
        [sys.executable, "-m", "megatron_dapo.cli", "smoke", "--workspace", str(tmp_path)],
        cwd=ROOT, capture_output=True, text=True, timeout=3000,
    )  # fmt: skip
    text = out.stdout + out.stderr
    assert out.returncode == 0, text[-4000:]
    assert "CPU sizes (no CUDA)" in out.stdout
    table = out.stdout[out.stdout.index("\nstep ") :]
    rows = {name: status for name, status in re.findall(r"^(\S.*?)\s{2,}(PASS|FAIL|SKIP)\s", table, flags=re.M)}
    assert rows == {
        "doctor": "PASS",
        "check-sync dense, vLLM": "PASS",
        "check-sync dense, SGLang": "PASS",
        "check-sync MoE, vllm, EP=2": "PASS",
        "trainer step, MoE, r3 routing from embedded": "PASS",
        "weight push, cpu-shaped": "PASS",
    }, table
    assert "6 passed, 0 failed, 0 skipped" in table
    assert re.search(r"weight push, cpu-shaped\s+PASS\s+\d+\s+0\.\d+ GB float32 on cpu: sync [\d.]+ GB/s, device copy [\d.]+ GB/s", table)
    assert len(list((tmp_path / "logs").glob("*.log"))) == 6
