"""CP=2 under torchrun (gloo): gathered-K/V attention and per-token gathers equal one process (values and grads)."""

from __future__ import annotations

from pathlib import Path

from tests.support.torchrun_utils import run_torchrun_function


def test_cp2_attention_and_gathers_equal_single_process():
    result = run_torchrun_function(Path(__file__).parent / "_cp_worker.py", "attention_and_gathers", nproc=2, timeout=300)
    result.check()
    for per_rank in result.rank_results:
        assert per_rank["tokens_full_order"]
        for key in ("out", "dq", "dk", "dv", "token_grad"):
            assert per_rank[key] < 1e-12, (key, per_rank)


def test_cp2_sdpa_core_attention_equals_cp1():
    result = run_torchrun_function(Path(__file__).parent / "_cp_worker.py", "sdpa_module_cp", nproc=2, timeout=300)
    result.check()
    for per_rank in result.rank_results:
        for key in ("out", "dq", "dk", "dv"):
            assert per_rank[key] < 1e-12, (key, per_rank)
