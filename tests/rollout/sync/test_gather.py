"""The full-tensor stream's own rule (one process); the stream itself, through a real Megatron actor
into embedded and vLLM engines, is tested in test_weight_sync.py."""

from __future__ import annotations

import pytest

from megatron_dapo.rollout.sync.gather import iter_weight_buckets


def test_weight_buckets_refuse_a_size_that_is_not_positive():
    with pytest.raises(ValueError, match="weight_sync_bucket_mb"):
        list(iter_weight_buckets([], None, bucket_mb=0))
