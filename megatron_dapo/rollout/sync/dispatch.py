"""The weight-sync dispatcher: `rollout.weight_sync_mode` resolved, and the chosen stream pushed into the engines.

    mode = choose_sync_mode(cfg.rollout.weight_sync_mode, tp, tp_group_hosts, engine, device_type, placement)
    stats = sync_weights(actor.gpt_models, hf_cfg, target, bucket_mb=cfg.rollout.weight_sync_bucket_mb,
                         tp_shards=mode != "gather")                       # every actor rank
    print(stats.gb_per_s, stats.num_buckets, stats.peak_bucket_bytes)

One module per mode streams the actor's Megatron shards as HF-named tensors:

* "gather" (`gather.py`): full tensors, each parameter's TP shards all-gathered; the engine's
  owner (leader placement) or every rank (spmd) loads them with `RolloutEngine.load_weights`.
* "shared_memory" (`shared_memory.py`, leader placement): each TP rank writes its own slices
  (`shards.py`) into one bucket file in /dev/shm that the engine reads: no TP gather.
* "tp_shards" (`tp_shards.py`, spmd placement with rollout TP = actor TP): each rank loads its own
  slices into its own in-process engine shard: no gather, no file.

`distributed.placement.choose_sync_mode` turns the configured value ("auto" included) into one of them, identically on
every rank; `RolloutGroup` makes the target (the engine, a `SharedMemoryHandover` or an
`InProcessShardTarget`) and calls `sync_weights`, which cuts the stream into buckets of at most
``bucket_mb`` MiB (`bucketing.bucket_stream`, the rule every weight path shares) and hands each
bucket to the target, so the extra memory held at any time is one bucket.

Collectives. The export is a collective over the actor's model-parallel group: every actor rank
calls `sync_weights`, in the same order, whether it owns an engine or not. Ranks without an engine
pass ``engines=None``: they take part in the collectives and drop the tensors at once (no bucket is
kept). Data-parallel replicas export independently.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Iterable, Optional, Protocol, Sequence, Union

import torch

from megatron_dapo.rollout.sync import gather, shards
from megatron_dapo.model.bucketing import DEFAULT_BUCKET_MB, MIB, bucket_limit_bytes, bucket_stream, tensor_item_nbytes
from megatron_dapo.rollout.sync.shards import EngineShard

__all__ = ["ShardLoadingEngine", "SyncStats", "sync_weights"]


class ShardLoadingEngine(Protocol):
    """Takes one TP rank's slices directly (`sync_weights(..., tp_shards=True)`).

    Every rank of the TP group that feeds one engine has one (`shared_memory.SharedMemoryHandover`,
    `tp_shards.InProcessShardTarget`): `load_weight_shards` is called on all of them with the same
    bucket (same names, each rank's own slices), so it may be a collective over that group.
    """

    def load_weight_shards(self, shards: Iterable[EngineShard]) -> None:
        """Deliver this rank's slices of one bucket (each at ``[start : start + len]`` along ``dim``)."""


@dataclass(frozen=True)
class SyncStats:
    """What one `sync_weights` call moved on this rank."""

    bytes: int
    """Bytes of HF tensors this rank streamed: full tensors, or with ``tp_shards`` its own slices."""
    seconds: float
    """Wall time of the whole sync on this rank: export collectives + engine loading."""
    load_seconds: float
    """Of which inside the engines (``load_weights`` / ``load_weight_shards`` and ``commit_weights``)."""
    num_tensors: int
    num_buckets: int
    peak_bucket_bytes: int
    """Largest bucket of full tensors: the extra memory the sync held at once (besides one gathered
    parameter); with ``tp_shards`` the size of the largest shared bucket file."""

    @property
    def gb_per_s(self) -> float:
        """Throughput in GB/s (1e9 bytes per second)."""
        return self.bytes / self.seconds / 1e9 if self.seconds > 0 else float("inf")

    def as_metrics(self, prefix: str = "weight_sync/") -> dict[str, float]:
        return {
            f"{prefix}gb": self.bytes / 1e9,
            f"{prefix}seconds": self.seconds,
            f"{prefix}load_seconds": self.load_seconds,
            f"{prefix}gb_per_s": self.gb_per_s,
            f"{prefix}num_buckets": float(self.num_buckets),
            f"{prefix}peak_bucket_mb": self.peak_bucket_bytes / MIB,
        }


def _as_engine_list(engines: Union[None, Any, Sequence[Any]]) -> list[Any]:
    if engines is None:
        return []
    if isinstance(engines, (list, tuple)):
        return list(engines)
    return [engines]


@torch.no_grad()
def sync_weights(
    models: Sequence[torch.nn.Module],
    hf_config,
    engines: Union[None, Any, Sequence[Any]],
    bucket_mb: float = DEFAULT_BUCKET_MB,
    tp_shards: bool = False,
) -> SyncStats:
    """Push the actor's current weights into this rank's engine(s), bucket by bucket.

    Every rank of the actor's model-parallel group calls it (a collective); `engines` is the engine,
    a list of engines, or None on ranks that own none (their stats count the streamed bytes, with
    no buckets). Engines must be awake (`wake_up`) first; an engine's ``commit_weights`` (if it has
    one) is called at the end, so the engine is ready to generate when this returns.
    With ``tp_shards`` each rank streams its own TP shards (no TP gather, buckets as in
    `shards.iter_weight_shard_buckets`) to a `ShardLoadingEngine` (modes "shared_memory" and
    "tp_shards"). Otherwise full HF tensors (`gather.iter_full_tensors`) go to
    `RolloutEngine.load_weights`.
    """
    targets = _as_engine_list(engines)
    if tp_shards:
        missing = [type(e).__name__ for e in targets if not hasattr(e, "load_weight_shards")]
        if missing:
            raise TypeError(f"tp_shards=True needs engines with load_weight_shards(); {missing} have none")
        # Looked up on the modules at each call: a memory ledger may pause them (storage_ledger).
        stream = shards.iter_engine_shards(models, hf_config)
        bucket_size = shards.full_nbytes  # identical on every TP rank (see iter_weight_shard_buckets)
    else:
        stream = gather.iter_full_tensors(models, hf_config, bucket_mb)
        bucket_size = tensor_item_nbytes

    start = time.perf_counter()
    load_seconds = 0.0
    total = tensors = buckets = peak = 0
    if not targets:
        # Nothing to deliver: take part in the collectives, keep nothing. Bucket counts stay 0.
        for item in stream:
            total += tensor_item_nbytes(item)
            tensors += 1
    else:
        for bucket in bucket_stream(stream, bucket_limit_bytes(bucket_mb), size_of=bucket_size):
            total += sum(tensor_item_nbytes(item) for item in bucket)
            tensors += len(bucket)
            buckets += 1
            peak = max(peak, sum(bucket_size(item) for item in bucket))
            loading = time.perf_counter()
            for engine in targets:
                if tp_shards:
                    engine.load_weight_shards(bucket)
                else:
                    engine.load_weights(bucket)
            load_seconds += time.perf_counter() - loading
            del bucket  # release the bucket before the export fills the next one
        loading = time.perf_counter()
        for engine in targets:
            # Engines that apply an update lazily (vLLM's layer-wise reload) finish it now, so the
            # engine is ready when sync_weights returns and the time is counted here.
            commit = getattr(engine, "commit_weights", None)
            if commit is not None:
                commit()
        load_seconds += time.perf_counter() - loading
    return SyncStats(
        bytes=total,
        seconds=time.perf_counter() - start,
        load_seconds=load_seconds,
        num_tensors=tensors,
        num_buckets=buckets,
        peak_bucket_bytes=peak,
    )
