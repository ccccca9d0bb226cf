"""Megatron-Core GPTModel built and loaded from HF checkpoints == HF transformers, on the CPU.

For each tiny architecture (Qwen2 untied and tied, Llama with llama3 RoPE scaling, Qwen3 with q/k
norm and head_dim != hidden/heads) and each parallel layout (TP=1 in a plain single process; TP=2,
PP=2, TP=2 x PP=2, PP=2 x VPP=2 and TP=2 x CP=2 in one 4-process torchrun launch over gloo):
- Megatron's logits equal HF transformers' (eager attention, float32) within 1e-5 max abs;
- exporting the Megatron shards back to HF names gives exactly the saved tensors (bit-identical,
  same names, same order on every rank);
- Megatron's process groups are the ones `ParallelLayout.groups` describes;
- debug.compare_with_hf names a deliberately perturbed layer as the first divergence.
Layouts share one launch to amortise start-up; the per-case assertions read the workers' results.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from megatron_dapo.distributed.layout import ParallelLayout
from tests.support.tiny_models import ARCHS
from tests.support.torchrun_utils import run_torchrun_function

WORKER = Path(__file__).parent / "_megatron_worker.py"
TOL = 1e-5
BATCH, SEQ_LEN, VOCAB = 4, 22, 300  # 22: not a multiple of 2*CP = 4 (the CP layout pads)

SINGLE_LAYOUTS = [{"name": "tp1", "tp": 1, "pp": 1}]
MULTI_LAYOUTS = [
    {"name": "tp2", "tp": 2, "pp": 1},
    {"name": "pp2", "tp": 1, "pp": 2},
    {"name": "tp2pp2", "tp": 2, "pp": 2},
    {"name": "pp2vpp2", "tp": 1, "pp": 2, "vpp": 2},
    {"name": "tp2cp2", "tp": 2, "pp": 1, "cp": 2},  # context parallelism, SDPA attention (no TE)
]
MULTI_NPROC = 4
SINGLE_CORRUPT = {"layout": "tp1", "arch": "qwen2", "layer": 2}
MULTI_CORRUPT = {"layout": "tp2pp2", "arch": "llama3", "layer": 3}


def _launch(model_dirs, layouts, nproc, corrupt):
    kwargs = {
        "model_dirs": {arch: str(path) for arch, path in model_dirs.items()},
        "layouts": layouts,
        "batch": BATCH,
        "seq_len": SEQ_LEN,
        "corrupt": corrupt,
    }
    result = run_torchrun_function(
        WORKER, "run_layouts", nproc=nproc, kwargs=kwargs, timeout=480, use_torchrun=nproc > 1
    )
    result.check()
    assert all(r is not None for r in result.rank_results), result.tail()
    return result.rank_results


@pytest.fixture(scope="module")
def single_results(tiny_model_dirs):
    return _launch(tiny_model_dirs, SINGLE_LAYOUTS, 1, SINGLE_CORRUPT)


@pytest.fixture(scope="module")
def multi_results(tiny_model_dirs):
    return _launch(tiny_model_dirs, MULTI_LAYOUTS, MULTI_NPROC, MULTI_CORRUPT)


ALL_LAYOUTS = [spec["name"] for spec in SINGLE_LAYOUTS + MULTI_LAYOUTS]
CASES = [(layout, arch) for layout in ALL_LAYOUTS for arch in ARCHS]


@pytest.fixture
def results(request):
    """Lazily start only the launch a test needs (single-process or 4-process)."""

    def get(layout_name):
        if layout_name == "tp1":
            return [r["layouts"][layout_name] for r in request.getfixturevalue("single_results")]
        return [r["layouts"][layout_name] for r in request.getfixturevalue("multi_results")]

    return get


@pytest.mark.parametrize("layout,arch", CASES)
def test_logits_match_hf(results, layout, arch):
    for rank_result in results(layout):
        case = rank_result["archs"][arch]
        assert "error" not in case, case.get("error")
        assert case["logits_shape"] == [BATCH, SEQ_LEN, VOCAB]
        assert case["hf_logits_absmax"] > 1.0  # logits of order 1: the tolerance is meaningful
        assert case["max_abs_diff"] <= TOL, f"rank {rank_result['rank']}: max |diff| {case['max_abs_diff']:.2e}"
        assert case["params_written"] == case["num_params_local"] > 0


@pytest.mark.parametrize("layout,arch", CASES)
def test_export_is_bit_exact(results, layout, arch):
    ranks = results(layout)
    for rank_result in ranks:
        case = rank_result["archs"][arch]
        assert case["export_mismatched"] == []
        assert case["export_names_equal_saved"]
        assert case["export_duplicates"] == 0
    assert len({r["archs"][arch]["export_order_sha"] for r in ranks}) == 1, "ranks exported different orders"


@pytest.mark.parametrize("layout", ALL_LAYOUTS)
def test_process_groups_match_layout(results, layout):
    spec = next(s for s in SINGLE_LAYOUTS + MULTI_LAYOUTS if s["name"] == layout)
    ranks = results(layout)
    expected = ParallelLayout(tp=spec["tp"], pp=spec["pp"], vpp=spec.get("vpp"), cp=spec.get("cp", 1)).resolve(len(ranks))
    for rank_result in ranks:
        rank = rank_result["rank"]
        assert rank_result["world_size"] == len(ranks)
        for kind in ("tp", "pp", "dp", "cp"):
            described = next(g for g in expected.groups(kind) if rank in g)
            assert rank_result["groups"][kind] == described, (kind, rank)


def test_single_process_launch_without_torchrun(single_results):
    (rank_result,) = single_results
    entry = rank_result["layouts"]["tp1"]
    assert entry["launch"] == "single" and entry["world_size"] == 1
    assert entry["cpu_compat"] is True


def test_debug_names_corrupted_layer_single_process(single_results):
    corrupt = single_results[0]["layouts"]["tp1"]["corrupt"]
    assert corrupt["first"] == "layer 2", corrupt["summary"]
    assert corrupt["summary"].startswith("first divergence at layer 2 (decoder.layers.2): max |diff|")
    assert corrupt["summary"].endswith("layers 0-1 match")
    diffs = {label: diff for label, _, diff in corrupt["blocks"]}
    assert diffs["embedding"] <= TOL and diffs["layer 0"] <= TOL and diffs["layer 1"] <= TOL
    assert diffs["layer 2"] > 1e-3 and diffs["logits"] > 1e-3


def test_debug_names_corrupted_layer_across_pipeline(multi_results):
    for rank_result in multi_results:
        corrupt = rank_result["layouts"]["tp2pp2"]["corrupt"]
        assert corrupt["first"] == "layer 3", corrupt["summary"]
        # Layer 3 is the second layer of pipeline stage 1 (4 layers over 2 stages).
        assert corrupt["summary"].startswith("first divergence at layer 3 (decoder.layers.1 on pipeline stage 1)")
        assert corrupt["summary"].endswith("layers 0-2 match")
