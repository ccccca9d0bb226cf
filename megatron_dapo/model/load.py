"""Move weights between an HF checkpoint and this rank's sharded Megatron `GPTModel` chunks.

    load_hf_into_megatron(models, hf_dir)                 # every rank, after build_gpt_models
    for name, tensor in export_megatron_to_hf(models, hf_cfg):   # every rank, consumed to the end
        ...

Loading: each rank reads only the HF tensors of its own pipeline stage (its layers, plus the
embedding on the first stage and the final norm / output layer on the last), and of those only the
part its tensor-parallel shard is made of (`rank_slices`, read through safetensors' `get_slice`):
its query groups of q/k/v, its rows of gate and up, its columns of o_proj / down_proj, its rows of
the vocabulary. The mapping row's own transform then fuses and pads those parts exactly as it does
whole tensors, so a rank reads about 1/TP of the stage's bytes (norms, replicated, are read whole).
Every parameter of the model must be written, or loading fails naming the ones that were not.
Mixture-of-experts layers: a rank loads the experts of its expert-parallel rank (global experts
ep_rank * E/EP ... under their local ids) and splits them over the expert-tensor-parallel group.

Exporting: the mapping table's order (embedding, layers 0..L-1, final norm, output layer) is walked
on every rank; the owning pipeline stage all-gathers the TP shards of one parameter, turns them
into full HF tensors (vocabulary padding removed), and broadcasts them to the other stages, so
every rank yields the same (hf_name, full tensor) sequence, one parameter at a time. Experts are
the exception where they must travel (EP > 1 or PP > 1): an expert's tensors are gathered over the
expert-tensor-parallel group on the expert-parallel rank that holds it, and consecutive experts of
one layer held by one rank are packed into one buffer that a single broadcast over the
expert-parallel group (and one over the pipeline group) delivers, so a layer of experts costs a few
collectives, not one per tensor (`expert_groups`: a buffer holds at most half a weight-sync bucket).
It is a collective: all ranks of the model-parallel and expert-parallel groups must consume the
iterator to the end.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Iterator, Optional, Sequence, Union

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps

from megatron_dapo.model.arch_tables import mapping_for
from megatron_dapo.model.builder import layer_spec_of, unwrap_model
from megatron_dapo.model.expert_groups import expert_group_limit, plan_expert_groups
from megatron_dapo.model.hf_config import HFModelConfig, read_hf_config
from megatron_dapo.model.hf_weights import HFWeightReader
from megatron_dapo.model.mapping import (
    GATE_UP,
    QKV_INTERLEAVED,
    TP_SPLIT,
    VOCAB_PAD,
    Map,
    MappingTable,
    ModelShape,
    expert_location,
    global_layer_index,
    layer_location,
)
from megatron_dapo.model.bucketing import DEFAULT_BUCKET_MB, bucket_limit_bytes

__all__ = ["export_megatron_to_hf", "load_hf_into_megatron", "rank_slices", "read_rank_shard"]

Index = tuple[slice, ...]


def _even_part(size: int, tp_rank: int, tp: int, what: str) -> slice:
    if size % tp:
        raise ValueError(f"{what} of size {size} cannot be split over {tp} tensor-parallel ranks")
    per_rank = size // tp
    return slice(tp_rank * per_rank, (tp_rank + 1) * per_rank)


def rank_slices(
    row: Map, hf_shapes: Sequence[Sequence[int]], tp_rank: int, tp: int, shape: ModelShape
) -> Optional[tuple[list[Index], ModelShape]]:
    """The part of each HF tensor of `row` that TP rank `tp_rank` is made of, and the shape of those parts.

    Returns (one index per HF tensor, in `row.hf` order; the `ModelShape` the parts form), such that
    ``row.to_megatron_shard(parts, 0, 1, part_shape)`` equals ``row.to_megatron_shard(whole, tp_rank, tp,
    shape)``, or None when the rank needs the whole tensors (TP=1, replicated rows, or a transform
    without a slicing rule here). Pure: from shapes only.

    QKV_INTERLEAVED: the rank's G/TP query groups, i.e. rows [lo*hpg*d, hi*hpg*d) of q and [lo*d, hi*d)
    of k and v; GATE_UP: the rank's f/TP rows of gate and of up; TP_SPLIT: the rank's 1/TP along
    `tp_dim`; VOCAB_PAD: the rank's rows of the padded vocabulary that exist in the checkpoint (possibly
    none), zero-padded by the transform.
    """
    if tp == 1 or row.tp_dim is None:
        return None
    transform = row.transform
    if transform is TP_SPLIT:
        (hf_shape,) = hf_shapes
        part = _even_part(hf_shape[row.tp_dim], tp_rank, tp, f"dimension {row.tp_dim}")
        return [(slice(None),) * row.tp_dim + (part,)], shape
    if transform is QKV_INTERLEAVED:
        groups = _even_part(shape.num_query_groups, tp_rank, tp, "num_query_groups")
        d, hpg = shape.head_dim, shape.heads_per_group
        per_rank = groups.stop - groups.start
        q = slice(groups.start * hpg * d, groups.stop * hpg * d)
        kv = slice(groups.start * d, groups.stop * d)
        part_shape = ModelShape(per_rank * hpg, per_rank, d, shape.vocab_size, shape.padded_vocab_size)
        return [(q,), (kv,), (kv,)], part_shape
    if transform is GATE_UP:
        gate_shape, up_shape = hf_shapes
        rows = _even_part(gate_shape[0], tp_rank, tp, "ffn_hidden_size")
        if tuple(up_shape) != tuple(gate_shape):
            raise ValueError(f"gate {tuple(gate_shape)} and up {tuple(up_shape)} projections differ in shape")
        return [(rows,), (rows,)], shape
    if transform is VOCAB_PAD:
        (hf_shape,) = hf_shapes
        if hf_shape[0] != shape.vocab_size:
            raise ValueError(f"vocabulary tensor has {hf_shape[0]} rows, the config says vocab_size={shape.vocab_size}")
        padded = _even_part(shape.padded_vocab_size, tp_rank, tp, "padded vocabulary")
        start = min(padded.start, shape.vocab_size)
        stop = min(padded.stop, shape.vocab_size)
        per_rank = padded.stop - padded.start
        part_shape = ModelShape(shape.num_attention_heads, shape.num_query_groups, shape.head_dim, stop - start, per_rank)
        return [(slice(start, stop),)], part_shape
    return None


def read_rank_shard(
    reader: HFWeightReader, row: Map, hf_names: Sequence[str], tp_rank: int, tp: int, shape: ModelShape
) -> torch.Tensor:
    """This TP rank's Megatron tensor of `row`, reading only its parts of the HF tensors (`rank_slices`)."""
    hf_shapes = [tuple(reader.get_slice(name).get_shape()) for name in hf_names]
    plan = rank_slices(row, hf_shapes, tp_rank, tp, shape)
    if plan is None:
        return row.to_megatron_shard([reader.get(name) for name in hf_names], tp_rank, tp, shape)
    indices, part_shape = plan
    # One tensor at a time: the reader keeps one shard file open, and a part is read as soon as it is sliced.
    parts = [reader.get_slice(name)[index] for name, index in zip(hf_names, indices)]
    return row.to_megatron_shard(parts, 0, 1, part_shape)


