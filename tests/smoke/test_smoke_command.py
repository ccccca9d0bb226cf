"""`megatron-dapo smoke` end to end on this CPU machine, as CI runs it: every step at CPU sizes with
the real engines (vLLM's and SGLang's CPU builds), one table, exit code 0. The same command sized for
a GPU is what a lent GPU runs first (docs/PERF.md).

Two of its steps are also the suite's only run of what they check (each command costs an engine
start, so it runs once): the log of "check-sync dense, SGLang" (SGLang at TP=1 on the demo's tied
Qwen2) and of "check-sync MoE, vllm, EP=2" (vLLM fed by an expert-parallel actor, every expert
gathered) are read for what tests/rollout/sync/test_sglang_check_sync.py and test_check_sync_moe.py
assert of their other runs."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from megatron_dapo.data.demo import DEMO_MOE_MODEL
from tests.support.check_sync_runs import printed_mismatch

ROOT = Path(__file__).resolve().parents[2]


def _equal_counts(log: str) -> tuple[int, int]:
    match = re.search(r"(\d+) of (\d+) tensors equal", log)
    assert match, log[-3000:]
    return int(match.group(1)), int(match.group(2))


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
    logs = {path.name: path.read_text() for path in (tmp_path / "logs").glob("*.log")}
    assert len(logs) == 6

    sglang = logs["03-check-sync-dense.log"]
    assert "engine: sglang float32 on rank 0" in sglang
    equal, total = _equal_counts(sglang)
    stale = re.search(r"before the sync, (\d+) of (\d+) engine tensors differ from the actor", sglang)
    # The demo model's update leaves a few tensors as they were (the check says so); the rest were stale.
    assert equal == total > 40 and stale and int(stale.group(2)) == total and int(stale.group(1)) > total // 2, sglang[-3000:]
    mean, largest = printed_mismatch(sglang)
    assert 0 <= mean <= largest < 1e-4

    moe = logs["04-check-sync-MoE.log"]
    assert "starting 2 processes (tp=1 x pp=1 x ep=2)" in moe and " ep=2 dp=2 " in moe
    assert "(gather)" in moe  # auto at EP > 1: each rank holds only its own experts
    equal, total = _equal_counts(moe)
    assert equal == total and "PASS" in moe
    experts = re.findall(r"^   OK    (\S+\.mlp\.experts\.\d+\.\S+)", moe, flags=re.M)
    layers, per_layer = DEMO_MOE_MODEL["num_hidden_layers"], DEMO_MOE_MODEL["num_experts"]
    assert len(experts) == layers * per_layer * 3  # gate, up and down of every expert, both EP ranks' own
