"""The "gather" weight sync: each parameter's TP shards all-gathered into full HF tensors, in buckets.

    for bucket in iter_weight_buckets(actor.gpt_models, hf_cfg, bucket_mb=512):   # every actor rank
        engine.load_weights(bucket)                                                # where one is owned

Names and transforms come from ONE place: the architecture's mapping table (`model/arch_tables.py`),
the same rows that load HF checkpoints into Megatron. The full-tensor stream is
`model.load.export_megatron_to_hf`, which walks the table one Megatron parameter at a time:
the owning pipeline stage all-gathers the parameter's TP shards and turns them into full HF
tensors with the row's transform (QKV de-interleaved per query group, gate/up split, vocabulary
padding removed, VPP chunks in global layer order), then broadcasts them to the other stages.
Here that stream is cut into buckets of at most ``bucket_mb`` MiB (`bucketing.bucket_stream`), so
the extra memory held at any time is one bucket (plus the one parameter being gathered), never
the whole model. A tensor larger than a bucket travels alone.

Collectives. The export is a collective over the model-parallel group: every actor rank consumes
the stream to the end, in the same order, whether it owns an engine or not (`dispatch.sync_weights`
drops the tensors at once on ranks without one). Data-parallel replicas export independently.
Works for any engine and any rollout TP: the engine's own loaders take the part their shard needs.
"""

from __future__ import annotations

from typing import Iterator, Sequence

import torch

from megatron_dapo.model import load
from megatron_dapo.model.bucketing import DEFAULT_BUCKET_MB, bucket_limit_bytes, bucket_stream

__all__ = ["WeightBucket", "iter_full_tensors", "iter_weight_buckets"]

WeightBucket = list[tuple[str, torch.Tensor]]


def iter_full_tensors(
    models: Sequence[torch.nn.Module], hf_config, bucket_mb: float = DEFAULT_BUCKET_MB
) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, full tensor) of the whole model, one at a time, on every rank, in HF order.

    `bucket_mb`: the buckets the stream is cut into; experts moved between ranks travel packed in
    buffers of at most half of one (`model.expert_groups`).
    Looked up on `model.load` at each call, so that a memory ledger pausing the export
    (`tests/support/storage_ledger.weight_path_ledger`) sees this stream too.
    """
    return load.export_megatron_to_hf(models, hf_config, bucket_limit_bytes(bucket_mb))


def iter_weight_buckets(
    models: Sequence[torch.nn.Module], hf_config, bucket_mb: float = DEFAULT_BUCKET_MB
) -> Iterator[WeightBucket]:
    """Buckets of (HF name, full tensor) of the whole model, on every rank, in HF order.

    A collective over the model-parallel group (see the module doc): every rank must consume it to
    the end. `models` are this rank's model chunks (DDP-wrapped or not), `hf_config` the
    `HFModelConfig` they were built from. The tensors may alias the actor's parameters (replicated
    ones at TP=1): copy what you keep beyond the current bucket.
    """
    return bucket_stream(iter_full_tensors(models, hf_config, bucket_mb), bucket_limit_bytes(bucket_mb))