@dataclass(frozen=True)
class _Ranks:
    """This rank's place in Megatron's parallel state."""

    tp_rank: int
    tp: int
    pp_rank: int
    pp: int
    ep_rank: int = 0
    ep: int = 1
    expert_tp_rank: int = 0
    expert_tp: int = 1

    def tensor_parallel(self, row: Map) -> tuple[int, int]:
        """(rank, size) of the group `row` is split over: expert-TP for experts, else TP."""
        return (self.expert_tp_rank, self.expert_tp) if row.per_expert else (self.tp_rank, self.tp)


def _parallel_ranks() -> _Ranks:
    return _Ranks(
        tp_rank=ps.get_tensor_model_parallel_rank(),
        tp=ps.get_tensor_model_parallel_world_size(),
        pp_rank=ps.get_pipeline_model_parallel_rank(),
        pp=ps.get_pipeline_model_parallel_world_size(),
        ep_rank=ps.get_expert_model_parallel_rank(),
        ep=ps.get_expert_model_parallel_world_size(),
        expert_tp_rank=ps.get_expert_tensor_parallel_rank(),
        expert_tp=ps.get_expert_tensor_parallel_world_size(),
    )


def _vpp(models: Sequence[torch.nn.Module]) -> Optional[int]:
    return len(models) if len(models) > 1 else None


