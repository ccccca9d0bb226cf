"""Hand the actor's TP shards to the rollout engine through the node's shared memory: no TP gather.

    transport = SharedMemoryShards.create(engine_or_None, tp_group)     # every rank of the TP group
    sync_weights(models, hf_cfg, transport, bucket_mb=512)
    transport.close()

The gather path (`gather.py`, transport `dispatch.FullTensors`) all-gathers every parameter's TP
shards onto every TP rank, and then the engine's owner alone moves the full tensors into the
engine. Here each TP rank of the owner's TP group writes only its OWN slices (`EngineShard`s: the
HF-named pieces of its Megatron shard, with their place in the full HF tensor) straight into one
bucket file in /dev/shm, at the byte positions they occupy in the full tensors. The file is a
safetensors file: its header depends only on the bucket's names, dtypes and full shapes, which
every TP rank knows, so rank 0 writes the header while all ranks write their slices in parallel
through a shared memory map. After a barrier the owner hands the complete file to the engine:
vLLM's workers read it themselves (`VLLMEngine.load_weights_file`), any other engine receives the
tensors through `load_weights`. The engine's own loaders take the part their shard needs, so an
engine's TP size need not equal the actor's, and vocabularies padded differently (Megatron's
`make_vocab_size_divisible_by` x TP versus vLLM's 64) cost nothing: the rows sit at their places.

What moves: each rank writes 1/TP of every split tensor (replicated ones, the norms, only by TP
rank 0); no rank ever holds a full copy of a split parameter; the only TP communication is two
small synchronisations per bucket. The file of one bucket is the only extra memory, and the owner
removes it once the engine has it, before any rank starts the next one (peak = one bucket).

Requirements: the TP group shares one node (/dev/shm is per node; `distributed.placement.choose_sync_mode` checks host names
and otherwise keeps the gather path). On GPUs each rank copies its shards to host memory (in
parallel), which is where vLLM's leader-placement workers read weights from anyway. SGLang on a
GPU takes CUDA IPC handles of gathered tensors instead, and the embedded engine loads them in its
own process: `auto` gives both the gather path on GPUs (no round trip through host memory).
"""

from __future__ import annotations

import mmap
import os
import shutil
import tempfile
import weakref
from pathlib import Path
from typing import Any, Iterable, Iterator, Optional, Sequence

import torch
import torch.distributed as dist
from safetensors import safe_open

from megatron_dapo.distributed.objects import broadcast_object, gather_objects
from megatron_dapo.model.bucketing import reserve_file_space
from megatron_dapo.model.safetensors_format import safetensors_header
from megatron_dapo.rollout.sync.dispatch import OwnShards
from megatron_dapo.rollout.sync.shards import EngineShard

__all__ = [
    "SharedMemoryHandover",
    "SharedMemoryShards",
    "bucket_file_entries",
    "iter_safetensors",
    "shared_memory_root",
    "write_shards_into_bucket_file",
]


def shared_memory_root() -> str:
    """/dev/shm when it exists and is writable (files there live in RAM), else the temporary directory."""
    return "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else tempfile.gettempdir()


def bucket_file_entries(shards: Sequence[EngineShard]) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
    """(name, dtype, full shape) of each tensor of a bucket: the same on every TP rank."""
    return [(shard.name, shard.tensor.dtype, shard.full_shape) for shard in shards]


def write_shards_into_bucket_file(path: Path, shards: Sequence[EngineShard], tp_rank: int) -> None:
    """Write this TP rank's slices of a bucket into the bucket's safetensors file at `path`.

    Every TP rank calls it with its own shards of the same bucket (same names, dtypes, full shapes);
    concurrent calls are safe: each creates or opens the file, sizes it to the same length and
    writes disjoint bytes. TP rank 0 writes the header and the replicated tensors. The file is
    complete when every rank has returned.
    """
    prefix, spans = safetensors_header(bucket_file_entries(shards))
    total = len(prefix) + (spans[-1][1] if spans else 0)
    descriptor = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        # The same size on every rank (idempotent); a full /dev/shm raises here, not SIGBUS later.
        reserve_file_space(
            descriptor, total, path,
            "lower rollout.weight_sync_bucket_mb, give the container more shared memory (docker --shm-size) or use rollout.weight_sync_mode=gather",
        )  # fmt: skip
        if tp_rank == 0:
            os.pwrite(descriptor, prefix, 0)
        mapped = mmap.mmap(descriptor, total)
        try:
            for shard, (begin, end) in zip(shards, spans):
                if shard.tensor.numel() == 0 or (shard.dim is None and tp_rank != 0):
                    continue
                region = torch.frombuffer(mapped, dtype=torch.uint8, count=end - begin, offset=len(prefix) + begin)
                full = region.view(shard.tensor.dtype).view(shard.full_shape)
                target = full if shard.dim is None else full.narrow(shard.dim, shard.start, shard.tensor.shape[shard.dim])
                target.copy_(shard.tensor)
                del region, full, target  # release the map's buffer before it is closed
        finally:
            mapped.close()
    finally:
        os.close(descriptor)


