"""Stream tensors out of a HuggingFace safetensors directory without loading the whole model.

    with HFWeightReader(hf_dir) as reader:
        q = reader.get("model.layers.0.self_attn.q_proj.weight")

Handles a single `model.safetensors` and a sharded `model.safetensors.index.json` + shards. Tensors
are read lazily by name through `safe_open` (memory-mapped); at most one shard file is open at a
time, so a rank that needs only its pipeline stage reads only those bytes.

A truncated, empty or overwritten file is a `ModelFileError` naming the file, never the safetensors
library's bare `SafetensorError`; `check_weight_files` finds such files from their headers alone
(a few KB per file), so start-up can refuse them before anything is built.
"""

from __future__ import annotations

import json
import os
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Iterable, Iterator, Optional, Union

from safetensors import SafetensorError, safe_open

from megatron_dapo.model.hf_config import ModelFileError

if TYPE_CHECKING:  # torch loads with the first tensor read: the header checks of the pre-flight need none
    import torch

__all__ = ["HFWeightReader", "check_safetensors_file", "check_weight_files", "open_safetensors"]

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
_FIX = "copy or download it again"
_MAX_HEADER_BYTES = 100_000_000  # the safetensors library's own limit


class HFWeightReader:
    """Lazy, name-addressed access to the tensors of an HF checkpoint directory."""

    def __init__(self, hf_dir: Union[str, os.PathLike]) -> None:
        self.hf_dir = Path(hf_dir)
        index = self.hf_dir / INDEX_FILE
        single = self.hf_dir / SINGLE_FILE
        self._file_of: dict[str, str] = {}
        if index.is_file():
            self._file_of = _read_weight_map(index)
        elif single.is_file():
            with open_safetensors(single) as handle:
                self._file_of = {name: SINGLE_FILE for name in handle.keys()}
        else:
            raise FileNotFoundError(f"no {SINGLE_FILE} or {INDEX_FILE} in {self.hf_dir}")
        missing = sorted({f for f in self._file_of.values() if not (self.hf_dir / f).is_file()})
        if missing:
            raise FileNotFoundError(f"{self.hf_dir}: the index names missing shard files {missing}")
        self._open_name: Optional[str] = None
        self._open_handle = None

    # ------------------------------------------------------------------ access

    def names(self) -> list[str]:
        """All tensor names, sorted."""
        return sorted(self._file_of)

    def __contains__(self, name: str) -> bool:
        return name in self._file_of

    def file_of(self, name: str) -> str:
        return self._file_of[name]

    def _handle(self, filename: str):
        if self._open_name != filename:
            self.close()
            path = self.hf_dir / filename
            try:
                self._open_handle = safe_open(str(path), framework="pt").__enter__()
            except SafetensorError as error:
                raise _damaged(path, error) from None
            self._open_name = filename
        return self._open_handle

    def get(self, name: str) -> torch.Tensor:
        """One tensor by name (a fresh CPU tensor)."""
        try:
            filename = self._file_of[name]
        except KeyError:
            raise KeyError(f"{name!r} is not in the checkpoint at {self.hf_dir}") from None
        handle = self._handle(filename)
        try:
            return handle.get_tensor(name)
        except SafetensorError as error:
            raise _damaged(self.hf_dir / filename, error) from None

    def get_slice(self, name: str):
        """One tensor as safetensors' lazy slice: ``.get_shape()``, and ``[index]`` (basic slices) reads only
        those elements into a fresh CPU tensor. Read it before asking for a tensor of another shard file."""
        try:
            filename = self._file_of[name]
        except KeyError:
            raise KeyError(f"{name!r} is not in the checkpoint at {self.hf_dir}") from None
        return self._handle(filename).get_slice(name)

    def iter_tensors(self, names: Optional[Iterable[str]] = None) -> Iterator[tuple[str, torch.Tensor]]:
        """(name, tensor) for `names` (default: all), grouped by shard so each file is opened once."""
        wanted = self.names() if names is None else list(names)
        for name in sorted(wanted, key=lambda n: (self._file_of[n], n)):
            yield name, self.get(name)

    # ------------------------------------------------------------------ lifetime

    def close(self) -> None:
        if self._open_handle is not None:
            self._open_handle.__exit__(None, None, None)
        self._open_handle = None
        self._open_name = None

    def __enter__(self) -> "HFWeightReader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


# ---------------------------------------------------------------------------------------------
# Damaged files: named errors, and a check from the headers alone
# ---------------------------------------------------------------------------------------------


