"""An `HFWeightReader` that counts the bytes it reads (test_sliced_load.py and its worker)."""

from __future__ import annotations

from collections import defaultdict

import torch

from megatron_dapo.model.hf_weights import HFWeightReader


class _CountingSlice:
    def __init__(self, inner, on_read):
        self._inner, self._on_read = inner, on_read

    def get_shape(self):
        return self._inner.get_shape()

    def __getitem__(self, index):
        tensor = self._inner[index]
        self._on_read(tensor)
        return tensor


class CountingReader(HFWeightReader):
    """An `HFWeightReader` that counts the bytes of every tensor it hands out, per HF name: `whole`
    (``get``) and `part` (``get_slice(...)[index]``). The reads themselves are the real ones."""

    def __init__(self, hf_dir) -> None:
        super().__init__(hf_dir)
        self.whole: dict[str, int] = defaultdict(int)
        self.part: dict[str, int] = defaultdict(int)
        self.part_shapes: dict[str, list] = defaultdict(list)

    def get(self, name: str) -> torch.Tensor:
        tensor = super().get(name)
        self.whole[name] += tensor.numel() * tensor.element_size()
        return tensor

    def get_slice(self, name: str):
        def on_read(tensor: torch.Tensor) -> None:
            self.part[name] += tensor.numel() * tensor.element_size()
            self.part_shapes[name].append(list(tensor.shape))

        return _CountingSlice(super().get_slice(name), on_read)

    @property
    def total(self) -> int:
        return sum(self.whole.values()) + sum(self.part.values())
