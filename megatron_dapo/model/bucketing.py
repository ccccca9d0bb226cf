"""Buckets of tensors, the one rule every weight path uses (sync, vLLM, SGLang, the hand-over).

A weight update streams (name, tensor) pairs; holding the whole model at once would double its
memory, so the stream is cut into buckets of at most N bytes and each bucket is delivered before
the next is filled. A tensor larger than a bucket travels alone.

Where a bucket is held (`bucket_device`): an engine in this process (vLLM's SPMD placement) takes
the tensors where its parameters are, so on a GPU the push never touches host memory; a bucket
file (vLLM's leader placement hands buckets to its worker processes through /dev/shm) is written
by `write_safetensors` straight from each tensor's own device into the file's pages, so the file
is the one host copy (no staging copy, no serialised copy, no contiguous copy of strided views).
"""

from __future__ import annotations

import mmap
import os
import shutil
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Optional, Sequence, Union

import torch

from megatron_dapo.model.safetensors_format import safetensors_header

__all__ = [
    "DEFAULT_BUCKET_MB",
    "bucket_device",
    "bucket_limit_bytes",
    "bucket_stream",
    "iter_buckets",
    "reserve_file_space",
    "tensor_item_nbytes",
    "write_safetensors",
]

DEFAULT_BUCKET_MB = 512
"""Bucket size of a weight stream when none is given (`rollout.weight_sync_bucket_mb`'s default)."""
MIB = 1 << 20


def bucket_limit_bytes(bucket_mb: float) -> int:
    """`rollout.weight_sync_bucket_mb` in bytes (at least 1); refuses a size that is not positive."""
    if not bucket_mb > 0:
        raise ValueError(f"bucket size must be > 0 MB, got {bucket_mb} (rollout.weight_sync_bucket_mb)")
    return max(1, int(bucket_mb * MIB))


def tensor_item_nbytes(item: Any) -> int:
    """Bytes of a (name, tensor) pair, or of anything with a `.tensor` (an `EngineShard`)."""
    tensor = item.tensor if hasattr(item, "tensor") else item[1]
    return tensor.numel() * tensor.element_size()


def bucket_stream(
    items: Iterable[Any],
    bucket_bytes: int,
    size_of: Callable[[Any], int] = tensor_item_nbytes,
    starts_new_bucket: Optional[Callable[[Any, Any], bool]] = None,
) -> Iterator[list[Any]]:
    """Group a stream of (name, tensor) pairs (or `EngineShard`s) into lists of at most `bucket_bytes`.

    Order is kept. An item larger than `bucket_bytes` forms a bucket of its own. Only the bucket
    being filled is held, so the caller must finish with one bucket before asking for the next.
    `size_of` measures an item (default: its tensor's bytes); `starts_new_bucket(previous, item)`
    may force a cut besides the size (e.g. a change of dtype).
    """
    bucket: list[Any] = []
    size = 0
    for item in items:
        nbytes = size_of(item)
        cut = starts_new_bucket is not None and bucket and starts_new_bucket(bucket[-1], item)
        if bucket and (size + nbytes > bucket_bytes or cut):
            yield bucket
            bucket, size = [], 0
        bucket.append(item)
        size += nbytes
    if bucket:
        yield bucket


def bucket_device(in_process: bool, engine_device: Optional[torch.device]) -> Optional[torch.device]:
    """Where a weight bucket is held on its way into an engine; None: where each tensor already is. Pure.

    `in_process`: the engine's model lives in this process (vLLM's SPMD placement) and its loaders
    copy each tensor into a parameter on `engine_device`. The bucket is held there: on a GPU the
    exported tensors already are, so nothing moves, and nothing goes through host memory.
    Otherwise the engine is reached through a file in shared memory (vLLM's leader placement), which
    `write_safetensors` fills from each tensor's own device: the file is the host copy, so the
    bucket stays put (None).
    """
    if not in_process:
        return None
    if engine_device is None:
        raise ValueError("an in-process engine needs its parameters' device to receive weight buckets")
    return torch.device(engine_device)


