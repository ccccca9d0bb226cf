"""Buckets of a weight stream: order kept, the size limit respected, a big tensor alone."""

from __future__ import annotations

import torch

from megatron_dapo.model.bucketing import bucket_stream


def _pairs(sizes):
    return [(f"t{i}", torch.zeros(n, dtype=torch.uint8)) for i, n in enumerate(sizes)]


def test_buckets_keep_order_respect_the_limit_and_isolate_big_tensors():
    items = _pairs([3, 4, 2, 10, 1, 1, 5])
    buckets = list(bucket_stream(items, bucket_bytes=6))
    assert [[name for name, _ in b] for b in buckets] == [["t0"], ["t1", "t2"], ["t3"], ["t4", "t5"], ["t6"]]
    assert [n for b in buckets for n, _ in b] == [n for n, _ in items]
    for bucket in buckets:
        assert sum(t.numel() for _, t in bucket) <= 6 or len(bucket) == 1
    assert list(bucket_stream([], 6)) == []
