"""The actor's update on a mixture of experts (tiny Qwen3-MoE), real Megatron-Core under gloo.

* The routers' auxiliary losses (load balancing 0.01, z-loss 0.001) alone: the actor's gradient with
  one micro-batch equals Megatron's own definition (a plain forward/backward of the model, the
  routers in Megatron's default mode); the same batch twice in two micro-batches gives the same
  gradient (a mean over micro-batches, not a sum, and not scaled by token counts); coefficients 0
  give none. Without `actor.moe`'s scaling Megatron's per-token mode multiplies each micro-batch's
  auxiliary loss by its token count (~100 here) and these fail.
* Expert parallelism: an update at DP=2 x EP=2 equals DP=2 x EP=1 (gradients, grad norm, weights
  after the step, also with the distributed optimizer, the MoE metrics), the data-parallel ranks
  holding uneven shares (responses of different lengths); TP=2 + sequence parallelism + EP=2, and
  the allgather dispatcher at TP=2 + SP, equal TP=2 + SP x DP=2 with alltoall (4 processes). The
  allgather dispatcher at EP > 1 is refused (`layout.check_expert_dispatcher`): its peers would need
  micro-batches of one shape.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.support.tiny_models import save_tiny_model
from tests.support.torchrun_utils import run_torchrun_function

WORKER = Path(__file__).parent / "_moe_update_worker.py"
GRAD_TOL = 1e-6
WEIGHT_TOL = 1e-6

TWO_PROCESSES = [
    {"name": "dp2", "ep": 1},
    {"name": "dp2ep2_alltoall", "ep": 2, "dispatcher": "alltoall"},
    {"name": "dp2_distopt", "ep": 1, "dist_opt": True},
    {"name": "dp2ep2_distopt", "ep": 2, "dist_opt": True},
]
FOUR_PROCESSES = [
    {"name": "tp2sp_dp2", "tp": 2, "sp": True, "ep": 1},
    {"name": "tp2sp_ep2", "tp": 2, "sp": True, "ep": 2},
    {"name": "tp2sp_dp2_allgather", "tp": 2, "sp": True, "ep": 1, "dispatcher": "allgather"},
]


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory) -> str:
    return str(save_tiny_model("qwen3_moe", tmp_path_factory.mktemp("moe_update") / "qwen3_moe", seed=3))


def _max_diff(a: dict, b: dict) -> float:
    assert sorted(a) == sorted(b)
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def _assert_same_update(ranks: list, out: Path, name: str, reference: str) -> None:
    """Layout `name` updated as `reference` did: gradients (saved without the distributed optimizer),
    weights after the step, and every rank's metrics."""
    got, want = torch.load(out / f"{name}.pt"), torch.load(out / f"{reference}.pt")
    if "grads" in want:
        assert _max_diff(got["grads"], want["grads"]) < GRAD_TOL
    assert _max_diff(got["weights"], want["weights"]) < WEIGHT_TOL
    for rank in ranks:
        a, b = rank["layouts"][name]["metrics"], rank["layouts"][reference]["metrics"]
        for key in b:
            assert a[key] == pytest.approx(b[key], rel=1e-5, abs=1e-7), (key, a[key], b[key])


def test_auxiliary_losses_are_a_mean_over_micro_batches_as_megatron_defines_them(moe_dir, tmp_path):
    result = run_torchrun_function(WORKER, "run_aux_reference", nproc=1, kwargs={"model_dir": moe_dir, "out_dir": str(tmp_path)},
                                   timeout=300, use_torchrun=False)  # fmt: skip
    result.check()
    out = result.rank_results[0]
    assert out["mb1"]["micro_batches"] == 1 and out["twice_mb2"]["micro_batches"] == 2
    saved = torch.load(tmp_path / "aux.pt")
    reference = saved["megatron"]
    router = [k for k in reference if k.endswith("mlp.gate.weight")]
    assert router and all(float(reference[k].abs().max()) > 1e-6 for k in router)  # the losses reach the router
    assert _max_diff(saved["mb1"], reference) < 1e-7
    assert _max_diff(saved["twice_mb2"], reference) < 1e-7
    assert max(float(t.abs().max()) for t in saved["zero_coeffs"].values()) == 0.0


def _run_layouts(moe_dir: str, out: Path, layouts: list, nproc: int) -> tuple[list, Path]:
    result = run_torchrun_function(WORKER, "run_layouts", nproc=nproc, timeout=600,
                                   kwargs={"model_dir": moe_dir, "out_dir": str(out), "layouts": layouts})  # fmt: skip
    result.check()
    return result.rank_results, out


@pytest.fixture(scope="module")
def two_process_layouts(moe_dir, tmp_path_factory):
    return _run_layouts(moe_dir, tmp_path_factory.mktemp("moe_layouts2"), TWO_PROCESSES, nproc=2)


@pytest.mark.parametrize("name,reference", [("dp2ep2_alltoall", "dp2"), ("dp2ep2_distopt", "dp2_distopt")])
def test_expert_parallel_update_equals_ep1(two_process_layouts, name, reference):
    ranks, out = two_process_layouts
    _assert_same_update(ranks, out, name, reference)
    metrics = ranks[0]["layouts"][name]["metrics"]
    assert metrics["moe_aux_loss"] > 0 and metrics["moe_z_loss"] > 0 and metrics["moe_load_ratio_max"] >= metrics["moe_load_ratio_mean"] >= 1


@pytest.mark.parametrize("name", ["tp2sp_ep2", "tp2sp_dp2_allgather"])
def test_tensor_and_sequence_parallel_with_either_dispatcher(four_process_layouts, name):
    """TP=2 x SP x EP=2 (alltoall), and the allgather dispatcher at TP=2 x SP, against TP=2 x SP x DP=2."""
    ranks, out = four_process_layouts
    _assert_same_update(ranks, out, name, "tp2sp_dp2")


@pytest.fixture(scope="module")
def four_process_layouts(moe_dir, tmp_path_factory):
    return _run_layouts(moe_dir, tmp_path_factory.mktemp("moe_layouts4"), FOUR_PROCESSES, nproc=4)
