"""Write and read torch_dist checkpoints one tensor chunk at a time, in a single process.

Megatron's torch_dist format is PyTorch Distributed Checkpoint (DCP): a `.metadata` file that maps
every key to its global shape and stored chunks (offset + size), plus data files. A single process
can therefore write a checkpoint for any TP / PP: it stores each tensor with its global shape, and
Megatron's loader reads whichever slice a rank of any layout needs.

Both directions use DCP's public "checkpointable" protocol (`__create_write_items__`,
`__create_chunk_list__`, `__get_tensor_shard__`: what DTensor and Megatron's own
CheckpointableShardedTensor implement):

- `LazyChunkedTensor` describes a global tensor by its chunks; a chunk's data is produced by a
  callback only when DCP's writer asks for it. `write_streaming` saves with one data file per
  chunk (`single_file_per_rank=False`: PyTorch's writer keeps every tensor of a file alive until
  the file is closed) in the order the chunks were declared (`OrderedSavePlanner`), so at most one
  produced tensor is alive at a time and the producer can walk the model layer by layer.
- `ChunkTargets` names the chunks of a stored tensor to read into caller-owned buffers;
  `read_chunks` loads just those (any stored chunking: DCP copies the overlaps).

Nothing here imports Megatron; the files are checked to load with `dist_checkpointing.load`.
"""

from __future__ import annotations

import dataclasses
import os
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence, Union

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

__all__ = ["ChunkTargets", "LazyChunk", "LazyChunkedTensor", "OrderedSavePlanner", "read_chunks", "write_streaming"]


