"""The safetensors file layout, written without the safetensors library's in-memory copy.

    prefix, spans = safetensors_header([("w", torch.float32, (4, 8)), ("b", torch.float32, (4,))])
    # file = prefix + data; tensor i lives at bytes [len(prefix) + spans[i][0], len(prefix) + spans[i][1])

One header builder for every writer in the project (checkpoint conversion streams tensors one by
one; the vLLM adapter writes weight buckets to /dev/shm; TP ranks fill one shared bucket file
slice by slice). Layout: 8-byte little-endian header length, a JSON header
{name: {dtype, shape, data_offsets}} padded with spaces to a multiple of 8 bytes (so the data
starts 8-byte aligned), then the tensors' bytes back to back in the declared order with no holes
(the safetensors reader refuses files with holes). The header depends only on the names, dtypes
and shapes given, so independent processes that describe the same tensors build the same bytes.
"""

from __future__ import annotations

import json
from typing import Any, Iterable, Optional

import torch

__all__ = ["SAFETENSORS_DTYPES", "safetensors_header", "tensor_nbytes"]

SAFETENSORS_DTYPES: dict[torch.dtype, str] = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
}


def tensor_nbytes(dtype: torch.dtype, shape: Iterable[int]) -> int:
    """Bytes of a dense tensor of this dtype and shape."""
    count = 1
    for size in shape:
        count *= int(size)
    return count * dtype.itemsize


def safetensors_header(
    entries: Iterable[tuple[str, torch.dtype, tuple[int, ...]]], metadata: Optional[dict[str, str]] = None
) -> tuple[bytes, list[tuple[int, int]]]:
    """The file prefix (length + padded JSON header) and each entry's [begin, end) in the data section.

    `entries` are (name, dtype, shape) in file order. Raises ValueError on a repeated name and
    TypeError on a dtype safetensors cannot store.
    """
    header: dict[str, Any] = {}
    if metadata:
        header["__metadata__"] = dict(metadata)
    spans: list[tuple[int, int]] = []
    offset = 0
    for name, dtype, shape in entries:
        if name in header:
            raise ValueError(f"tensor {name!r} appears twice in one safetensors file")
        if dtype not in SAFETENSORS_DTYPES:
            raise TypeError(f"tensor {name!r} has dtype {dtype}, which safetensors cannot store")
        nbytes = tensor_nbytes(dtype, shape)
        header[name] = {"dtype": SAFETENSORS_DTYPES[dtype], "shape": [int(s) for s in shape], "data_offsets": [offset, offset + nbytes]}
        spans.append((offset, offset + nbytes))
        offset += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return len(raw).to_bytes(8, "little") + raw, spans
