"""Each TP rank's OWN slices of the HF tensors (`EngineShard`), streamed without a TP gather.

    for bucket in iter_weight_shard_buckets(actor.gpt_models, hf_cfg, bucket_mb=512):  # every actor rank
        target.load_weight_shards(bucket)          # shared_memory.SharedMemoryHandover or tp_shards.InProcessShardTarget

The stream behind the two sync modes that skip the gather ("shared_memory" and "tp_shards", see
`dispatch`), so it is named after what it yields rather than after either mode. When the engine
takes TP slices (its owner shares a node with its TP group, or every rank holds its own engine
shard), the full gather is wasted work: each TP rank can hand over its own shard. `engine_shards`
converts one Megatron shard into the HF-named slices it holds (`EngineShard`: the tensor plus where
it sits in the full HF tensor), using the mapping row's own transform (`model/arch_tables.py`, the
rows that also load HF checkpoints) on a per-rank `ModelShape`; `iter_weight_shard_buckets` streams
them, pipeline stages still broadcasting to each other, with no TP communication at all. Buckets
are cut by `bucketing.bucket_stream` on the FULL tensors' bytes, so every TP rank cuts the same
buckets.

The slicing convention is the usual one of TP inference engines: rank r holds the r-th contiguous
block of attention heads / query groups (q, k and v of the same groups), of gate and up rows, and
of the input dimension of o_proj/down_proj; norms are whole. Vocabulary rows are Megatron's padded
split with the padding dropped (an engine whose vocabulary padding differs must place them by
``start``: `tp_shards` does).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, Optional, Sequence

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps

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
from megatron_dapo.model.safetensors_format import tensor_nbytes
from megatron_dapo.model.bucketing import DEFAULT_BUCKET_MB, bucket_limit_bytes, bucket_stream
from megatron_dapo.model.builder import layer_spec_of, unwrap_model

__all__ = ["EngineShard", "engine_shards", "full_nbytes", "iter_engine_shards", "iter_weight_shard_buckets"]


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
def iter_engine_shards(models: Sequence[torch.nn.Module], hf_config) -> Iterator[EngineShard]:
    """This TP rank's `EngineShard`s of the whole model, in HF order, on every pipeline stage."""
    models = [unwrap_model(m) for m in models]
    table = mapping_for(hf_config)
    if getattr(hf_config, "is_moe", False) and ps.get_expert_model_parallel_world_size() > 1:
        # A rank holds only its own experts; `placement.check_sync_mode` keeps the shard modes off EP > 1.
        raise ValueError(
            f"own-slice weight sync of an expert-parallel actor (EP={ps.get_expert_model_parallel_world_size()}): "
            "each rank holds only its own experts; use rollout.weight_sync_mode gather"
        )
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


def full_nbytes(shard: EngineShard) -> int:
    """What a shard fills in a bucket: its full tensor's bytes (the same on every TP rank)."""
    return shard.full_nbytes


def iter_weight_shard_buckets(
    models: Sequence[torch.nn.Module], hf_config, bucket_mb: float = DEFAULT_BUCKET_MB
) -> Iterator[list[EngineShard]]:
    """Buckets of this TP rank's `EngineShard`s of the whole model (no TP gather), on every PP stage.

    A collective over the pipeline group: every rank must consume it to the end. Buckets are cut by
    the FULL tensors' bytes (what they fill in a shared bucket file), so every TP rank cuts the same
    buckets, although its own slices differ in size (the vocabulary's last rank).
    """
    return bucket_stream(iter_engine_shards(models, hf_config), bucket_limit_bytes(bucket_mb), size_of=full_nbytes)