def _damaged(path: Path, error: Exception) -> ModelFileError:
    return ModelFileError(f"{path} is not a readable safetensors file ({error}): it is cut short or overwritten; {_FIX}")


@contextmanager
def open_safetensors(path: Union[str, os.PathLike]):
    """`safe_open(path)` whose failures (truncated, empty, overwritten file) are a ModelFileError naming it."""
    path = Path(path)
    try:
        handle = safe_open(str(path), framework="pt")
    except SafetensorError as error:
        raise _damaged(path, error) from None
    with handle as opened:
        try:
            yield opened
        except SafetensorError as error:
            raise _damaged(path, error) from None


def _read_weight_map(index: Path) -> dict[str, str]:
    try:
        weight_map = json.loads(index.read_text(encoding="utf-8")).get("weight_map")
    except (json.JSONDecodeError, UnicodeDecodeError, AttributeError) as error:
        raise ModelFileError(f"{index} is not a JSON object with a weight_map ({error}): it is damaged; {_FIX}") from None
    if not isinstance(weight_map, dict) or not weight_map:
        raise ModelFileError(f"{index} has no weight_map: it is damaged; {_FIX}")
    return dict(weight_map)


def check_safetensors_file(path: Union[str, os.PathLike]) -> list[str]:
    """The tensor names of a safetensors file, after checking that its header parses and that the
    file is exactly as long as the header says (what a truncated, empty or overwritten file fails).

    Reads the 8-byte length and the JSON header only. Raises ModelFileError naming the file.
    """
    path = Path(path)
    size = path.stat().st_size
    if size < 8:
        raise ModelFileError(f"{path} has {size} bytes, too few for a safetensors file: it is empty or cut short; {_FIX}")
    with open(path, "rb") as handle:
        header_bytes = int.from_bytes(handle.read(8), "little")
        if not 2 <= header_bytes <= min(_MAX_HEADER_BYTES, size - 8):
            raise ModelFileError(
                f"{path}: its first 8 bytes announce a header of {header_bytes} bytes in a file of {size} bytes"
                f": it is cut short or overwritten; {_FIX}"
            )
        raw = handle.read(header_bytes)
    try:
        header = json.loads(raw)
        if not isinstance(header, dict):
            raise ValueError(f"a JSON {type(header).__name__}, not an object")
        end = 0
        for name, entry in header.items():
            if name != "__metadata__":
                begin, stop = entry["data_offsets"]
                if not 0 <= int(begin) <= int(stop):
                    raise ValueError(f"tensor {name!r} has data_offsets {entry['data_offsets']}")
                end = max(end, int(stop))
    except (ValueError, UnicodeDecodeError, TypeError, KeyError) as error:
        raise ModelFileError(f"{path}: the header is not a valid safetensors header ({error}): it is overwritten; {_FIX}") from None
    expected = 8 + header_bytes + end
    if size != expected:
        shape = "is cut short" if size < expected else "has trailing bytes"
        raise ModelFileError(f"{path} has {size} bytes but its header describes {expected}: it {shape}; {_FIX}")
    return [name for name in header if name != "__metadata__"]


def check_weight_files(hf_dir: Union[str, os.PathLike]) -> int:
    """Check every weight file of an HF model directory from its header (`check_safetensors_file`),
    and that the index's tensors are in the shards it names. Returns the number of tensors.

    FileNotFoundError when there are no weights (or an index names a missing shard); ModelFileError
    naming the file for anything damaged. Cheap: a few KB read per file, no tensor data.
    """
    hf_dir = Path(hf_dir)
    index, single = hf_dir / INDEX_FILE, hf_dir / SINGLE_FILE
    if index.is_file():
        weight_map = _read_weight_map(index)
    elif single.is_file():
        return len(check_safetensors_file(single))
    else:
        raise FileNotFoundError(f"no {SINGLE_FILE} or {INDEX_FILE} in {hf_dir}")
    by_file: dict[str, set[str]] = {}
    for name, filename in weight_map.items():
        by_file.setdefault(filename, set()).add(name)
    missing = sorted(f for f in by_file if not (hf_dir / f).is_file())
    if missing:
        raise FileNotFoundError(f"{hf_dir}: the index names missing shard files {missing}")
    for filename, names in sorted(by_file.items()):
        absent = sorted(names - set(check_safetensors_file(hf_dir / filename)))
        if absent:
            raise ModelFileError(
                f"{hf_dir / filename} lacks {len(absent)} tensor(s) that {INDEX_FILE} places there "
                f"(e.g. {absent[0]!r}): it is damaged or from another download; {_FIX}"
            )
    return len(weight_map)
