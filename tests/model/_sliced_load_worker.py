"""Worker for test_sliced_load.py (4 processes, TP=2 x PP=2, real Megatron-Core over gloo), and the
byte-counting reader both use.

`run` builds every tiny architecture's model chunks on each rank, loads them twice (the sliced reads
of `load_hf_into_megatron` and its whole-tensor reference, `sliced=False`), each through a
`CountingReader`, and reports per rank whether every parameter is bit-identical and the bytes read.
"""

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


def run(model_dirs: dict) -> dict:
    from megatron_dapo.distributed import ParallelLayout, init_distributed, teardown
    from megatron_dapo.model.builder import build_gpt_models
    from megatron_dapo.model.hf_config import read_hf_config
    from megatron_dapo.model.load import load_hf_into_megatron

    out: dict = {"archs": {}}
    ctx = init_distributed(ParallelLayout(tp=2, pp=2), timeout_s=240, seed=0)
    from megatron.core import parallel_state as ps

    out.update(tp_rank=ps.get_tensor_model_parallel_rank(), pp_rank=ps.get_pipeline_model_parallel_rank())
    for arch, model_dir in model_dirs.items():
        cfg = read_hf_config(model_dir)
        loaded = {}
        counts = {}
        for sliced in (True, False):
            models = build_gpt_models(cfg, ctx.layout, torch.float32, transformer_engine="off", init_weights=False)
            reader = CountingReader(model_dir)
            written = load_hf_into_megatron(models, model_dir, cfg, sliced=sliced, reader=reader)
            loaded[sliced] = {f"{i}.{n}": p.detach().clone() for i, m in enumerate(models) for n, p in m.named_parameters()}
            counts[sliced] = {"written": written, "whole": dict(reader.whole), "part": dict(reader.part),
                              "part_shapes": dict(reader.part_shapes), "total": reader.total}  # fmt: skip
        same = sorted(loaded[True]) == sorted(loaded[False]) and all(
            loaded[True][n].dtype == loaded[False][n].dtype and torch.equal(loaded[True][n], loaded[False][n])
            for n in loaded[True]
        )
        out["archs"][arch] = {"bit_identical": same, "params": len(loaded[True]), "sliced": counts[True], "full": counts[False]}
    teardown()
    return out
