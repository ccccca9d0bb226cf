"""The dispatcher, one process: the choice of `rollout.weight_sync_mode` ("auto" included), the
sync's statistics and its refusal of engines that cannot take shards. Syncs through a real
Megatron actor run in test_weight_sync.py (every mode) and test_shard_handover.py."""

from __future__ import annotations

import pytest

from megatron_dapo.distributed.placement import choose_sync_mode
from megatron_dapo.rollout.sync.dispatch import SyncStats, sync_weights


def test_sync_stats_throughput():
    stats = SyncStats(bytes=2_000_000_000, seconds=4.0, load_seconds=1.0, num_tensors=3, num_buckets=2, peak_bucket_bytes=10)
    assert stats.gb_per_s == 0.5
    assert stats.as_metrics()["weight_sync/num_buckets"] == 2.0


def test_tp_shard_sync_needs_engines_that_take_shards():
    with pytest.raises(TypeError, match="load_weight_shards"):
        sync_weights([], None, object(), tp_shards=True)


def test_sync_mode_choice():
    one, two = ["node1", "node1"], ["node1", "node2"]
    assert choose_sync_mode("auto", 2, one, "vllm", "cuda") == "shared_memory"
    assert choose_sync_mode("auto", 2, one, "embedded", "cpu") == "shared_memory"
    assert choose_sync_mode("auto", 2, one, "embedded", "cuda") == "gather"  # NCCL gather lands on the GPU
    assert choose_sync_mode("auto", 1, ["node1"], "vllm", "cpu") == "gather"  # nothing to gather at TP=1
    assert choose_sync_mode("auto", 2, two, "vllm", "cuda") == "gather"
    assert choose_sync_mode("gather", 2, one, "vllm", "cpu") == "gather"
    assert choose_sync_mode("shared_memory", 1, ["node1"], "embedded", "cpu") == "shared_memory"
    with pytest.raises(ValueError, match="one node"):
        choose_sync_mode("shared_memory", 2, two, "vllm", "cuda")
    with pytest.raises(ValueError, match="weight_sync_mode"):
        choose_sync_mode("nccl", 2, one, "vllm", "cuda")
