"""Worker for test_sliced_load.py (4 processes, TP=2 x PP=2, real Megatron-Core over gloo). The
byte-counting reader both use: tests/support/counting_reader.py.

`run` builds every tiny architecture's model chunks on each rank, loads them twice (the sliced reads
of `load_hf_into_megatron` and its whole-tensor reference, `sliced=False`), each through a
`CountingReader`, and reports per rank whether every parameter is bit-identical and the bytes read.
"""

from __future__ import annotations

import torch

from tests.support.counting_reader import CountingReader


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
