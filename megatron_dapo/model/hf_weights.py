"""Stream tensors out of a HuggingFace safetensors directory without loading the whole model.

    with HFWeightReader(hf_dir) as reader:
        q = reader.get("model.layers.0.self_attn.q_proj.weight")

Handles a single `model.safetensors` and a sharded `model.safetensors.index.json` + shards. Tensors
are read lazily by name through `safe_open` (memory-mapped); at most one shard file is open at a
time, so a rank that needs only its pipeline stage reads only those bytes.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Iterable, Iterator, Optional, Union

import torch
from safetensors import safe_open

__all__ = ["HFWeightReader"]

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


class HFWeightReader:
    """Lazy, name-addressed access to the tensors of an HF checkpoint directory."""

    def __init__(self, hf_dir: Union[str, os.PathLike]) -> None:
        self.hf_dir = Path(hf_dir)
        index = self.hf_dir / INDEX_FILE
        single = self.hf_dir / SINGLE_FILE
        self._file_of: dict[str, str] = {}
        if index.is_file():
            weight_map = json.loads(index.read_text()).get("weight_map")
            if not isinstance(weight_map, dict) or not weight_map:
                raise ValueError(f"{index} has no weight_map")
            self._file_of = dict(weight_map)
        elif single.is_file():
            with safe_open(str(single), framework="pt") as handle:
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
            self._open_handle = safe_open(str(self.hf_dir / filename), framework="pt").__enter__()
            self._open_name = filename
        return self._open_handle

    def get(self, name: str) -> torch.Tensor:
        """One tensor by name (a fresh CPU tensor)."""
        try:
            filename = self._file_of[name]
        except KeyError:
            raise KeyError(f"{name!r} is not in the checkpoint at {self.hf_dir}") from None
        return self._handle(filename).get_tensor(name)

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