def _expected_global_rows(model: torch.nn.Module, table: MappingTable) -> list[Map]:
    """Global (non-layer) rows a chunk must hold: embedding if first, final norm (+ output) if last."""
    rows = []
    for row in table.global_rows:
        if row.megatron.startswith("embedding."):
            if model.pre_process:
                rows.append(row)
        elif model.post_process:
            rows.append(row)
    if table.tie_word_embeddings and model.post_process and not model.pre_process:
        rows.append(table.tied_output_row())  # Megatron's copy of the embedding on the last stage
    return rows


def _local_expert(row: Map, table: MappingTable, ranks: _Ranks) -> tuple[int, Optional[int]]:
    """(expert-parallel rank holding the row, its local expert id); (any rank, None) for non-expert rows."""
    if not row.per_expert:
        return ranks.ep_rank, None
    return expert_location(row.expert, table.num_experts, ranks.ep)


def _chunk_items(model, chunk: int, table: MappingTable, num_layers: int, ranks: _Ranks, vpp):
    """(row, global layer or None, Megatron name) for every parameter this chunk holds."""
    spec = layer_spec_of(model)
    per_chunk = num_layers // (ranks.pp * (vpp or 1))
    if len(model.decoder.layers) != per_chunk:
        raise ValueError(f"model chunk {chunk} has {len(model.decoder.layers)} layers, expected {per_chunk}")
    for row in _expected_global_rows(model, table):
        yield row, None, row.megatron_name(spec)
    for local in range(per_chunk):
        layer = global_layer_index(ranks.pp_rank, chunk, local, num_layers, ranks.pp, vpp)
        for row in table.layer_rows:
            ep_rank, local_expert = _local_expert(row, table, ranks)
            if ep_rank == ranks.ep_rank:
                yield row, layer, row.megatron_name(spec, local, local_expert)


@torch.no_grad()
def load_hf_into_megatron(
    models: Sequence[torch.nn.Module],
    hf_dir: Union[str, os.PathLike],
    hf_config: Optional[HFModelConfig] = None,
    *,
    sliced: bool = True,
    reader: Optional[HFWeightReader] = None,
) -> int:
    """Copy this rank's share of the HF checkpoint in `hf_dir` into `models` (this rank's chunks).

    `models` may be wrapped (DDP, Float16Module); load before building the optimizer, which copies
    the parameters into its own main weights. Returns the number of parameters written. Raises if
    a parameter has no source, a source is missing from the checkpoint, or shapes disagree.
    `sliced=False` reads whole HF tensors and slices them in memory (the reference the sliced reads
    are tested against). `reader`: an open reader of `hf_dir` to use (default: one opened here).
    """
    models = [unwrap_model(m) for m in models]
    cfg = hf_config or read_hf_config(hf_dir)
    table = mapping_for(cfg)
    ranks = _parallel_ranks()
    vpp = _vpp(models)
    shape = ModelShape.from_hf(cfg, ranks.tp)
    written = 0
    with reader if reader is not None else HFWeightReader(hf_dir) as reader:
        for chunk, model in enumerate(models):
            params = dict(model.named_parameters())
            covered = set()
            for row, layer, name in _chunk_items(model, chunk, table, cfg.num_layers, ranks, vpp):
                if name not in params:
                    raise KeyError(f"model chunk {chunk} has no parameter {name!r} (mapping row {row.megatron})")
                hf_names = row.hf_names(layer)
                missing = [n for n in hf_names if n not in reader]
                if missing:
                    raise KeyError(f"checkpoint {hf_dir} lacks {missing} (needed for {name})")
                tp_rank, tp = ranks.tensor_parallel(row)
                if sliced:
                    shard = read_rank_shard(reader, row, hf_names, tp_rank, tp, shape)
                else:
                    shard = row.to_megatron_shard([reader.get(n) for n in hf_names], tp_rank, tp, shape)
                param = params[name]
                if tuple(shard.shape) != tuple(param.shape):
                    raise ValueError(f"{name}: shard from {hf_names} has shape {tuple(shard.shape)}, parameter has {tuple(param.shape)}")
                param.data.copy_(shard)
                covered.add(name)
                written += 1
            unmapped = sorted(set(params) - covered)
            if unmapped:
                raise ValueError(f"model chunk {chunk} parameters with no HF source: {unmapped}")
    return written


# ---------------------------------------------------------------------------------------------
# Export
# ---------------------------------------------------------------------------------------------