def _dtype_changes(previous: tuple[str, torch.Tensor], item: tuple[str, torch.Tensor]) -> bool:
    return previous[1].dtype != item[1].dtype


def iter_buckets(
    weights: Iterable[tuple[str, torch.Tensor]],
    bucket_bytes: int,
    device: Union[None, str, torch.device] = None,
    split_on_dtype: bool = False,
    contiguous: bool = True,
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """`bucket_stream` of (name, tensor) pairs, moved to `device` as they are taken (None: left where they are).

    At most one bucket is held at a time. Moving and `contiguous` copy only tensors that are not
    already so. With `split_on_dtype` a bucket never mixes dtypes (for consumers that need one, e.g.
    SGLang's flattened buckets). Consumers that copy each tensor into place (vLLM's loaders,
    `write_safetensors`) take strided views as they are: `contiguous=False`.
    """

    def moved(tensor: torch.Tensor) -> torch.Tensor:
        tensor = tensor.detach() if device is None else tensor.detach().to(device)
        return tensor.contiguous() if contiguous else tensor

    items = ((name, moved(tensor)) for name, tensor in weights)
    return bucket_stream(items, bucket_bytes, starts_new_bucket=_dtype_changes if split_on_dtype else None)


def reserve_file_space(descriptor: int, total: int, path: Union[str, Path], what_to_change: str) -> None:
    """Size an open file to `total` bytes and reserve its pages (tmpfs: /dev/shm).

    A memory-mapped file on a full tmpfs kills the writer with SIGBUS at the first page that cannot
    be backed; reserving first raises an OSError here instead, naming the space and `what_to_change`.
    """
    os.ftruncate(descriptor, total)
    if not hasattr(os, "posix_fallocate"):  # not Linux: a full disk shows at the first write
        return
    try:
        os.posix_fallocate(descriptor, 0, total)
    except OSError as error:
        directory = os.path.dirname(os.fspath(path)) or "."
        free = shutil.disk_usage(directory).free
        raise OSError(
            error.errno,
            f"cannot reserve {total / 2**20:.0f} MiB for a weight bucket in {directory} ({free / 2**20:.0f} MiB free): {what_to_change}",
        ) from error


def write_safetensors(path: Path, tensors: Sequence[tuple[str, torch.Tensor]]) -> None:
    """Write tensors (any device, any strides) as one safetensors file: each copied once, into the file.

    The file is memory-mapped and each tensor copied into its place (from a GPU: one device-to-host
    copy, straight into the file's pages). `safetensors.torch.save_file` would first turn every
    tensor into a bytes object (a second copy of the bucket) and refuses tensors that share storage
    (e.g. q/k/v views of one fused tensor); writing the format directly (`safetensors_format`)
    avoids both.
    """
    tensors = list(tensors)
    prefix, spans = safetensors_header((name, tensor.dtype, tuple(tensor.shape)) for name, tensor in tensors)
    total = len(prefix) + (spans[-1][1] if spans else 0)
    descriptor = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        reserve_file_space(
            descriptor, total, path, "lower rollout.weight_sync_bucket_mb or give the container more shared memory (docker --shm-size)"
        )
        os.pwrite(descriptor, prefix, 0)
        if total == len(prefix):
            return
        mapped = mmap.mmap(descriptor, total)
        try:
            for (_, tensor), (begin, end) in zip(tensors, spans):
                if end > begin:
                    region = torch.frombuffer(mapped, dtype=torch.uint8, count=end - begin, offset=len(prefix) + begin)
                    region.view(tensor.dtype).view(tensor.shape).copy_(tensor.detach())
                    del region  # release the map's buffer before it is closed
        finally:
            mapped.close()
    finally:
        os.close(descriptor)
