"""The dispatcher, one process: the choice of `rollout.weight_sync_mode` ("auto" included), the
sync's statistics and its refusal of engines that cannot take shards. Syncs through a real
Megatron actor run in test_weight_sync.py (every mode) and test_shard_handover.py."""

from __future__ import annotations

import pytest

from megatron_dapo.distributed.placement import choose_sync_mode
from megatron_dapo.rollout.sync.dispatch import FullTensors, SyncStats, sync_weights
from megatron_dapo.rollout.sync.shared_memory import SharedMemoryShards
from megatron_dapo.rollout.sync.tp_shards import InProcessShards


def test_sync_stats_throughput():
    stats = SyncStats(bytes=2_000_000_000, seconds=4.0, load_seconds=1.0, num_tensors=3, num_buckets=2, peak_bucket_bytes=10)
    assert stats.gb_per_s == 0.5
    assert stats.as_metrics()["weight_sync/num_buckets"] == 2.0


def test_shard_transports_need_targets_that_take_shards():
    with pytest.raises(TypeError, match="SharedMemoryShards needs a target with load_weight_shards"):
        SharedMemoryShards(object())
    with pytest.raises(TypeError, match="InProcessShards needs a target with load_weight_shards"):
        InProcessShards(object())


class _Recorder:
    """An engine that records what reaches it."""

    def __init__(self):
        self.calls = []

    def load_weights(self, bucket):
        self.calls.append(("load_weights", [name for name, _ in bucket]))

    def load_weight_shards(self, bucket):
        self.calls.append(("load_weight_shards", len(bucket)))

    def commit_weights(self):
        self.calls.append(("commit",))


def test_each_mode_is_one_transport_behind_one_interface(monkeypatch):
    """`sync_weights` only talks to the `WeightTransport` interface: the full-tensor transport streams
    `gather.iter_full_tensors` into `load_weights`, the shard transports `shards.iter_engine_shards`
    into `load_weight_shards`, each bucketed and committed once; a rank without a target delivers nothing."""
    import torch

    from megatron_dapo.rollout.sync import gather, shards

    tensors = [(f"w{i}", torch.ones(256)) for i in range(4)]  # 1 KiB each
    monkeypatch.setattr(gather, "iter_full_tensors", lambda models, hf_config, bucket_mb: iter(tensors))
    monkeypatch.setattr(shards, "iter_engine_shards", lambda models, hf_config: iter(tensors[:3]))
    monkeypatch.setattr(shards, "full_nbytes", lambda item: 2048)  # slices count by their full tensor
    bucket_mb = 2048 / 2**20  # 2 KiB buckets: two 1 KiB tensors each

    engine = _Recorder()
    stats = sync_weights([], None, engine, bucket_mb=bucket_mb)  # an engine means FullTensors(engine)
    assert engine.calls == [("load_weights", ["w0", "w1"]), ("load_weights", ["w2", "w3"]), ("commit",)]
    assert (stats.num_tensors, stats.num_buckets, stats.bytes, stats.peak_bucket_bytes) == (4, 2, 4096, 2048)
    assert FullTensors(engine).mode == "gather"

    target = _Recorder()
    stats = sync_weights([], None, InProcessShards(target), bucket_mb=bucket_mb)
    assert target.calls == [("load_weight_shards", 1)] * 3 + [("commit",)]  # 2 KiB counted per slice: one per bucket
    assert (stats.num_tensors, stats.num_buckets, stats.bytes) == (3, 3, 3072)

    nobody = SharedMemoryShards(None)  # a later pipeline stage: streams for the collectives, keeps nothing
    stats = sync_weights([], None, nobody, bucket_mb=bucket_mb)
    assert (stats.num_tensors, stats.num_buckets, stats.bytes) == (3, 0, 3072)
    assert {InProcessShards.mode, SharedMemoryShards.mode} == {"tp_shards", "shared_memory"}


def test_sync_mode_choice():
    one, two = ["node1", "node1"], ["node1", "node2"]
    assert choose_sync_mode("auto", 2, one, "vllm", "cuda") == "shared_memory"
    assert choose_sync_mode("auto", 2, one, "embedded", "cpu") == "shared_memory"
    assert choose_sync_mode("auto", 2, one, "embedded", "cuda") == "gather"  # NCCL gather lands on the GPU
    # SGLang takes the gathered tensors as CUDA IPC handles: no trip through host memory on a GPU.
    assert choose_sync_mode("auto", 2, one, "sglang", "cuda") == "gather"
    assert choose_sync_mode("auto", 8, ["node1"] * 8, "sglang", "cuda") == "gather"
    assert choose_sync_mode("auto", 2, one, "sglang", "cpu") == "shared_memory"  # CPU: tensors are in host memory anyway
    assert choose_sync_mode("shared_memory", 2, one, "sglang", "cuda") == "shared_memory"  # still there when asked for
    assert choose_sync_mode("auto", 1, ["node1"], "vllm", "cpu") == "gather"  # nothing to gather at TP=1
    assert choose_sync_mode("auto", 2, two, "vllm", "cuda") == "gather"
    assert choose_sync_mode("gather", 2, one, "vllm", "cpu") == "gather"
    assert choose_sync_mode("shared_memory", 1, ["node1"], "embedded", "cpu") == "shared_memory"
    with pytest.raises(ValueError, match="one node"):
        choose_sync_mode("shared_memory", 2, two, "vllm", "cuda")
    with pytest.raises(ValueError, match="weight_sync_mode"):
        choose_sync_mode("nccl", 2, one, "vllm", "cuda")