def _owner(row: Map, layer: Optional[int], num_layers: int, pp: int, vpp) -> tuple[int, int, Optional[int]]:
    """(pipeline rank, chunk, local layer) that holds a row."""
    if layer is not None:
        return layer_location(layer, num_layers, pp, vpp)
    if row.megatron.startswith("embedding."):
        return 0, 0, None
    return pp - 1, (vpp or 1) - 1, None


def _gather_tp(param: torch.Tensor, row: Map, tp: int, group) -> list[torch.Tensor]:
    if row.tp_dim is None or tp == 1:
        return [param.detach()]
    shards = [torch.empty_like(param) for _ in range(tp)]
    dist.all_gather(shards, param.detach().contiguous(), group=group)
    return shards


def _hf_meta(row: Map, param: torch.Tensor, shape: ModelShape, tp: int) -> list[tuple[tuple[int, ...], torch.dtype]]:
    """Shapes/dtypes of the HF tensors of a row, from the local shard shape alone (meta tensors)."""
    count = tp if row.tp_dim is not None else 1
    fake = [torch.empty(param.shape, dtype=param.dtype, device="meta") for _ in range(count)]
    return [(tuple(t.shape), t.dtype) for t in row.to_hf(fake, shape)]


def _one_dtype(row: Map, meta: list[tuple[tuple[int, ...], torch.dtype]]) -> torch.dtype:
    """The dtype of all HF tensors of a row (they come from one parameter), for a packed buffer."""
    dtypes = {dtype for _, dtype in meta}
    if len(dtypes) != 1:
        raise ValueError(f"{row.megatron}: HF tensors of several dtypes {sorted(map(str, dtypes))} cannot share a buffer")
    return dtypes.pop()


def _expert_runs(items: Sequence[tuple[Map, Optional[int]]]) -> dict[int, int]:
    """{first index: end index} of each maximal run of per-expert rows of one layer in `items`."""
    runs: dict[int, int] = {}
    index = 0
    while index < len(items):
        end = index
        while end < len(items) and items[end][0].per_expert and items[end][1] == items[index][1]:
            end += 1
        if end > index:
            runs[index] = end
        index = max(end, index + 1)
    return runs


