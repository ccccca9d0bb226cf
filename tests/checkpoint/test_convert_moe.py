"""Mixture-of-experts checkpoints: conversion and loading at any expert-parallel layout.

- HF -> Megatron -> HF of the tiny Qwen3-MoE and Qwen2-MoE in one plain Python process (recorded
  for TP=2 x EP=2): every tensor bit-identical, the converter's own logits check passes at 1e-5,
  and an EP that does not divide the experts is refused before anything is written.
- One 4-process torchrun launch at EP=2, TP=2 x EP=2 and PP=2 x EP=2 (alltoall dispatcher):
  the converted checkpoint loads with Megatron's logits equal to HF's (1e-5), and the HF weights
  loaded at that layout and saved as a training checkpoint convert back to the original HF tensors
  bit for bit: each rank's experts are stored under their global ids.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.support.tiny_models import MOE_ARCHS, save_tiny_model
from tests.support.torchrun_utils import run_torchrun_function

WORKER = Path(__file__).parent / "_moe_checkpoint_worker.py"
TOL = 1e-5
LAYOUTS = [
    {"name": "ep2", "ep": 2, "dispatcher": "alltoall"},
    {"name": "tp2ep2", "tp": 2, "ep": 2, "dispatcher": "alltoall"},
    {"name": "pp2ep2", "pp": 2, "ep": 2, "dispatcher": "alltoall"},
]
LAYOUT_NAMES = [spec["name"] for spec in LAYOUTS]


def _tensors(directory: Path) -> dict[str, torch.Tensor]:
    tensors: dict = {}
    for file in sorted(Path(directory).glob("*.safetensors")):
        tensors.update(load_file(str(file)))
    return tensors


def _assert_identical(exported: dict, original: dict) -> None:
    assert sorted(exported) == sorted(original)
    for name, tensor in original.items():
        assert exported[name].dtype == tensor.dtype and torch.equal(exported[name], tensor), f"{name} changed"


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny_moe")
    return {arch: save_tiny_model(arch, root / arch, seed=10 + index) for index, arch in enumerate(MOE_ARCHS)}


@pytest.fixture(scope="module")
def converted(hf_dirs, tmp_path_factory) -> tuple[Path, dict]:
    out_root = tmp_path_factory.mktemp("moe_converted")
    kwargs = {"hf_dirs": {arch: str(path) for arch, path in hf_dirs.items()}, "out_root": str(out_root)}
    result = run_torchrun_function(WORKER, "convert_moe", nproc=1, use_torchrun=False, timeout=300, kwargs=kwargs).check()
    (observed,) = result.rank_results
    assert observed is not None and "error" not in observed, result.tail()
    return out_root, observed


@pytest.fixture(scope="module")
def layouts(hf_dirs, converted, tmp_path_factory) -> dict:
    out_root, _ = converted
    kwargs = {
        "checkpoints": {arch: str(out_root / arch / "megatron") for arch in MOE_ARCHS},
        "hf_dirs": {arch: str(path) for arch, path in hf_dirs.items()},
        "layouts": LAYOUTS,
        "save_root": str(tmp_path_factory.mktemp("moe_saved")),
    }
    result = run_torchrun_function(WORKER, "expert_parallel_layouts", nproc=4, timeout=480, kwargs=kwargs).check()
    assert all(r is not None for r in result.rank_results), result.tail()
    saved = {name: {arch: entry["saved"] for arch, entry in by_arch.items()} for name, by_arch in result.rank_results[0]["layouts"].items()}
    kwargs = {"checkpoints": saved, "export_root": str(tmp_path_factory.mktemp("moe_exported"))}
    exported = run_torchrun_function(WORKER, "export_checkpoints", nproc=1, use_torchrun=False, timeout=300, kwargs=kwargs).check()
    (observed,) = exported.rank_results
    assert observed is not None and "error" not in observed, exported.tail()
    return {"ranks": result.rank_results, "exports": observed["exports"]}


@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_round_trip_is_bit_identical(arch, hf_dirs, converted):
    out_root, observed = converted
    _assert_identical(_tensors(out_root / arch / "hf"), _tensors(hf_dirs[arch]))
    assert observed["archs"][arch]["notes"][-1].startswith("logits check: all 4 blocks match")
    meta = json.loads((out_root / arch / "megatron" / "metadata.json").read_text())
    assert (meta["layout"]["tp"], meta["layout"]["ep"]) == (2, 2)


def test_expert_parallel_that_does_not_divide_is_refused(converted):
    _, observed = converted
    assert observed["ep3"] == (
        "ConversionError: parallel.ep=3 does not divide the model's num_experts=4: use parallel.ep in {1, 2, 4}"
    )
    assert observed["ep3_output_exists"] is False


@pytest.mark.parametrize("layout", LAYOUT_NAMES)
@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_converted_checkpoint_loads_at_expert_parallel_layouts(layouts, layout, arch):
    for rank_result in layouts["ranks"]:
        diff = rank_result["layouts"][layout][arch]["max_abs_diff"]
        assert diff <= TOL, f"rank {rank_result.get('rank')}: {layout} {arch} max |diff| {diff:.2e}"


@pytest.mark.parametrize("layout", LAYOUT_NAMES)
@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_checkpoint_saved_at_expert_parallel_layout_exports_the_original(layouts, hf_dirs, layout, arch):
    export = layouts["exports"][layout][arch]
    _assert_identical(_tensors(Path(export["dir"])), _tensors(hf_dirs[arch]))
