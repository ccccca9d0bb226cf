"""Buckets of tensors, the one rule every weight path uses (sync, vLLM, SGLang, the hand-over).

A weight update streams (name, tensor) pairs; holding the whole model at once would double its
memory, so the stream is cut into buckets of at most N bytes and each bucket is delivered before
the next is filled. A tensor larger than a bucket travels alone. `write_safetensors` writes one
bucket as a safetensors file without a serialised copy in memory (the vLLM leader placement hands
buckets to its worker processes that way, through /dev/shm).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Optional, Sequence, Union

import torch

from megatron_dapo.safetensors_format import safetensors_header

__all__ = ["bucket_stream", "host_tensor", "iter_buckets", "tensor_item_nbytes", "write_safetensors"]


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


def host_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous CPU tensor with the same values (no copy when it already is one)."""
    return tensor.detach().to("cpu").contiguous()


def _dtype_changes(previous: tuple[str, torch.Tensor], item: tuple[str, torch.Tensor]) -> bool:
    return previous[1].dtype != item[1].dtype


def iter_buckets(
    weights: Iterable[tuple[str, torch.Tensor]],
    bucket_bytes: int,
    device: Union[str, torch.device] = "cpu",
    split_on_dtype: bool = False,
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """`bucket_stream` of (name, tensor) pairs moved to `device` (contiguous) as they are taken.

    At most one bucket is held at a time. With `split_on_dtype` a bucket never mixes dtypes (for
    consumers that need one, e.g. SGLang's flattened buckets).
    """
    moved = ((name, tensor.detach().to(device).contiguous()) for name, tensor in weights)
    return bucket_stream(moved, bucket_bytes, starts_new_bucket=_dtype_changes if split_on_dtype else None)


def write_safetensors(path: Path, tensors: Sequence[tuple[str, torch.Tensor]]) -> None:
    """Write CPU tensors as one safetensors file, one tensor at a time (no serialised copy in memory).

    `safetensors.torch.save_file` first turns every tensor into a bytes object (a second copy of
    the bucket) and refuses tensors that share storage (e.g. q/k/v views of one fused tensor);
    writing the format directly (`safetensors_format`) avoids both.
    """
    prefix, _ = safetensors_header((name, tensor.dtype, tuple(tensor.shape)) for name, tensor in tensors)
    with open(path, "wb") as handle:
        handle.write(prefix)
        for _, tensor in tensors:
            if tensor.numel():
                # A byte view of the tensor's own memory: nothing is copied on the way to the file.
                handle.write(memoryview(tensor.reshape(-1).view(torch.uint8).numpy()))
