"""TP shards -> engine through a shared bucket file in /dev/shm (`rollout/sync/shared_memory.py`), no gather.

Two gloo processes: the collective hand-over into an engine on rank 0, including a load that fails
on the owner and a /dev/shm that is full on another rank (every rank must raise, no file may stay
behind). The bucket file itself (one process) is tested in test_shared_memory.py, the choice of the
mode in test_dispatch.py; the real Megatron actor -> embedded / vLLM engines (bit-exact tensors,
log-prob mismatch, 100 update rounds) in test_weight_sync.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.torchrun_utils import run_torchrun_function

WORKER = Path(__file__).parent / "_handover_worker.py"


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_two_ranks_hand_their_slices_to_the_engine(dtype):
    result = run_torchrun_function(WORKER, "main", nproc=2, kwargs={"dtype": dtype}, timeout=120)
    result.check()
    owner, other = result.rank_results
    assert owner["error"] is None and other["error"] is None
    assert owner["equal"] == {"q_proj.weight": True, "o_proj.weight": True, "norm.weight": True, "embed_tokens.weight": True}
    assert owner["commits"] == 1
    assert owner["files_left"] == [] and owner["directory"] == other["directory"]
    assert owner["directory_removed"]


def test_a_failed_load_fails_every_rank_and_leaves_no_file():
    result = run_torchrun_function(WORKER, "main", nproc=2, kwargs={"fail_on": "o_proj.weight"}, timeout=120)
    result.check()
    for rank_result in result.rank_results:
        assert "could not load a weight bucket" in rank_result["error"] and "o_proj.weight" in rank_result["error"]
        assert rank_result["files_left"] == []


def test_full_shared_memory_on_one_rank_fails_every_rank_with_what_to_change():
    """ENOSPC while reserving the bucket (docker's default 64 MB /dev/shm) is an error on every rank, not a SIGBUS or a hang."""
    result = run_torchrun_function(WORKER, "main", nproc=2, kwargs={"full_shm_on_rank": 1}, timeout=120)
    result.check()
    for rank_result in result.rank_results:
        error = rank_result["error"]
        assert "could not write a weight bucket to shared memory: TP rank 1" in error, error
        assert "rollout.weight_sync_bucket_mb" in error and "--shm-size" in error and "weight_sync_mode=gather" in error
        assert rank_result["files_left"] == []