@torch.no_grad()
def export_megatron_to_hf(
    models: Sequence[torch.nn.Module], hf_config: HFModelConfig, bucket_bytes: Optional[int] = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (HF name, full tensor) for the whole model on every rank, in HF order (see module doc).

    `bucket_bytes`: the bucket size the consumer cuts the stream into (default: the weight sync's,
    `DEFAULT_BUCKET_MB`); experts moved between ranks travel in buffers of at most half of it
    (`expert_groups`), so the export holds at most one bucket beyond the consumer's.
    """
    models = [unwrap_model(m) for m in models]
    cfg = hf_config
    table = mapping_for(cfg)
    ranks = _parallel_ranks()
    pp, pp_rank = ranks.pp, ranks.pp_rank
    vpp = _vpp(models)
    shape = ModelShape.from_hf(cfg, ranks.tp)
    tp_group = ps.get_tensor_model_parallel_group()
    expert_tp_group = ps.get_expert_tensor_parallel_group() if table.num_experts else None
    pp_group = ps.get_pipeline_model_parallel_group()
    pp_ranks = dist.get_process_group_ranks(pp_group) if pp > 1 else None
    ep_group = ps.get_expert_model_parallel_group() if ranks.ep > 1 else None
    ep_ranks = dist.get_process_group_ranks(ep_group) if ep_group is not None else None
    specs = [layer_spec_of(m) for m in models]
    params = [dict(m.named_parameters()) for m in models]
    items = list(table.ordered(cfg.num_layers))
    group_limit = expert_group_limit(bucket_limit_bytes(DEFAULT_BUCKET_MB) if bucket_bytes is None else bucket_bytes)
    any_device = next(iter(params[0].values())).device

    def local_param(index: int) -> torch.Tensor:
        """The row's parameter on this rank; for an expert held by another EP rank, the local expert
        with the same local id (same shape), which describes the tensors to receive."""
        row, layer = items[index]
        _, chunk, local = _owner(row, layer, cfg.num_layers, pp, vpp)
        _, local_expert = _local_expert(row, table, ranks)
        return params[chunk][row.megatron_name(specs[chunk], local, local_expert)]

    def tp_size_of(row: Map) -> int:
        return ranks.tensor_parallel(row)[1]

    def owner_stage(index: int) -> int:
        return _owner(*items[index], cfg.num_layers, pp, vpp)[0]

    described: dict[tuple, list] = {}

    def local_meta(index: int) -> list[tuple[tuple[int, ...], torch.dtype]]:
        """`_hf_meta` of the row's local parameter. Remembered per row template and shard shape: the
        transforms on meta tensors are slow, and every expert (and layer) of a template has the same."""
        row, param = items[index][0], local_param(index)
        key = (row.megatron, row.transform, tuple(param.shape), param.dtype)
        if key not in described:
            described[key] = _hf_meta(row, param, shape, tp_size_of(row))
        return described[key]

    meta: dict[int, list] = {}
    if pp > 1:
        # Each stage describes the tensors it owns; one exchange tells every stage what to receive.
        mine = {i: local_meta(i) for i in range(len(items)) if owner_stage(i) == pp_rank}
        gathered: list = [None] * pp
        dist.all_gather_object(gathered, mine, group=pp_group)
        for part in gathered:
            meta.update(part)

    def hf_meta(index: int) -> list[tuple[tuple[int, ...], torch.dtype]]:
        return meta[index] if index in meta else local_meta(index)

    def full_tensors(index: int) -> tuple[torch.Tensor, ...]:
        """The row's HF tensors, on a rank of the stage (and expert-parallel rank) that holds it."""
        row = items[index][0]
        group = expert_tp_group if row.per_expert else tp_group
        return row.to_hf(_gather_tp(local_param(index), row, tp_size_of(row), group), shape)

    def exchange_experts(start: int, end: int) -> Iterator[tuple[str, torch.Tensor]]:
        """Items [start, end), per-expert rows of one layer, moved to every rank a buffer at a time.

        Each buffer packs consecutive experts of one expert-parallel rank (`plan_expert_groups`):
        the holder fills it with the experts' full HF tensors (gathered over expert-TP), one
        broadcast over the EP group and one over the pipeline group deliver it, and every rank
        yields views of it, so a layer costs a few collectives instead of one per tensor.
        """
        layer = items[start][1]
        stage = owner_stage(start)
        metas = [hf_meta(i) for i in range(start, end)]
        holders = [_local_expert(items[i][0], table, ranks)[0] for i in range(start, end)]
        dtypes = [_one_dtype(items[i][0], m) for i, m in zip(range(start, end), metas)]
        sizes = [sum(math.prod(s) * d.itemsize for s, d in m) for m in metas]
        for group in plan_expert_groups(list(zip(holders, dtypes)), sizes, group_limit):
            holder, dtype = holders[group.start], dtypes[group.start]
            numels = [math.prod(s) for i in group for s, _ in metas[i]]
            buffer = torch.empty(sum(numels), dtype=dtype, device=any_device)
            if stage == pp_rank and holder == ranks.ep_rank:
                offset = 0
                for i in group:
                    for tensor in full_tensors(start + i):
                        buffer[offset : offset + tensor.numel()].view(tensor.shape).copy_(tensor)
                        offset += tensor.numel()
            if stage == pp_rank and ep_group is not None:
                dist.broadcast(buffer, src=ep_ranks[holder], group=ep_group)
            if pp > 1:
                dist.broadcast(buffer, src=pp_ranks[stage], group=pp_group)
            offset = 0
            for i in group:
                row = items[start + i][0]
                for name, (tensor_shape, _) in zip(row.hf_names(layer), metas[i]):
                    count = math.prod(tensor_shape)
                    yield name, buffer[offset : offset + count].view(tensor_shape)
                    offset += count

    # Experts travel in packed buffers when they must travel (EP > 1 or PP > 1); everything else
    # one parameter at a time.
    expert_runs = _expert_runs(items) if ep_group is not None or pp > 1 else {}
    index = 0
    while index < len(items):
        if index in expert_runs:
            yield from exchange_experts(index, expert_runs[index])
            index = expert_runs[index]
            continue
        row, layer = items[index]
        stage = owner_stage(index)
        if stage == pp_rank:
            tensors = full_tensors(index)
        else:
            tensors = tuple(torch.empty(s, dtype=d, device=any_device) for s, d in meta[index])
        if pp > 1:
            tensors = tuple(t.contiguous() for t in tensors)
            for t in tensors:
                dist.broadcast(t, src=pp_ranks[stage], group=pp_group)
        yield from zip(row.hf_names(layer), tensors)
        index += 1