def iter_safetensors(path: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """The (name, tensor) pairs of a safetensors file, read one at a time (in name order)."""
    with safe_open(str(path), framework="pt", device="cpu") as handle:
        for name in handle.keys():
            yield name, handle.get_tensor(name)


def load_bucket_file(engine: Any, path: Path) -> None:
    """Give one complete bucket file to an engine: by path where it reads files itself (vLLM)."""
    load_file = getattr(engine, "load_weights_file", None)
    if load_file is not None:
        load_file(path)
    else:
        engine.load_weights(iter_safetensors(path))


def _remove_directory(directory: Path) -> None:
    shutil.rmtree(directory, ignore_errors=True)


def _first_rank(group: Optional[dist.ProcessGroup]) -> int:
    """Global rank of the group's rank 0 (the owner)."""
    return dist.get_process_group_ranks(group)[0] if group is not None else 0


class SharedMemoryHandover:
    """One TP group's shard path into its engine (the `dispatch.ShardLoadingEngine` of `SharedMemoryShards`).

    Exists on every rank of the TP group that holds the engine's owner; TP group rank 0 is the owner
    (it creates the bucket directory, gives files to the engine and removes them). The owner may
    have no engine (a data-parallel replica that only checks, as in `check-sync`): files are then
    written and removed, and nothing is loaded.
    """

    def __init__(self, engine: Any, group: Optional[dist.ProcessGroup], directory: Path) -> None:
        self.engine = engine
        self.group = group
        self.directory = Path(directory)
        self.group_rank = dist.get_rank(group)
        self.owner_rank = _first_rank(group)
        self._count = 0
        self._cleanup = weakref.finalize(self, _remove_directory, self.directory) if self.is_owner else None

    @property
    def is_owner(self) -> bool:
        return self.group_rank == 0

    @classmethod
    def create(cls, engine: Any, group: Optional[dist.ProcessGroup]) -> "SharedMemoryHandover":
        """Collective over `group`: the owner (group rank 0) makes the directory, everyone learns it."""
        group_rank = dist.get_rank(group)
        if engine is not None and group_rank != 0:
            raise ValueError(f"the engine must live on rank 0 of its TP group, not on group rank {group_rank}")
        directory = tempfile.mkdtemp(prefix="megatron_dapo_shards_", dir=shared_memory_root()) if group_rank == 0 else None
        directory = broadcast_object(directory, src=_first_rank(group), group=group)
        return cls(engine, group, Path(directory))

    def load_weight_shards(self, shards: Iterable[EngineShard]) -> None:
        """Collective over the TP group: every rank writes its slices, the owner's engine takes the file."""
        shards = list(shards)
        path = self.directory / f"bucket{self._count:06d}.safetensors"
        self._count += 1
        error = None
        try:
            write_shards_into_bucket_file(path, shards, self.group_rank)
        except OSError as failure:
            error = f"TP rank {self.group_rank}: {failure}"
        # Everyone's outcome doubles as the first barrier: every slice is in the file, or all ranks
        # learn why not (a rank that failed alone would leave the others waiting for the timeout).
        errors = [e for e in gather_objects(error, self.group) if e is not None]
        if errors:
            if self.is_owner:
                path.unlink(missing_ok=True)
            raise RuntimeError(f"could not write a weight bucket to shared memory: {errors[0]}")
        if self.is_owner:
            try:
                if self.engine is not None:
                    load_bucket_file(self.engine, path)
            except Exception as failure:  # noqa: BLE001 - every rank raises it below
                error = f"{type(failure).__name__}: {failure}"
            finally:
                path.unlink(missing_ok=True)
        # The owner's verdict doubles as the second barrier: nobody writes the next bucket while
        # this file still exists, and a failed load fails every rank now, not at the next timeout.
        error = broadcast_object(error, src=self.owner_rank, group=self.group)
        if error is not None:
            raise RuntimeError(f"the rollout engine could not load a weight bucket: {error}")

    def commit_weights(self) -> None:
        """Let the engine finish the update (vLLM: re-process the last layers)."""
        commit = getattr(self.engine, "commit_weights", None)
        if commit is not None:
            commit()

    def close(self) -> None:
        """Remove the bucket directory (owner); idempotent."""
        if self._cleanup is not None:
            self._cleanup()


class SharedMemoryShards(OwnShards):
    """The weight-sync mode "shared_memory": own slices through a bucket file in /dev/shm."""

    mode = "shared_memory"

    @classmethod
    def create(cls, engine: Any, group: Optional[dist.ProcessGroup], takes_part: bool = True) -> "SharedMemoryShards":
        """Collective over `group` (the TP group of the engine's owner) where `takes_part`: the ranks of
        the first pipeline stage and CP rank 0, which hold the slices the file is made of. Elsewhere
        (`takes_part` False) the rank streams for the export's collectives and delivers nothing."""
        return cls(SharedMemoryHandover.create(engine, group) if takes_part else None)
