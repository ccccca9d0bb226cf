"""init_distributed from a SLURM-style launch (two plain processes with SLURM_* variables, no
torchrun), Megatron groups, re-initialisation and teardown. The torchrun and single-process launch
paths are exercised by tests/model/test_megatron_vs_hf.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.torchrun_utils import run_slurm_function

WORKER = Path(__file__).parent / "_setup_worker.py"


@pytest.fixture(scope="module")
def slurm_results():
    result = run_slurm_function(WORKER, "init_from_slurm", ntasks=2, nodelist="localhost,otherhost", timeout=180).check()
    assert all(r is not None for r in result.rank_results), result.tail()
    return result.rank_results


def test_ranks_come_from_slurm_variables(slurm_results):
    assert [r["rank"] for r in slurm_results] == [0, 1]
    for r in slurm_results:
        assert r["source"] == "slurm" and r["world_size"] == 2
        assert r["master_addr"] == "localhost"  # the first host of SLURM_JOB_NODELIST
        assert r["backend"] == "gloo"


def test_tensor_parallel_group_works(slurm_results):
    assert [r["tp_rank"] for r in slurm_results] == [0, 1]
    assert [r["tp_sum"] for r in slurm_results] == [3.0, 3.0]
    assert "TP groups: [0, 1]" in slurm_results[0]["describe"]


def test_reinitialise_and_teardown(slurm_results):
    for r in slurm_results:
        assert r["after_keep"] == {"dist": True, "megatron": False}
        assert "call teardown() first" in r["double_init"]
        assert r["after_teardown"] == {"dist": False, "megatron": False}
    assert [r["pp_rank"] for r in slurm_results] == [0, 1]
    # Megatron's seeding convention: seed + 100 * pipeline rank.
    assert [r["seeded"] for r in slurm_results] == [7, 107]


def test_rank_0_hosting_the_store_leaves_after_the_others():
    """Under srun rank 0's process hosts the job's store; a rank that still uses it after rank 0 is
    done (an engine owner counting itself done after its engine's shut-down) needs rank 0 to wait:
    `teardown(together=True)` makes every rank check out and rank 0 leave last."""
    late_s = 2.0
    result = run_slurm_function(WORKER, "leave_together_after_a_late_store_use", ntasks=2, kwargs={"late_s": late_s}, timeout=180)
    result.check()
    by_rank = {r["rank"]: r for r in result.rank_results}
    assert by_rank[0]["left_after_s"] >= late_s, by_rank
