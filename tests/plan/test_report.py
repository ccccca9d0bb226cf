"""The table `megatron-dapo plan` prints (plan/report.py)."""

from __future__ import annotations

from megatron_dapo import plan as mp
from tests.plan.conftest import OFFLOAD_ALL, plan_for


def test_offload_table_lines():
    table = mp.format_plan(plan_for(["parallel.tp=4", "parallel.sequence_parallel=true", "rollout.tp=2", "rollout.engine=vllm", *OFFLOAD_ALL]))
    assert "actor offload while generating (actor.offload_*)" in table and "params, grads, optimizer" in table
    assert "host memory, pinned (per GPU, per node)" in table
    assert "weight sync: params + kept + engine weights + bucket" in table
    # (79.1 GiB - 6 reserve - 0.94 gathered results) / 79.1 = 0.912, rounded down
    assert "largest rollout.gpu_memory_utilization: 0.91 with this offload (" in table
    assert "with the actor resident, 0.91 with params, grads and optimizer offloaded" in table
    assert "79.1 GiB per GPU (H100 80GB as reported)" in table
    assert "profiled activation peak (16384 tokens, 1024 seqs)" in table and "in the pool" in table
    assert "KV cache (pool - weights - activation peak)" in table
    assert "result buffers while generating (gathered rollouts)" in table
