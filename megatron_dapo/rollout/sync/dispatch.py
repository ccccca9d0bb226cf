"""The weight-sync dispatcher: the actor's weights streamed through one transport into the engines.

    transport = RolloutGroup(...)'s choice, made once per run   # FullTensors / SharedMemoryShards / InProcessShards
    stats = sync_weights(actor.gpt_models, hf_cfg, transport, bucket_mb=cfg.rollout.weight_sync_bucket_mb)
    sync_weights(models, hf_cfg, engine)                         # an engine (or a list): FullTensors(engine)
    print(stats.gb_per_s, stats.num_buckets, stats.peak_bucket_bytes)

A `WeightTransport` is one weight-sync mode (`rollout.weight_sync_mode`): what this rank streams,
how big each item counts against a bucket, and where a bucket goes. One class per mode:

* "gather" (`FullTensors`, here): full HF tensors, each parameter's TP shards all-gathered
  (`gather.py`); the engine's owner (leader placement) or every rank (spmd) loads them with
  `RolloutEngine.load_weights`.
* "shared_memory" (`shared_memory.SharedMemoryShards`, leader placement): each TP rank writes its own
  slices (`shards.py`) into one bucket file in /dev/shm that the engine reads: no TP gather.
* "tp_shards" (`tp_shards.InProcessShards`, spmd placement with rollout TP = actor TP): each rank
  loads its own slices into its own in-process engine shard: no gather, no file.

`distributed.placement.choose_sync_mode` turns the configured value ("auto" included) into one of
them, identically on every rank; `RolloutGroup` makes that transport once and calls `sync_weights`,
which cuts the stream into buckets of at most ``bucket_mb`` MiB (`bucketing.bucket_stream`, the rule
every weight path shares) and hands each bucket to the transport, so the extra memory held at any
time is one bucket.

Collectives. The export is a collective over the actor's model-parallel group: every actor rank
calls `sync_weights`, in the same order, whether it owns an engine or not. Ranks without an engine
have a transport that delivers nothing: they take part in the collectives and drop the tensors at
once (no bucket is kept). Data-parallel replicas export independently.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, ClassVar, Iterable, Iterator, Optional, Protocol, Sequence, Union

import torch

from megatron_dapo.model.bucketing import DEFAULT_BUCKET_MB, MIB, bucket_limit_bytes, bucket_stream, tensor_item_nbytes
from megatron_dapo.rollout.sync import gather, shards
from megatron_dapo.rollout.sync.shards import EngineShard

__all__ = ["FullTensors", "OwnShards", "ShardLoadingEngine", "SyncStats", "WeightTransport", "sync_weights"]


class ShardLoadingEngine(Protocol):
    """Takes one TP rank's slices directly (the target of an `OwnShards` transport).

    Every rank of the TP group that feeds one engine has one (`shared_memory.SharedMemoryHandover`,
    `tp_shards.InProcessShardTarget`): `load_weight_shards` is called on all of them with the same
    bucket (same names, each rank's own slices), so it may be a collective over that group.
    """

    def load_weight_shards(self, shards: Iterable[EngineShard]) -> None:
        """Deliver this rank's slices of one bucket (each at ``[start : start + len]`` along ``dim``)."""


class WeightTransport(ABC):
    """One weight-sync mode: what this rank streams and where each bucket goes.

    Made once per run by `RolloutGroup` (or by a test / benchmark) and handed to `sync_weights`."""

    mode: ClassVar[str]
    """The `rollout.weight_sync_mode` value this transport implements."""

    @abstractmethod
    def stream(self, models: Sequence[torch.nn.Module], hf_config: Any, bucket_mb: float) -> Iterator[Any]:
        """The items this rank exports (a collective over the actor's model-parallel group)."""

    @abstractmethod
    def item_bytes(self, item: Any) -> int:
        """How much of a bucket `item` takes (identical on every rank that shares a bucket)."""

    @property
    @abstractmethod
    def delivers(self) -> bool:
        """Whether this rank hands buckets to an engine (False: it only takes part in the export)."""

    @abstractmethod
    def deliver(self, bucket: list) -> None:
        """Hand one bucket to this rank's engine(s)."""

    def commit(self) -> None:
        """After the last bucket: make the engine ready to generate (vLLM finishes a lazy reload)."""

    def close(self) -> None:
        """Release what the transport holds between pushes (files, buffers); it is not used again."""


class FullTensors(WeightTransport):
    """Mode "gather": full HF tensors (TP shards all-gathered) into `RolloutEngine.load_weights`."""

    mode = "gather"

    def __init__(self, engines: Union[None, Any, Sequence[Any]]) -> None:
        """`engines`: this rank's engine, a list of engines, or None where it owns none."""
        self.engines = _as_engine_list(engines)

    def stream(self, models, hf_config, bucket_mb):
        return gather.iter_full_tensors(models, hf_config, bucket_mb)

    def item_bytes(self, item) -> int:
        return tensor_item_nbytes(item)

    @property
    def delivers(self) -> bool:
        return bool(self.engines)

    def deliver(self, bucket) -> None:
        for engine in self.engines:
            engine.load_weights(bucket)

    def commit(self) -> None:
        for engine in self.engines:
            # Engines that apply an update lazily (vLLM's layer-wise reload) finish it now, so the
            # engine is ready when sync_weights returns and the time is counted there.
            commit = getattr(engine, "commit_weights", None)
            if commit is not None:
                commit()


class OwnShards(WeightTransport):
    """Each rank streams its own TP slices (no TP gather) to a `ShardLoadingEngine`; buckets are cut
    by the slices' full sizes (`shards.full_nbytes`), identical on every TP rank. The modes
    "shared_memory" and "tp_shards" are its subclasses, which differ in the target."""

    def __init__(self, target: Optional[ShardLoadingEngine]) -> None:
        """`target`: this rank's shard loader, or None where the rank only takes part in the export."""
        if target is not None and not hasattr(target, "load_weight_shards"):
            raise TypeError(f"{type(self).__name__} needs a target with load_weight_shards(); {type(target).__name__} has none")
        self.target = target

    def stream(self, models, hf_config, bucket_mb):
        # Looked up on the module at each call: a memory ledger may pause it (tests' storage ledger).
        return shards.iter_engine_shards(models, hf_config)

    def item_bytes(self, item) -> int:
        return shards.full_nbytes(item)

    @property
    def delivers(self) -> bool:
        return self.target is not None

    def deliver(self, bucket) -> None:
        self.target.load_weight_shards(bucket)

    def commit(self) -> None:
        commit = getattr(self.target, "commit_weights", None)
        if commit is not None:
            commit()

    def close(self) -> None:
        close = getattr(self.target, "close", None)
        if close is not None:
            close()


@dataclass(frozen=True)
class SyncStats:
    """What one `sync_weights` call moved on this rank."""

    bytes: int
    """Bytes of HF tensors this rank streamed: full tensors, or with `OwnShards` its own slices."""
    seconds: float
    """Wall time of the whole sync on this rank: export collectives + engine loading."""
    load_seconds: float
    """Of which inside the engines (``load_weights`` / ``load_weight_shards`` and ``commit_weights``)."""
    num_tensors: int
    num_buckets: int
    peak_bucket_bytes: int
    """Largest bucket of full tensors: the extra memory the sync held at once (besides one gathered
    parameter); with `OwnShards` the size of the largest shared bucket file."""

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
    transport: Union[WeightTransport, None, Any, Sequence[Any]],
    bucket_mb: float = DEFAULT_BUCKET_MB,
) -> SyncStats:
    """Push the actor's current weights through `transport`, bucket by bucket.

    Every rank of the actor's model-parallel group calls it (a collective). `transport` is a
    `WeightTransport`, or an engine / a list of engines / None, which means `FullTensors` of them.
    Engines must be awake (`wake_up`) first; the transport's `commit` runs at the end, so the
    engine is ready to generate when this returns. A rank whose transport delivers nothing counts
    the streamed bytes, with no buckets.
    """
    if not isinstance(transport, WeightTransport):
        transport = FullTensors(transport)
    stream = transport.stream(models, hf_config, bucket_mb)

    start = time.perf_counter()
    load_seconds = 0.0
    total = tensors = buckets = peak = 0
    if not transport.delivers:
        # Nothing to deliver: take part in the collectives, keep nothing. Bucket counts stay 0.
        for item in stream:
            total += tensor_item_nbytes(item)
            tensors += 1
    else:
        for bucket in bucket_stream(stream, bucket_limit_bytes(bucket_mb), size_of=transport.item_bytes):
            total += sum(tensor_item_nbytes(item) for item in bucket)
            tensors += len(bucket)
            buckets += 1
            peak = max(peak, sum(transport.item_bytes(item) for item in bucket))
            loading = time.perf_counter()
            transport.deliver(bucket)
            load_seconds += time.perf_counter() - loading
            del bucket  # release the bucket before the export fills the next one
        loading = time.perf_counter()
        transport.commit()
        load_seconds += time.perf_counter() - loading
    return SyncStats(
        bytes=total,
        seconds=time.perf_counter() - start,
        load_seconds=load_seconds,
        num_tensors=tensors,
        num_buckets=buckets,
        peak_bucket_bytes=peak,
    )
