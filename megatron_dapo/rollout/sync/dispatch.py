"""Resharding: stream the actor's Megatron shards into rollout engines as HF-named tensors, in buckets.

    stats = sync_weights(actor.gpt_models, hf_cfg, engine if owns_engine else None,
                         bucket_mb=cfg.rollout.weight_sync_bucket_mb)     # every actor rank
    print(stats.gb_per_s, stats.num_buckets, stats.peak_bucket_bytes)

Names and transforms come from ONE place: the architecture's mapping table (`model/arch_tables.py`),
the same rows that load HF checkpoints into Megatron. The full-tensor stream is
`model.load.export_megatron_to_hf`, which walks the table one Megatron parameter at a time:
the owning pipeline stage all-gathers the parameter's TP shards and turns them into full HF
tensors with the row's transform (QKV de-interleaved per query group, gate/up split, vocabulary
padding removed, VPP chunks in global layer order), then broadcasts them to the other stages.
This module groups that stream into buckets of at most ``bucket_mb`` MiB and hands each bucket to
the engine(s) with `RolloutEngine.load_weights`, so the extra memory held at any time is one bucket
(plus the one parameter being gathered), never the whole model. A tensor larger than a bucket
travels alone.

Collectives. The export is a collective over the model-parallel group: every actor rank calls
`sync_weights` (or consumes `iter_weight_buckets` to the end), in the same order, whether it owns an
engine or not. Ranks without an engine pass ``engines=None``: they take part in the collectives and
drop the tensors at once (no bucket is kept). Data-parallel replicas export independently.

TP shards without a gather. When the engine's owner shares a node with its TP group, the full
gather is wasted work: each TP rank can hand over its OWN shard. `engine_shards` converts one
Megatron shard into the HF-named slices it holds (`EngineShard`: the tensor plus where it sits in
the full HF tensor), using the row's own transform on a per-rank `ModelShape`;
`iter_weight_shard_buckets` streams them (pipeline stages still broadcast, no TP communication at
all), and `sync_weights(..., tp_shards=True)` gives them to a ``load_weight_shards`` target: the
`shard_handover.SharedMemoryHandover` (leader placement: every TP rank writes its slices into one
shared bucket file that the engine then reads) or `spmd_sync.InProcessShardTarget` (spmd placement:
each rank loads its slices into its own in-process engine shard). `RolloutGroup` picks the path
(see its doc); buckets are cut by `bucketing.bucket_stream`, the rule every weight path shares. The slicing
convention is the usual one of TP inference engines: rank r holds the r-th contiguous block of attention heads / query
groups (q, k and v of the same groups), of gate and up rows, and of the input dimension of
o_proj/down_proj; norms are whole. Vocabulary rows are Megatron's padded split with the padding
dropped (an engine whose vocabulary padding differs must place them by ``start``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Iterable, Iterator, Optional, Protocol, Sequence, Union

import torch

from megatron_dapo.model.arch_tables import mapping_for
from megatron_dapo.model.mapping import (
    GATE_UP,
    QKV_INTERLEAVED,
    REPLICATED,
    TP_SPLIT,
    VOCAB_PAD,
    Map,
    ModelShape,
    layer_location,
)
from megatron_dapo.rollout.sync.bucketing import bucket_stream, tensor_item_nbytes as _nbytes
from megatron_dapo.model.safetensors_format import tensor_nbytes

__all__ = [
    "DEFAULT_BUCKET_MB",
    "EngineShard",
    "ShardLoadingEngine",
    "SyncStats",
    "bucket_stream",
    "engine_shards",
    "iter_weight_buckets",
    "iter_weight_shard_buckets",
    "sync_weights",
]

DEFAULT_BUCKET_MB = 512
MIB = 1 << 20

WeightBucket = list[tuple[str, torch.Tensor]]


# ---------------------------------------------------------------------------------------------
# Buckets
# ---------------------------------------------------------------------------------------------


def _bucket_limit(bucket_mb: float) -> int:
    if not bucket_mb > 0:
        raise ValueError(f"bucket size must be > 0 MB, got {bucket_mb} (rollout.weight_sync_bucket_mb)")
    return max(1, int(bucket_mb * MIB))


# ---------------------------------------------------------------------------------------------
# Full HF tensors (any engine)
# ---------------------------------------------------------------------------------------------


def iter_weight_buckets(
    models: Sequence[torch.nn.Module], hf_config, bucket_mb: float = DEFAULT_BUCKET_MB
) -> Iterator[WeightBucket]:
    """Buckets of (HF name, full tensor) of the whole model, on every rank, in HF order.

    A collective over the model-parallel group (see the module doc): every rank must consume it to
    the end. `models` are this rank's model chunks (DDP-wrapped or not), `hf_config` the
    `HFModelConfig` they were built from. The tensors may alias the actor's parameters (replicated
    ones at TP=1): copy what you keep beyond the current bucket.
    """
    from megatron_dapo.model.load import export_megatron_to_hf

    return bucket_stream(export_megatron_to_hf(models, hf_config), _bucket_limit(bucket_mb))


# ---------------------------------------------------------------------------------------------
# TP shards (engine TP == actor TP)
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class EngineShard:
    """One TP rank's slice of one HF tensor: ``full.narrow(dim, start, tensor.shape[dim]) == tensor``.

    ``dim`` is None for tensors every rank holds whole (norms); then ``start`` is 0 and ``full_size``
    is the tensor's first dimension.
    """

    name: str
    tensor: torch.Tensor
    dim: Optional[int]
    start: int
    full_size: int

    @property
    def full_shape(self) -> tuple[int, ...]:
        """Shape of the full HF tensor."""
        shape = list(self.tensor.shape)
        if self.dim is not None:
            shape[self.dim] = self.full_size
        return tuple(shape)

    @property
    def full_nbytes(self) -> int:
        """Bytes of the full HF tensor (the same on every TP rank, unlike the shard's own size)."""
        return tensor_nbytes(self.tensor.dtype, self.full_shape)


def _rank_shape(shape: ModelShape, tp_size: int) -> ModelShape:
    """The `ModelShape` of one TP rank's share of the attention heads (whole query groups)."""
    if shape.num_query_groups % tp_size:
        raise ValueError(f"{shape.num_query_groups} query groups cannot be split over {tp_size} TP ranks")
    groups = shape.num_query_groups // tp_size
    return ModelShape(groups * shape.heads_per_group, groups, shape.head_dim, shape.vocab_size, shape.padded_vocab_size)


def engine_shards(
    row: Map,
    layer: Optional[int],
    megatron_shard: torch.Tensor,
    tp_rank: int,
    tp_size: int,
    shape: ModelShape,
) -> list[EngineShard]:
    """The HF-named slices held by TP rank `tp_rank`, from its Megatron shard of mapping row `row`.

    `shape` is the full model's `ModelShape` at this TP size. Pure function (no communication).
    The de-interleaving of QKV and the gate/up split are the row's own `to_hf` applied to this
    rank's shard alone, with this rank's share of the query groups; the offsets follow from the
    even split. Vocabulary shards lose their padding rows (possibly all of them on the last rank).
    """
    names = row.hf_names(layer)
    transform = row.transform
    if transform is REPLICATED or (transform is TP_SPLIT and row.tp_dim is None):
        (tensor,) = row.to_hf([megatron_shard], shape)
        return [EngineShard(names[0], tensor, None, 0, tensor.shape[0] if tensor.dim() else 1)]
    if transform is TP_SPLIT:
        (tensor,) = row.to_hf([megatron_shard], shape)
        size = tensor.shape[row.tp_dim]
        return [EngineShard(names[0], tensor, row.tp_dim, tp_rank * size, size * tp_size)]
    if transform is QKV_INTERLEAVED:
        parts = row.to_hf([megatron_shard], _rank_shape(shape, tp_size))
    elif transform is GATE_UP:
        parts = row.to_hf([megatron_shard], shape)
    elif transform is VOCAB_PAD:
        per_rank = megatron_shard.shape[0]
        lo = tp_rank * per_rank
        real = max(0, min(per_rank, shape.vocab_size - lo))
        return [EngineShard(names[0], megatron_shard[:real], 0, min(lo, shape.vocab_size), shape.vocab_size)]
    else:
        raise NotImplementedError(f"no shard hand-over rule for transform {transform} (row {row.megatron})")
    return [
        EngineShard(name, part, 0, tp_rank * part.shape[0], part.shape[0] * tp_size) for name, part in zip(names, parts)
    ]


def _owner_stage(row: Map, layer: Optional[int], num_layers: int, pp: int, vpp: Optional[int]) -> tuple[int, int, Optional[int]]:
    """(pipeline stage, model chunk, chunk-local layer) holding a row (embedding first, head last)."""
    if layer is not None:
        return layer_location(layer, num_layers, pp, vpp)
    if row.megatron.startswith("embedding."):
        return 0, 0, None
    return pp - 1, (vpp or 1) - 1, None


@torch.no_grad()
def _iter_engine_shards(models: Sequence[torch.nn.Module], hf_config) -> Iterator[EngineShard]:
    """This TP rank's `EngineShard`s of the whole model, in HF order, on every pipeline stage."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from megatron_dapo.model.builder import layer_spec_of, unwrap_model

    models = [unwrap_model(m) for m in models]
    table = mapping_for(hf_config)
    tp_rank, tp = ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size()
    pp_rank, pp = ps.get_pipeline_model_parallel_rank(), ps.get_pipeline_model_parallel_world_size()
    vpp = len(models) if len(models) > 1 else None
    shape = ModelShape.from_hf(hf_config, tp)
    num_layers = hf_config.num_layers
    specs = [layer_spec_of(m) for m in models]
    params = [dict(m.named_parameters()) for m in models]
    items = list(table.ordered(num_layers))
    owners = [_owner_stage(row, layer, num_layers, pp, vpp) for row, layer in items]

    def local_shards(index: int, meta: bool = False) -> list[EngineShard]:
        (row, layer), (_, chunk, local) = items[index], owners[index]
        param = params[chunk][row.megatron_name(specs[chunk], local)].detach()
        if meta:  # shapes only: the same transforms on a storage-less tensor
            param = torch.empty(param.shape, dtype=param.dtype, device="meta")
        return engine_shards(row, layer, param, tp_rank, tp, shape)

    if pp == 1:
        for index in range(len(items)):
            yield from local_shards(index)
        return

    # Each stage describes the shards it owns; one exchange tells every stage what to receive.
    pp_group = ps.get_pipeline_model_parallel_group()
    pp_ranks = dist.get_process_group_ranks(pp_group)
    device = next(iter(params[0].values())).device
    mine = {}
    for index, owner in enumerate(owners):
        if owner[0] == pp_rank:
            mine[index] = [(s.name, tuple(s.tensor.shape), s.tensor.dtype, s.dim, s.start, s.full_size) for s in local_shards(index, meta=True)]
    described: list = [None] * pp
    dist.all_gather_object(described, mine, group=pp_group)
    meta = {index: entry for part in described for index, entry in part.items()}
    for index, owner in enumerate(owners):
        if owner[0] == pp_rank:
            shards = [EngineShard(s.name, s.tensor.contiguous(), s.dim, s.start, s.full_size) for s in local_shards(index)]
        else:
            shards = [EngineShard(n, torch.empty(sh, dtype=dt, device=device), d, st, fs) for n, sh, dt, d, st, fs in meta[index]]
        for shard in shards:
            if shard.tensor.numel():
                dist.broadcast(shard.tensor, src=pp_ranks[owner[0]], group=pp_group)
        yield from shards


def _full_nbytes(shard: EngineShard) -> int:
    return shard.full_nbytes


def iter_weight_shard_buckets(
    models: Sequence[torch.nn.Module], hf_config, bucket_mb: float = DEFAULT_BUCKET_MB
) -> Iterator[list[EngineShard]]:
    """Buckets of this TP rank's `EngineShard`s of the whole model (no TP gather), on every PP stage.

    A collective over the pipeline group: every rank must consume it to the end. Buckets are cut by
    the FULL tensors' bytes (what they fill in a shared bucket file), so every TP rank cuts the same
    buckets, although its own slices differ in size (the vocabulary's last rank).
    """
    return bucket_stream(_iter_engine_shards(models, hf_config), _bucket_limit(bucket_mb), size_of=_full_nbytes)


# ---------------------------------------------------------------------------------------------
# Sync into engines
# ---------------------------------------------------------------------------------------------


class ShardLoadingEngine(Protocol):
    """Takes one TP rank's slices directly (`sync_weights(..., tp_shards=True)`).

    Every rank of the TP group that feeds one engine has one (`shard_handover.SharedMemoryHandover`):
    `load_weight_shards` is called on all of them with the same bucket (same names, each rank's own
    slices), so it may be a collective over that group.
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
    `iter_weight_shard_buckets`) to a `ShardLoadingEngine` (`shard_handover.SharedMemoryHandover`).
    Otherwise full HF tensors go to `RolloutEngine.load_weights`.
    """
    targets = _as_engine_list(engines)
    if tp_shards:
        missing = [type(e).__name__ for e in targets if not hasattr(e, "load_weight_shards")]
        if missing:
            raise TypeError(f"tp_shards=True needs engines with load_weight_shards(); {missing} have none")
        stream = _iter_engine_shards(models, hf_config)
        bucket_size = _full_nbytes  # identical on every TP rank (see iter_weight_shard_buckets)
    else:
        from megatron_dapo.model.load import export_megatron_to_hf

        stream = export_megatron_to_hf(models, hf_config)
        bucket_size = _nbytes

    start = time.perf_counter()
    load_seconds = 0.0
    total = tensors = buckets = peak = 0
    if not targets:
        # Nothing to deliver: take part in the collectives, keep nothing. Bucket counts stay 0.
        for item in stream:
            total += _nbytes(item)
            tensors += 1
    else:
        for bucket in bucket_stream(stream, _bucket_limit(bucket_mb), size_of=bucket_size):
            total += sum(_nbytes(item) for item in bucket)
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
