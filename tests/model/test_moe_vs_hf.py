"""Mixture-of-experts models in Megatron-Core, loaded from HF checkpoints == HF transformers, on the CPU.

For the tiny Qwen3-MoE (renormalised top-k, q/k norm) and Qwen2-MoE (top-k weights as softmaxed,
a sigmoid-gated shared expert, QKV biases), under each layout of one 4-process torchrun launch over
gloo: EP=1 (DP=4), EP=2 and EP=4 (one expert per rank), TP=2 x EP=2, PP=2 x EP=2, with the alltoall
token dispatcher, and TP=2 with the allgather one (we refuse it at EP > 1 and PP > 1:
`layout.check_expert_dispatcher`):
- Megatron's logits equal HF transformers' (eager attention, float32) within 1e-5 max abs;
- exporting the Megatron shards back to HF names gives exactly the saved per-expert tensors
  (bit-identical, same names, same order on every rank), so each expert went to the rank and local
  id its global id says;
- Megatron's expert process groups are the ones `layout.expert_groups` describes.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.tiny_models import MOE_ARCHS, save_tiny_model
from tests.support.torchrun_utils import run_torchrun_function

WORKER = Path(__file__).parent / "_moe_worker.py"
TOL = 1e-5
BATCH, SEQ_LEN, VOCAB = 4, 22, 300
NPROC = 4
LAYOUTS = [
    {"name": "ep1", "ep": 1, "dispatcher": "alltoall"},
    {"name": "ep2", "ep": 2, "dispatcher": "alltoall"},
    {"name": "ep4", "ep": 4, "dispatcher": "alltoall"},
    {"name": "tp2ep2", "tp": 2, "ep": 2, "dispatcher": "alltoall"},
    {"name": "tp2_allgather", "tp": 2, "ep": 1, "dispatcher": "allgather"},
    {"name": "pp2ep2", "pp": 2, "ep": 2, "dispatcher": "alltoall"},
]
LAYOUT_NAMES = [spec["name"] for spec in LAYOUTS]
CASES = [(layout, arch) for layout in LAYOUT_NAMES for arch in MOE_ARCHS]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny_moe_models")
    model_dirs = {arch: str(save_tiny_model(arch, root / arch, seed=index)) for index, arch in enumerate(MOE_ARCHS)}
    kwargs = {"model_dirs": model_dirs, "layouts": LAYOUTS, "batch": BATCH, "seq_len": SEQ_LEN}
    result = run_torchrun_function(WORKER, "run_layouts", nproc=NPROC, kwargs=kwargs, timeout=480)
    result.check()
    assert all(r is not None for r in result.rank_results), result.tail()
    return {name: [r["layouts"][name] for r in result.rank_results] for name in LAYOUT_NAMES}


@pytest.mark.parametrize("layout,arch", CASES)
def test_logits_match_hf(results, layout, arch):
    spec = next(s for s in LAYOUTS if s["name"] == layout)
    for rank_result in results[layout]:
        case = rank_result["archs"][arch]
        assert "error" not in case, case.get("error")
        assert case["dispatcher"] == spec["dispatcher"]
        assert case["logits_shape"] == [BATCH, SEQ_LEN, VOCAB]
        assert case["hf_logits_absmax"] > 1.0  # logits of order 1: the tolerance is meaningful
        assert case["max_abs_diff"] <= TOL, f"rank {rank_result['rank']}: max |diff| {case['max_abs_diff']:.2e}"
        assert case["params_written"] == case["num_params_local"] > 0
        # Each EP rank holds num_experts / EP experts under local ids 0..n-1.
        assert case["local_expert_ids"] == list(range(4 // spec["ep"]))


@pytest.mark.parametrize("layout,arch", CASES)
def test_export_is_bit_exact(results, layout, arch):
    ranks = results[layout]
    for rank_result in ranks:
        case = rank_result["archs"][arch]
        assert case["export_mismatched"] == []
        assert case["export_names_equal_saved"]
        assert case["export_duplicates"] == 0
    assert len({r["archs"][arch]["export_order_sha"] for r in ranks}) == 1, "ranks exported different orders"


@pytest.mark.parametrize("layout", LAYOUT_NAMES)
def test_expert_groups_match_layout(results, layout):
    spec = next(s for s in LAYOUTS if s["name"] == layout)
    for rank_result in results[layout]:
        assert rank_result["ep"] == spec["ep"]
        assert rank_result["groups"] == rank_result["described"]
        assert len(rank_result["groups"]["ep"]) == spec["ep"]
        assert len(rank_result["groups"]["expert_tp"]) == spec.get("tp", 1)