@dataclass(frozen=True)
class LazyChunk:
    """One stored chunk of a global tensor: where it sits and how to produce its data."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    produce: Callable[[], torch.Tensor]
    order: int
    """Position in the write order (lower first)."""


class LazyChunkedTensor(torch.Tensor):
    """A global tensor for DCP saving whose chunks are materialised on demand (see module doc)."""

    @staticmethod
    def __new__(cls, global_shape: Sequence[int], dtype: torch.dtype, chunks: Sequence[LazyChunk]):
        return torch.Tensor._make_wrapper_subclass(cls, torch.Size(global_shape), dtype=dtype)

    def __init__(self, global_shape: Sequence[int], dtype: torch.dtype, chunks: Sequence[LazyChunk]) -> None:
        self._global_shape = torch.Size(global_shape)
        self._dtype = dtype
        self._chunks = list(chunks)
        for chunk in self._chunks:
            if len(chunk.offsets) != len(self._global_shape) or len(chunk.sizes) != len(self._global_shape):
                raise ValueError(f"chunk {chunk.offsets}/{chunk.sizes} does not match global shape {tuple(global_shape)}")
            if any(o + s > g for o, s, g in zip(chunk.offsets, chunk.sizes, self._global_shape)):
                raise ValueError(f"chunk {chunk.offsets}+{chunk.sizes} exceeds global shape {tuple(global_shape)}")

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        raise NotImplementedError(f"{cls.__name__} only describes a tensor for checkpoint writing")

    def __repr__(self) -> str:
        return f"LazyChunkedTensor(shape={tuple(self._global_shape)}, dtype={self._dtype}, chunks={len(self._chunks)})"

    # DCP checkpointable protocol -----------------------------------------------------------------

    def __create_write_items__(self, fqn: str, obj: Any, index: Optional[int] = None) -> list[WriteItem]:
        return [
            WriteItem(
                index=MetadataIndex(fqn, torch.Size(chunk.offsets), i),
                type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(
                    chunk=ChunkStorageMetadata(offsets=torch.Size(chunk.offsets), sizes=torch.Size(chunk.sizes)),
                    properties=TensorProperties(dtype=self._dtype),
                    size=self._global_shape,
                ),
            )
            for i, chunk in enumerate(self._chunks)
        ]

    def __create_chunk_list__(self) -> list[ChunkStorageMetadata]:
        return [ChunkStorageMetadata(torch.Size(c.offsets), torch.Size(c.sizes)) for c in self._chunks]

    def _chunk_at(self, index: MetadataIndex) -> LazyChunk:
        if index.index is not None and index.index < len(self._chunks):
            chunk = self._chunks[index.index]
            if torch.Size(chunk.offsets) == index.offset:
                return chunk
        for chunk in self._chunks:
            if torch.Size(chunk.offsets) == index.offset:
                return chunk
        raise ValueError(f"{index.fqn}: no chunk at offset {tuple(index.offset or ())}")

    def __get_tensor_shard__(self, index: MetadataIndex) -> torch.Tensor:
        chunk = self._chunk_at(index)
        data = chunk.produce()
        if tuple(data.shape) != tuple(chunk.sizes) or data.dtype != self._dtype:
            raise ValueError(
                f"{index.fqn} chunk at {chunk.offsets}: produced {tuple(data.shape)} {data.dtype}, "
                f"declared {tuple(chunk.sizes)} {self._dtype}"
            )
        return data.contiguous()

    def order_of(self, index: MetadataIndex) -> int:
        return self._chunk_at(index).order


class OrderedSavePlanner(DefaultSavePlanner):
    """DCP save planner that writes chunks in their declared order and bytes objects as given.

    Byte objects must already be `io.BytesIO` (like Megatron's planner, no second pickling), which
    is how Megatron stores ShardedObjects.
    """

    def __init__(self) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)

    def _order(self, item: WriteItem) -> int:
        obj = self.state_dict[item.index.fqn]
        return obj.order_of(item.index) if isinstance(obj, LazyChunkedTensor) else -1

    def finish_plan(self, new_plan):
        plan = super().finish_plan(new_plan)
        return dataclasses.replace(plan, items=sorted(plan.items, key=self._order))

    def transform_object(self, write_item: WriteItem, object: Any):
        return object


# DCP warns that it "assumes a single process" when told no_dist=True: that is the intent here.
_SINGLE_PROCESS_WARNING = r"torch\.distributed is disabled, unavailable or uninitialized"


def write_streaming(state_dict: dict[str, Any], directory: Union[str, os.PathLike]) -> None:
    """Save `state_dict` ({key: LazyChunkedTensor or io.BytesIO}) as DCP files in `directory`, in this process."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=_SINGLE_PROCESS_WARNING)
        dcp.save(
            state_dict,
            storage_writer=dcp.FileSystemWriter(str(directory), single_file_per_rank=False, thread_count=1),
            planner=OrderedSavePlanner(),
            no_dist=True,
        )


class ChunkTargets(torch.Tensor):
    """Chunks of a stored global tensor to read, each into a caller-owned buffer."""

    @staticmethod
    def __new__(cls, global_shape: Sequence[int], dtype: torch.dtype, targets: Sequence[tuple[Sequence[int], torch.Tensor]]):
        return torch.Tensor._make_wrapper_subclass(cls, torch.Size(global_shape), dtype=dtype)

    def __init__(self, global_shape, dtype, targets) -> None:
        self._targets = [(torch.Size(offsets), buffer) for offsets, buffer in targets]

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        raise NotImplementedError(f"{cls.__name__} only describes read targets")

    def __create_chunk_list__(self) -> list[ChunkStorageMetadata]:
        return [ChunkStorageMetadata(offsets, buffer.shape) for offsets, buffer in self._targets]

    def __get_tensor_shard__(self, index: MetadataIndex) -> torch.Tensor:
        for offsets, buffer in self._targets:
            if offsets == index.offset:
                return buffer
        raise ValueError(f"{index.fqn}: no read target at offset {tuple(index.offset or ())}")


def read_chunks(directory: Union[str, os.PathLike], requests: dict[str, ChunkTargets]) -> None:
    """Fill the buffers of `requests` ({key: ChunkTargets}) from the checkpoint in `directory`."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=_SINGLE_PROCESS_WARNING)
        dcp.load(
            requests,
            storage_reader=dcp.FileSystemReader(str(directory)),
            planner=DefaultLoadPlanner(allow_partial_load=True),
            no_dist=True,
        )
