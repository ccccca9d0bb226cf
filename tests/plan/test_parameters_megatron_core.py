"""The parameters each rank of a real Megatron-Core `GPTModel` holds, stage by stage, against
`plan.stage_parameter_split` (4 processes, gloo, one launch): the dense tiny models at TP=2 x PP=2 and
PP=2 x VPP=2, the tiny mixtures of experts (Qwen3-MoE, Qwen2-MoE with its shared expert) at
TP=2 x PP=2 (EP=1), TP=2 x EP=2, PP=2 x EP=2 and EP=4, their routed experts counted apart."""

from __future__ import annotations

from pathlib import Path

import pytest

from megatron_dapo import plan as mp
from megatron_dapo.model.hf_config import read_hf_config

LAYOUTS = [
    {"tp": 2, "pp": 2, "moe": True},
    {"tp": 1, "pp": 2, "vpp": 2, "moe": False},  # the tiny MoE models have 2 layers: no VPP=2 x PP=2
    {"tp": 2, "ep": 2, "moe": True, "dense": False},
    {"pp": 2, "ep": 2, "moe": True, "dense": False},
    {"ep": 4, "moe": True, "dense": False},
]


def _megatron_rank_parameters(layouts: list) -> dict:
    """Worker (4 processes under torchrun): each rank's parameter count, and its routed experts' part,
    for every tiny architecture the layout lists."""
    import torch

    from megatron_dapo.distributed import init_distributed, teardown
    from megatron_dapo.distributed.layout import ParallelLayout
    from megatron_dapo.model.builder import build_gpt_models
    from tests.support.tiny_models import ARCHS, MOE_ARCHS, tiny_config

    rows = []
    for index, spec in enumerate(layouts):
        if index:
            teardown(keep_process_group=True)
        parallel = ParallelLayout(tp=spec.get("tp", 1), pp=spec.get("pp", 1), vpp=spec.get("vpp"), ep=spec.get("ep", 1))
        ctx = init_distributed(parallel, timeout_s=240, seed=0)
        from megatron.core import parallel_state as ps

        archs = (ARCHS if spec.get("dense", True) else ()) + (MOE_ARCHS if spec["moe"] else ())
        for arch in archs:
            cfg = read_hf_config(tiny_config(arch).to_dict())
            models = build_gpt_models(
                cfg, ctx.layout, torch.float32, transformer_engine="off", init_weights=False, sequence_parallel=cfg.is_moe
            )
            named = [(name, p) for model in models for name, p in model.named_parameters()]
            experts = [p for name, p in named if ".mlp.experts." in name]
            rows.append(
                {
                    "layout": spec,
                    "arch": arch,
                    "pp_rank": ps.get_pipeline_model_parallel_rank(),
                    "numel": sum(p.numel() for _, p in named),
                    "expert_numel": sum(p.numel() for p in experts),
                    # DDP reduces these over the expert data-parallel group only (Megatron marks them when EP > 1).
                    "expert_marks": sorted({getattr(p, "allreduce", True) for p in experts}),
                    "other_marks": sorted({getattr(p, "allreduce", True) for name, p in named if ".mlp.experts." not in name}),
                }
            )
    teardown()
    return {"rows": rows}


@pytest.mark.timeout(300)
def test_stage_parameters_match_megatron_models():
    from tests.support.tiny_models import ARCHS, MOE_ARCHS, tiny_config
    from tests.support.torchrun_utils import run_torchrun_function

    result = run_torchrun_function(Path(__file__), "_megatron_rank_parameters", nproc=4, kwargs={"layouts": LAYOUTS}, timeout=280)
    result.check()
    rows = [row for rank in result.rank_results for row in rank["rows"]]
    archs_per_layout = [len(ARCHS) * spec.get("dense", True) + len(MOE_ARCHS) * spec["moe"] for spec in LAYOUTS]
    assert len(rows) == 4 * sum(archs_per_layout)
    for row in rows:
        cfg = read_hf_config(tiny_config(row["arch"]).to_dict())
        layout = row["layout"]
        ep = layout.get("ep", 1)
        expected = mp.stage_parameter_split(cfg, layout.get("tp", 1), layout.get("pp", 1), row["pp_rank"], ep)
        assert (row["numel"], row["expert_numel"]) == (expected.total, expected.expert), row
        assert (expected.expert > 0) == cfg.is_moe
        if cfg.is_moe:
            assert row["expert_marks"] == [ep == 1] and row["other_marks"] == [True], row
