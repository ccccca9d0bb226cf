"""The Megatron actor end to end on the CPU: exact token-mean across micro-batches, TP, PP, VPP and DP.

Two launches (see _actor_worker.py), each loading the same tiny HF model (Qwen2, tied embeddings)
and the same 7-sequence batch with every loss term on (clip-higher + dual-clip policy loss,
truncated IS, entropy bonus, k3 KL to a reference) and one response masked out of the loss:

* one process (TP=1): the reference run with 1 micro-batch; the same with 2, 4 and a token budget
  of micro-batches; an independent gradient from HF transformers with the loss written out by hand;
  the LR schedule and gradient clipping;
* four processes over gloo, one launch for eight layouts: TP2xPP2, TP2xDP2, PP2xDP2, PP2xVPP2xDP2,
  DP4 and the context-parallel CP2xDP2, TP2xCP2 with sequence parallelism, PP2xCP2, each
  data-parallel rank holding an UNEVEN share of the batch (5/2 at DP=2, 4/0/2/1 at DP=4) and a token
  budget that gives every rank a different number of micro-batches;
* two processes at CP=2 for Qwen2, Llama 3 (llama3 RoPE scaling) and Qwen3 (q/k norms): log-probs
  and entropy against HF, the DDP gradient against the hand-written loss on the HF model, and the
  weights after one update against CP=1 x DP=2. Sequence lengths are not multiples of 2*CP.

Checked: log-probs equal HF's and the single-process ones within 1e-5; gradients after finalize
(where the optimizer is not distributed), grad norms, the statistics, and the weights after two
optimizer steps (distributed optimizer included) equal the single-process run. Observed:
log-probs within 2e-6, gradients within 5e-7 absolute (largest entry 0.28), weights within 2e-7,
grad norms within 4e-7 relative.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from tests.support.torchrun_utils import run_torchrun_function

WORKER = Path(__file__).parent / "_actor_worker.py"
LAYOUTS = [
    {"name": "tp2pp2", "tp": 2, "pp": 2, "dist_opt": False},
    {"name": "tp2dp2", "tp": 2, "pp": 1, "dist_opt": False},
    {"name": "pp2dp2", "tp": 1, "pp": 2, "dist_opt": True},
    {"name": "pp2vpp2dp2", "tp": 1, "pp": 2, "vpp": 2, "dist_opt": True},
    {"name": "dp4", "tp": 1, "pp": 1, "dist_opt": True},
    # Context parallelism (no Transformer Engine: the SDPA core attention), with TP x SP and with PP.
    {"name": "cp2dp2", "tp": 1, "pp": 1, "cp": 2, "dist_opt": True},
    {"name": "tp2cp2sp", "tp": 2, "pp": 1, "cp": 2, "sp": True, "dist_opt": False},
    {"name": "pp2cp2", "tp": 1, "pp": 2, "cp": 2, "dist_opt": False},
]
CP_ARCHS = ("qwen2", "llama3", "qwen3")
LOG_PROB_TOL = 1e-5
GRAD_TOL = 2e-6  # absolute; gradients are up to ~0.3
WEIGHT_TOL = 1e-6
NORM_RTOL = 2e-6
COMPARED_STATS = ("loss", "pg_loss", "entropy_loss", "kl_loss", "entropy", "kl", "clipfrac", "clipfrac_high",
                  "clipfrac_low", "dual_clipfrac", "approx_kl", "tis_weight_mean", "tis_capped_frac", "tokens")  # fmt: skip


@pytest.fixture(scope="module")
def single(tiny_model_dirs, tmp_path_factory):
    out = tmp_path_factory.mktemp("actor_single")
    kwargs = {"model_dir": str(tiny_model_dirs["qwen2_tied"]), "out_dir": str(out)}
    result = run_torchrun_function(WORKER, "run_single", nproc=1, kwargs=kwargs, timeout=300, use_torchrun=False)
    result.check()
    return result.rank_results[0], torch.load(out / "single.pt")


@pytest.fixture(scope="module")
def layouts(tiny_model_dirs, tmp_path_factory):
    out = tmp_path_factory.mktemp("actor_layouts")
    kwargs = {"model_dir": str(tiny_model_dirs["qwen2_tied"]), "out_dir": str(out), "layouts": LAYOUTS}
    result = run_torchrun_function(WORKER, "run_layouts", nproc=4, kwargs=kwargs, timeout=420)
    result.check()
    assert all(r is not None and "error" not in r for r in result.rank_results), result.tail()
    return result.rank_results, {spec["name"]: torch.load(out / f"{spec['name']}.pt") for spec in LAYOUTS}


def _max_abs_diff(a: dict, b: dict) -> tuple[float, str]:
    assert sorted(a) == sorted(b)
    return max((float((a[name] - b[name]).abs().max()), name) for name in a)


def _valid(result: dict) -> torch.Tensor:
    return torch.tensor(result["response_valid"])


# ---------------------------------------------------------------------------------------------
# Single process
# ---------------------------------------------------------------------------------------------


def test_log_probs_and_entropy_equal_hf(single):
    result, _ = single
    valid = _valid(result)
    log_probs = torch.tensor(result["mb1"]["log_probs"])
    entropy = torch.tensor(result["mb1"]["entropy"])
    assert log_probs.shape == valid.shape
    assert float((log_probs - torch.tensor(result["hf_log_probs"])).abs().max()) < LOG_PROB_TOL
    assert float((entropy - torch.tensor(result["hf_entropy"])).abs().max()) < LOG_PROB_TOL
    assert torch.all(log_probs[~valid] == 0) and torch.all(entropy[~valid] == 0)
    assert torch.all(log_probs[valid] < 0)


def test_temperature_and_empty_batch(single):
    result, _ = single
    assert result["temperature_max_diff"] < LOG_PROB_TOL  # log-probs of softmax(logits / 0.7), as sampled
    assert result["empty_batch_shape"] == [0, len(result["response_valid"][0])]


def test_gradient_equals_hand_written_loss_on_hf_model(single):
    _, tensors = single
    diff, name = _max_abs_diff(tensors["mb1"]["grads"], tensors["hf_grads"])
    assert diff < GRAD_TOL, f"{name}: {diff}"
    assert max(float(g.abs().max()) for g in tensors["hf_grads"].values()) > 0.05  # a non-trivial gradient


@pytest.mark.parametrize("split", ["mb2", "mb4", "budget"])
def test_number_of_micro_batches_changes_nothing(single, split):
    result, tensors = single
    reference, other = result["mb1"], result[split]
    assert reference["local_micro_batches"] == 1
    assert other["local_micro_batches"] == {"mb2": 2, "mb4": 4, "budget": 6}[split]
    for step in ("step1", "step2"):
        assert math.isclose(other[step]["grad_norm"], reference[step]["grad_norm"], rel_tol=NORM_RTOL)
    for key in COMPARED_STATS:
        assert math.isclose(other["step1"][key], reference["step1"][key], rel_tol=1e-5, abs_tol=1e-7), key
    diff, name = _max_abs_diff(tensors[split]["grads"], tensors["mb1"]["grads"])
    assert diff < GRAD_TOL, f"{name}: {diff}"
    diff, name = _max_abs_diff(tensors[split]["weights"], tensors["mb1"]["weights"])
    assert diff < WEIGHT_TOL, f"{name}: {diff}"


def test_statistics_of_the_reference_run(single):
    stats = single[0]["mb1"]["step1"]
    assert stats["tokens"] == 54  # 7 responses, one masked out of the loss
    assert 0 < stats["clipfrac"] < 1 and 0 < stats["tis_capped_frac"] < 1  # the clips and the cap are active
    assert math.isclose(stats["clipfrac"], stats["clipfrac_high"] + stats["clipfrac_low"], rel_tol=1e-9)
    assert math.isclose(stats["loss"], stats["pg_loss"] - 0.01 * stats["entropy_loss"] + 0.05 * stats["kl_loss"], rel_tol=1e-6)
    assert stats["update_successful"] == 1.0


def test_lr_warms_up_linearly_then_stays_constant(single):
    schedule = single[0]["schedule"]
    lrs = [entry["metrics"]["lr"] for entry in schedule]
    assert lrs == pytest.approx([1e-3 / 3, 2e-3 / 3, 1e-3, 1e-3, 1e-3], rel=1e-12)
    for entry, lr in zip(schedule, lrs):
        assert entry["metrics"]["num_optimizer_steps"] == 2  # two mini-batches, both at the step's lr
        for group in entry["groups"]:
            assert group["lr"] == pytest.approx(lr, rel=1e-12)
            assert group["weight_decay"] == pytest.approx(0.1 * group["wd_mult"])
        assert {group["wd_mult"] for group in entry["groups"]} == {0.0, 1.0}  # norms / biases undecayed


def test_gradient_clipping(single):
    result = single[0]
    for entry in result["schedule"]:  # grad_clip = 1e-3, far below the norm
        assert entry["metrics"]["grad_norm"] > 1.0
        assert entry["post_clip_norm"] == pytest.approx(1e-3, rel=1e-4)
    no_clip = result["no_clip"]  # grad_clip = 1e6: gradients left as they are
    assert no_clip["post_clip_norm"] == pytest.approx(no_clip["metrics"]["grad_norm"], rel=1e-5)
    assert no_clip["metrics"]["grad_norm"] == pytest.approx(result["mb1"]["step1"]["grad_norm"], rel=NORM_RTOL)


# ---------------------------------------------------------------------------------------------
# Four processes: TP / PP / VPP / DP
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("layout", [spec["name"] for spec in LAYOUTS])
def test_layout_equals_single_process(layouts, single, layout):
    ranks, tensors = layouts
    reference, single_tensors = single
    spec = next(s for s in LAYOUTS if s["name"] == layout)
    hf_log_probs = torch.tensor(reference["hf_log_probs"])
    tp1_log_probs = torch.tensor(reference["mb1"]["log_probs"])
    entries = [rank["layouts"][layout] for rank in ranks]
    for entry in entries:
        share = entry["share"]
        if share:
            log_probs = torch.tensor(entry["log_probs"])
            assert float((log_probs - tp1_log_probs[share]).abs().max()) < LOG_PROB_TOL
            assert float((log_probs - hf_log_probs[share]).abs().max()) < LOG_PROB_TOL
        for step in ("step1", "step2"):
            assert math.isclose(entry[step]["grad_norm"], reference["mb1"][step]["grad_norm"], rel_tol=NORM_RTOL)
        for key in COMPARED_STATS:
            assert math.isclose(entry["step1"][key], reference["mb1"]["step1"][key], rel_tol=1e-5, abs_tol=1e-7), key
        for step in ("step1", "step2"):  # the same on every rank
            assert entry[step] == pytest.approx(entries[0][step], rel=1e-12, abs=1e-15)
    if not spec["dist_opt"]:  # full gradients are only on every rank without the distributed optimizer
        diff, name = _max_abs_diff(tensors[layout]["grads"], single_tensors["mb1"]["grads"])
        assert diff < GRAD_TOL, f"{name}: {diff}"
    diff, name = _max_abs_diff(tensors[layout]["weights"], single_tensors["mb1"]["weights"])
    assert diff < WEIGHT_TOL, f"{name}: {diff}"


def test_uneven_data_parallel_shares_run_the_same_number_of_micro_batches(layouts):
    ranks, _ = layouts
    for spec in LAYOUTS:
        entries = [rank["layouts"][spec["name"]] for rank in ranks]
        counts = {entry["synchronised_micro_batches"] for entry in entries}
        assert len(counts) == 1, spec["name"]
        assert counts.pop() == max(entry["local_micro_batches"] for entry in entries)
        if spec.get("vpp"):
            assert entries[0]["synchronised_micro_batches"] % spec["pp"] == 0  # interleaving needs a multiple
    dp4 = [rank["layouts"]["dp4"] for rank in ranks]
    assert sorted(len(entry["share"]) for entry in dp4) == [0, 1, 2, 4]  # one rank had no sequence at all
    assert len({entry["local_micro_batches"] for entry in dp4}) > 1


def test_context_parallel_layouts_pad_to_their_multiple(layouts):
    ranks, _ = layouts
    expected = {"cp2dp2": 4, "tp2cp2sp": 8, "pp2cp2": 4, "tp2dp2": 1}  # 2*CP (x TP under SP)
    for name, multiple in expected.items():
        assert {rank["layouts"][name]["pad_to_multiple_of"] for rank in ranks} == {multiple}, name


# ---------------------------------------------------------------------------------------------
# Two processes: context parallelism on three architectures
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def cp_architectures(tiny_model_dirs, tmp_path_factory):
    out = tmp_path_factory.mktemp("actor_cp_archs")
    kwargs = {"model_dirs": {arch: str(tiny_model_dirs[arch]) for arch in CP_ARCHS}, "out_dir": str(out)}
    result = run_torchrun_function(WORKER, "run_cp_architectures", nproc=2, kwargs=kwargs, timeout=420)
    result.check()
    return result.rank_results, {arch: torch.load(out / f"{arch}.pt") for arch in CP_ARCHS}


@pytest.mark.parametrize("arch", CP_ARCHS)
def test_context_parallel_equals_hf_and_cp1(cp_architectures, arch):
    ranks, tensors = cp_architectures
    saved = tensors[arch]
    entry = ranks[0]["architectures"][arch]
    assert entry["pad_to_multiple_of"] == 4
    assert any(length % 4 for length in entry["model_lengths"])  # padding to 2*CP happens
    for name in ("log_probs", "entropy"):
        diff = float((saved[f"cp_{name}"] - saved[f"hf_{name}"]).abs().max())
        assert diff < LOG_PROB_TOL, f"{name}: {diff}"
    diff, name = _max_abs_diff(saved["cp_grads"], saved["hf_grads"])
    assert diff < GRAD_TOL, f"{name}: {diff}"
    diff, name = _max_abs_diff(saved["cp2_weights"], saved["cp1_weights"])
    assert diff < WEIGHT_TOL, f"{name}: {diff}"
    for rank in ranks:  # the same statistics on both CP ranks, equal to CP=1's
        step = rank["architectures"][arch]
        assert math.isclose(step["cp2_step"]["grad_norm"], step["cp1_step"]["grad_norm"], rel_tol=NORM_RTOL)
        for key in COMPARED_STATS:
            assert math.isclose(step["cp2_step"][key], step["cp1_step"][key], rel_tol=1e-5, abs_tol=1e-6), key
