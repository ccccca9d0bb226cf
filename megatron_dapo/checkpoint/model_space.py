"""The `fully_sharded_model_space` optimizer format: every DP rank writes its own part of every
parameter's state, laid out like the model's parameters. Loads at any TP / PP / VPP / EP / DP,
nothing is gathered.

The distributed optimizer (ZeRO-1) gives each DP rank a contiguous range of each gradient bucket,
which is, per parameter, a contiguous range [start, stop) of the parameter's flattened (TP-local)
tensor. Megatron-Core's own `fully_sharded_model_space` wrote that range as a `ShardedTensor` with
`flattened_range`; Megatron-Core 0.14 dropped `flattened_range` (`ShardedTensor.
validate_metadata_integrity` raises "ShardedTensor.flattened_range is not supported."), so
`DistributedOptimizer.sharded_state_dict` with that type fails in every version since, 0.16.1 and
0.19.2 here included, although the name is still in `checkpoint_fully_reshardable_formats` and
still the default sharding type. On Megatron-LM main (0.20.0, 2026-08-22,
megatron/core/optimizer/distrib_optimizer.py) it is still there, listed under "Deprecated sharding
formats", still built with `flattened_range`; Megatron-LM's own tests note that it "is rejected by
ShardedTensor.validate_metadata_integrity" and make its trainer always name another type.

This module builds the format on what Megatron-Core supports now, uneven sharding (`ShardedTensor`s
without `axis_fragmentations`, several chunks per rank and key, torch >= 2.6): a flat range of a
row-major tensor is the union of at most 2 n - 1 boxes (hyper-rectangles) each of which is one
contiguous run of the flat range (`flat_range_boxes`), so every rank writes each parameter's state
as a few boxes of the model-space tensor, views of its own shard (no copy, no communication). The
keys and global shapes are those of Megatron's `fully_reshardable` format
(`optimizer.state.<param | exp_avg | exp_avg_sq>.<model key>`, one tensor shaped like each model
tensor), so the two formats hold the same tensors on disk, chunked differently: one written by DP
rank 0 after a gather, the other by every rank. Loading builds the same boxes for this run's own
ranges and lets torch.distributed.checkpoint read them from whatever chunks were saved: every rank
reads only its own part (Megatron's `fully_reshardable` loader reads every rank's whole TP-local
state and slices it).

Parameters whose model `ShardedTensorFactory` (the gated MLP's fc1, split into its two halves)
builds sub-tensors are handled by building the factory on a meta tensor: each sub-tensor is a view
of it, whose storage offset says which flat range of the parameter it holds.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any, Sequence

import torch
from megatron.core.dist_checkpointing.dict_utils import nested_values
from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory
from megatron.core.dist_checkpointing.utils import extract_sharded_tensors_and_factories

from megatron_dapo.checkpoint.errors import CheckpointError

__all__ = ["MODEL_SPACE", "flat_range_boxes", "load_model_space_param_state", "model_space_sharded_state_dict"]

MODEL_SPACE = "fully_sharded_model_space"
"""The format's name: Megatron's name for the same layout (each DP rank writes its part of every
parameter's state in model space), recorded in metadata.json and in the optimizer's common state."""

STATE_PREFIX = "optimizer.state"
"""Key prefix of the state tensors, as in Megatron's `fully_reshardable` (and `fully_sharded_model_space`)."""

Box = tuple[int, tuple[int, ...], tuple[int, ...]]
"""(flat start within the tensor, offset, size): a box of a row-major tensor."""


def flat_range_boxes(start: int, stop: int, shape: Sequence[int]) -> list[Box]:
    """The boxes, in flat order, whose union is the flat range [start, stop) of a row-major tensor of
    `shape`; each box is one contiguous run of that range (so `flat[a:b].view(size)` is the box's
    data). At most 2 n - 1 boxes for n dimensions (pure)."""
    shape = tuple(int(s) for s in shape)
    numel = math.prod(shape)
    if not 0 <= start <= stop <= numel:
        raise ValueError(f"flat range [{start}, {stop}) is not within a tensor of shape {shape}")
    boxes: list[Box] = []

    def split(lo: int, hi: int, dims: tuple[int, ...], prefix: tuple[int, ...], base: int) -> None:
        # [lo, hi) within the sub-tensor at `prefix` (its first element is flat index `base`).
        if lo == hi:
            return
        ones = (1,) * len(prefix)
        if not dims:
            boxes.append((base, prefix, ones))
            return
        inner = math.prod(dims[1:])
        rest = (0,) * (len(dims) - 1)
        first, last = lo // inner, (hi - 1) // inner  # the rows (first-axis entries) touched
        head, tail = lo - first * inner, hi - last * inner  # where the range starts in `first`, ends in `last`
        if first == last and not (head == 0 and tail == inner):
            split(head, tail, dims[1:], prefix + (first,), base + first * inner)
            return
        full_lo = first if head == 0 else first + 1
        full_hi = last + 1 if tail == inner else last
        if head:
            split(head, inner, dims[1:], prefix + (first,), base + first * inner)
        if full_hi > full_lo:
            boxes.append((base + full_lo * inner, prefix + (full_lo,) + rest, ones + (full_hi - full_lo,) + dims[1:]))
        if tail != inner:
            split(0, tail, dims[1:], prefix + (last,), base + last * inner)

    split(start, stop, shape, (), 0)
    return boxes


def _sub_tensors(meta: Any, key: str, replica_id: tuple) -> list[tuple[int, ShardedTensor]]:
    """(flat start within the parameter, template) of each model-space tensor one parameter maps to,
    in flat order: the parameter's own ShardedTensor, or what its factory builds."""
    if isinstance(meta, ShardedTensor):
        return [(0, replace(meta, key=key, data=None, replica_id=replica_id))]
    if not isinstance(meta, ShardedTensorFactory):
        raise CheckpointError(f"{type(meta).__name__} {getattr(meta, 'key', '?')}: not a model tensor")
    placeholder = torch.empty(tuple(meta.data.shape), dtype=meta.data.dtype, device="meta")
    built = replace(meta, key=key, data=placeholder, replica_id=replica_id).build()
    subs = []
    for sub in nested_values(built):
        data = sub.data
        if not isinstance(sub, ShardedTensor) or sub.flattened_range is not None or not data.is_contiguous():
            raise CheckpointError(
                f"{meta.key}: its checkpoint factory builds a tensor that is not a contiguous part of the parameter; "
                f"the {MODEL_SPACE} optimizer format cannot write it (use fully_reshardable)"
            )
        subs.append((data.storage_offset(), replace(sub, data=None)))
    subs.sort(key=lambda item: item[0])
    covered = sum(math.prod(sub.local_shape) for _, sub in subs)
    if covered != placeholder.numel():
        raise CheckpointError(f"{meta.key}: its checkpoint factory covers {covered} of {placeholder.numel()} elements")
    return subs


def _boxes_of(subs: list[tuple[int, ShardedTensor]], start: int, stop: int, flat: torch.Tensor) -> list[ShardedTensor]:
    """The ShardedTensors of the flat range [start, stop) of one parameter's state (`flat`: its data)."""
    out = []
    for sub_start, sub in subs:
        sub_stop = sub_start + math.prod(sub.local_shape)
        lo, hi = max(start, sub_start), min(stop, sub_stop)
        if lo >= hi:
            continue
        pre = sub.prepend_axis_num
        for box_start, offset, size in flat_range_boxes(lo - sub_start, hi - sub_start, sub.local_shape):
            begin = sub_start + box_start - start
            data = flat[begin : begin + math.prod(size)]
            global_offset = tuple(sub.global_offset[:pre]) + tuple(g + o for g, o in zip(sub.global_offset[pre:], offset))
            local_shape = (1,) * pre + size  # prepended axes folded in: uneven-sharding chunks carry none
            out.append(
                ShardedTensor(
                    key=sub.key, data=data.view(local_shape), dtype=data.dtype, local_shape=local_shape,
                    global_shape=tuple(sub.global_shape), global_offset=global_offset, axis_fragmentations=None,
                    replica_id=sub.replica_id, prepend_axis_num=0, allow_shape_mismatch=sub.allow_shape_mismatch,
                )
            )  # fmt: skip
    if sum(t.data.numel() for t in out) != stop - start:
        raise CheckpointError(f"{subs[0][1].key}: the boxes of [{start}, {stop}) do not cover it")
    return out


def _local_params(opt: Any):
    """(model parameter, its flat range on this DP rank), in the optimizer's own order."""
    for gbuf_range_maps in opt.gbuf_ranges:
        for per_bucket in gbuf_range_maps.values():
            for bucket in per_bucket:
                for model_param, ranges in bucket["param_map"].items():
                    yield model_param, ranges["param"]


def _param_state(opt: Any, model_sharded_state_dict: dict, is_loading: bool) -> dict:
    tensors_and_factories, _ = extract_sharded_tensors_and_factories(model_sharded_state_dict)
    metadata = {sh.data: sh for sh in nested_values(tensors_and_factories)}
    state = {}
    for index, (model_param, param_range) in enumerate(_local_params(opt)):
        meta = metadata.get(model_param)
        if meta is None:
            raise CheckpointError(f"a parameter of shape {tuple(model_param.shape)} is not in the model's sharded state dict")
        if meta.flattened_range is not None or len(meta.replica_id) != 3:
            raise CheckpointError(f"{meta.key}: unexpected model sharding (flattened range, or replica id {meta.replica_id})")
        # The DP coordinate of the replica id is the optimizer instance: every DP rank writes its own part.
        replica_id = (*meta.replica_id[:2], opt.distributed_optimizer_instance_id)
        entry = {}
        for name, tensor in opt._get_main_param_and_optimizer_states(model_param).items():
            if name == "step":  # per-parameter Adam step on the PyTorch path: restored from param_groups
                continue
            flat = tensor.detach().reshape(-1)
            if flat.numel() != param_range.size:
                raise CheckpointError(f"{meta.key}: {name} holds {flat.numel()} elements, its range {param_range.size}")
            if is_loading:
                flat = torch.empty_like(flat)  # loaded into, then copied in by load_model_space_param_state
            subs = _sub_tensors(meta, f"{STATE_PREFIX}.{name}.{meta.key}", replica_id)
            entry[name] = _boxes_of(subs, param_range.start, param_range.end, flat)
        state[index] = entry
    return state


def _inner(optimizer: Any) -> list:
    return list(getattr(optimizer, "chained_optimizers", None) or [optimizer])


def model_space_sharded_state_dict(optimizer: Any, model_sharded_state_dict: dict, is_loading: bool = False) -> Any:
    """What `optimizer.sharded_state_dict(model_sharded_state_dict, is_loading, metadata=...)` returns for
    a `fully_reshardable` format, in this one: per distributed optimizer its common state (param groups,
    grad scaler) and `param_state` (this rank's boxes); a ChainedOptimizer's parts keyed by index,
    without prefix, as Megatron does for its fully reshardable formats."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    inner = _inner(optimizer)
    if len(inner) > 1 and hasattr(optimizer, "_synchronize_steps"):
        optimizer._synchronize_steps()
    parts = []
    for opt in inner:
        if not isinstance(opt, DistributedOptimizer):
            raise CheckpointError(f"the {MODEL_SPACE} format is for distributed optimizers, not {type(opt).__name__}")
        if getattr(opt.ddp_config, "use_megatron_fsdp", False):
            raise CheckpointError(f"the {MODEL_SPACE} format does not support Megatron FSDP")
        state = opt.state_dict()
        if is_loading:
            opt.load_state_dict(opt.state_dict())  # as Megatron does: (re)creates the state loaded into
        state["param_state"] = _param_state(opt, model_sharded_state_dict, is_loading)
        state["param_state_sharding_type"] = MODEL_SPACE
        parts.append(state)
    return parts[0] if len(parts) == 1 else dict(enumerate(parts))


@torch.no_grad()
def load_model_space_param_state(opt: Any, param_state: dict) -> None:
    """Copy the loaded boxes (`param_state`, the loaded `_param_state` structure) into this rank's
    optimizer state; the counterpart of `model_space_sharded_state_dict`."""
    count = 0
    for index, (model_param, param_range) in enumerate(_local_params(opt)):
        loaded = param_state[index]
        tensors = {}
        for name, boxes in loaded.items():
            flat = torch.cat([box.reshape(-1) for box in boxes]) if len(boxes) > 1 else boxes[0].reshape(-1)
            if flat.numel() != param_range.size:
                raise CheckpointError(f"loaded {name} of parameter {index}: {flat.numel()} elements, expected {param_range.size}")
            tensors[name] = flat
        opt._set_main_param_and_optimizer_states(model_param, tensors)
        count += 1
    if count != len(param_state):
        raise CheckpointError(f"the loaded optimizer state holds {len(param_state)} parameters, this rank's shard {count}")
    sync = getattr(opt.optimizer, "_sync_hdo_state_to_sub_optimizers", None)
    if sync is not None:  # HybridDeviceOptimizer (optimizer CPU offload), as Megatron's loaders do
        sync()
