"""What Megatron's checkpoint of an HF model looks like, asked from Megatron itself.

Conversion must write exactly the keys, global shapes, chunks and objects that
`GPTModel.sharded_state_dict()` asks for when loading. Rather than re-deriving Megatron's naming
rules (TE-style keys for the local layer spec, layers stacked along a leading axis, the SwiGLU
`linear_fc1` split into gate and up chunks, `_extra_state` objects), `checkpoint_template` builds
the model at TP=1 / PP=1 with every parameter on the meta device (no memory, no initialisation),
asks it for its sharded state dict, and describes every entry per parameter:

    template = checkpoint_template(hf_cfg, dtype)     # needs Megatron's parallel state at TP=PP=1
    template.params["decoder.layers.3.mlp.linear_fc1.weight"]  -> [ChunkSpec(gate rows), ChunkSpec(up rows)]
    template.objects  -> Megatron ShardedObjects (per-layer `_extra_state`), written as they are

At TP=1 a parameter's global tensor (without the stacked layer axis) is the parameter itself, so a
chunk is "this region of the full TP=1 Megatron parameter, stored at this global offset".
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Iterator

import torch
from megatron.core.dist_checkpointing.dict_utils import nested_values
from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor, apply_factories

from megatron_dapo.model.hf_config import HFModelConfig
from megatron_dapo.distributed.layout import ParallelLayout
from megatron_dapo.model.builder import build_gpt_models, check_against_hf

__all__ = ["CheckpointTemplate", "ChunkSpec", "checkpoint_template", "parameters_on_meta"]


@dataclass(frozen=True)
class ChunkSpec:
    """One ShardedTensor of a TP=1 model: a box of a parameter stored at a global offset."""

    key: str
    global_shape: tuple[int, ...]
    global_offset: tuple[int, ...]
    prepend_axis_num: int
    param_offset: tuple[int, ...]
    """Where the chunk starts inside the TP=1 parameter."""
    param_sizes: tuple[int, ...]
    allow_shape_mismatch: bool

    @property
    def stored_sizes(self) -> tuple[int, ...]:
        """Chunk sizes in the global tensor (stacked axes have size 1)."""
        return (1,) * self.prepend_axis_num + self.param_sizes

    def param_region(self) -> tuple[slice, ...]:
        return tuple(slice(o, o + s) for o, s in zip(self.param_offset, self.param_sizes))


@dataclass
class CheckpointTemplate:
    params: dict[str, list[ChunkSpec]]
    """Megatron parameter name (local layer spec, TP=1 / PP=1) -> its chunks."""
    param_shapes: dict[str, tuple[int, ...]]
    objects: list
    """Megatron ShardedObjects to store (`unique_key`, `data`)."""


@contextlib.contextmanager
def parameters_on_meta() -> Iterator[None]:
    """Every nn.Parameter registered inside the block lives on the meta device.

    Buffers (RoPE frequencies) stay real. Each parameter is allocated for an instant before it is
    moved (Megatron creates it with `torch.empty`, then registers it), so the peak is the largest
    single parameter, not the model.
    """
    original = torch.nn.Module.register_parameter

    def register_on_meta(module, name, param):
        if param is not None and param.device.type != "meta":
            # Megatron tags parameters (tensor_model_parallel, partition_dim ...) through the
            # module attribute after assigning it, so the tags land on the meta parameter.
            param = torch.nn.Parameter(param.data.to("meta"), requires_grad=param.requires_grad)
        original(module, name, param)

    torch.nn.Module.register_parameter = register_on_meta
    try:
        yield
    finally:
        torch.nn.Module.register_parameter = original


def _box_offset(view: torch.Tensor, base: torch.Tensor) -> tuple[int, ...]:
    """Start index of `view` inside contiguous `base` (views are boxes: chunks along one axis)."""
    if not base.is_contiguous():
        raise ValueError("template parameter is not contiguous")
    remainder = view.storage_offset() - base.storage_offset()
    offset = []
    for stride in base.stride():
        offset.append(remainder // stride)
        remainder %= stride
    if any(o + s > b for o, s, b in zip(offset, view.shape, base.shape)):
        raise ValueError(f"view at {offset} of shape {tuple(view.shape)} does not fit the parameter {tuple(base.shape)}")
    return tuple(offset)


def checkpoint_template(cfg: HFModelConfig, dtype: torch.dtype = torch.float32) -> CheckpointTemplate:
    """Describe the TP=1 / PP=1 Megatron checkpoint of model `cfg` (Megatron state must be TP=PP=1).

    Raises ValueError (from `check_against_hf`) if the model Megatron builds differs from the config.
    """
    with parameters_on_meta():
        (model,) = build_gpt_models(cfg, ParallelLayout(1, 1), dtype, transformer_engine="off", init_weights=False)
    check_against_hf([model], cfg)  # the model Megatron built is the one config.json describes
    params = dict(model.named_parameters())
    sharded = model.sharded_state_dict()
    apply_factories(sharded)
    chunks: dict[str, list[ChunkSpec]] = {}
    objects = []
    for name, entry in sharded.items():
        for value in nested_values({name: entry}):
            if isinstance(value, ShardedObject):
                objects.append(value)
                continue
            if not isinstance(value, ShardedTensor):
                raise TypeError(f"unexpected {type(value).__name__} for {name} in Megatron's sharded state dict")
            if name not in params:
                raise KeyError(f"sharded state dict entry {name} is not a parameter of the model")
            chunks.setdefault(name, []).append(
                ChunkSpec(
                    key=value.key,
                    global_shape=tuple(value.global_shape),
                    global_offset=tuple(value.global_offset),
                    prepend_axis_num=value.prepend_axis_num,
                    param_offset=_box_offset(value.data, params[name]),
                    param_sizes=tuple(value.local_shape),
                    allow_shape_mismatch=value.allow_shape_mismatch,
                )
            )
    missing = sorted(set(params) - set(chunks))
    if missing:
        raise ValueError(f"parameters absent from Megatron's sharded state dict: {missing}")
    return CheckpointTemplate(
        params=chunks,
        param_shapes={name: tuple(p.shape) for name, p in params.items()},
        objects=objects,
    )
