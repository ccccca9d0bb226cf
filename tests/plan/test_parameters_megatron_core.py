"""The parameters each rank of a real Megatron-Core `GPTModel` holds at TP=2 x PP=2 and PP=2 x VPP=2
(4 processes, gloo), stage by stage, against `plan.stage_parameters`."""

from __future__ import annotations

from pathlib import Path

import pytest

from megatron_dapo import plan as mp
from megatron_dapo.model.hf_config import read_hf_config


def _megatron_rank_parameters(layouts: list) -> dict:
    """Worker (4 processes under torchrun): each rank's parameter count for every tiny architecture."""
    import torch

    from megatron_dapo.distributed import ParallelLayout, init_distributed, teardown
    from megatron_dapo.model.builder import build_gpt_models
    from tiny_models import ARCHS, tiny_config

    rows = []
    for index, spec in enumerate(layouts):
        if index:
            teardown(keep_process_group=True)
        layout = ParallelLayout(tp=spec["tp"], pp=spec["pp"], vpp=spec.get("vpp"))
        init_distributed(layout, timeout_s=240, seed=0)
        from megatron.core import parallel_state as ps

        for arch in ARCHS:
            cfg = read_hf_config(tiny_config(arch).to_dict())
            models = build_gpt_models(cfg, layout, torch.float32, transformer_engine="off", init_weights=False)
            numel = sum(p.numel() for model in models for p in model.parameters())
            rows.append({"layout": spec, "arch": arch, "pp_rank": ps.get_pipeline_model_parallel_rank(), "numel": numel})
    teardown()
    return {"rows": rows}


@pytest.mark.timeout(300)
def test_stage_parameters_match_megatron_models():
    from tiny_models import ARCHS, tiny_config
    from torchrun_utils import run_torchrun_function

    layouts = [{"tp": 2, "pp": 2}, {"tp": 1, "pp": 2, "vpp": 2}]
    result = run_torchrun_function(Path(__file__), "_megatron_rank_parameters", nproc=4, kwargs={"layouts": layouts}, timeout=280)
    result.check()
    rows = [row for rank in result.rank_results for row in rank["rows"]]
    assert len(rows) == 4 * len(layouts) * len(ARCHS)
    for row in rows:
        cfg = read_hf_config(tiny_config(row["arch"]).to_dict())
        expected = mp.stage_parameters(cfg, row["layout"]["tp"], row["layout"]["pp"], row["pp_rank"])
        assert row["numel"] == expected, row
