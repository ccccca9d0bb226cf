"""Save / resume of model + distributed optimizer + LR scheduler + RNG + step + trainer state.

Three launches on the tiny untied Qwen2 (see _train_worker.py for the training loop):
1. 4 processes at TP=1 x PP=2 x DP=2: a model-only save (no optimizer) to another root, then
   steps 1-2 saving after each in both optimizer formats (fully_reshardable to `root` with
   keep_last=1, dp_reshardable to `dp_root`), steps 3-4 (the uninterrupted reference losses), then
   a save at step 4 that raises while writing metadata.json on rank 0; step 2 is also saved
   fully_sharded_model_space to `ms_root`; then the same 4 steps with
   the non-distributed optimizer, saving step 2 to a third root; then 4 steps at TP=PP=1 x DP=4
   saving step 2 dp_reshardable.
2. 1 plain process (TP=PP=DP=1): resume from the latest checkpoint, step 3; resume the DP=4
   dp_reshardable checkpoint (DP changes 4 -> 1), steps 3-4; then `os._exit` half-way through saving
   step 3 (no clean-up runs).
3. 4 processes, fresh models and optimizers: resume at the saving layout, at TP=2 x DP=2, at
   TP=2 x PP=2 x DP=1, and (negative control) weights only; the fully_sharded_model_space
   checkpoint at TP=2 x DP=2 and TP=2 x PP=2 x DP=1; the same for a run with the
   non-distributed optimizer (same layout, TP=2 x DP=2); the dp_reshardable checkpoint at its
   layout, and a copy of it with garbage in one file of step 2 (resume falls back to step 1); run
   the steps after the checkpoint; then error cases (another model's shapes, optimizer state
   requested from the model-only checkpoint, distributed optimizer state into a non-distributed
   optimizer, dp_reshardable state at another TP / PP).

4. 4 processes, the tiny Qwen2-MoE (4 experts, a shared expert): 2 steps at EP=2 (DP=4, expert-DP=2),
   step 2 saved fully_reshardable and fully_sharded_model_space, step 3 the reference; each loaded at
   EP=4 (expert-DP=1) and PP=2 x EP=2, and refused by name at EP=1; and a step saved and resumed
   with the non-distributed optimizer at EP=2 (`_moe_checkpoint_worker.optimizer_state_across_expert_layouts`).

Tolerances: at the saving layout the resumed losses are bit-identical to the uninterrupted run
(asserted to 1e-6); at other layouts TP / DP reductions change the float32 summation order and
the losses (~6.2) agree to ~5e-7: asserted to 1e-5. Without the optimizer state the loss after
the first resumed update moves by ~1e-2, far outside that tolerance, so the test can fail.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from megatron_dapo.checkpoint import find_latest, is_complete_checkpoint, list_checkpoints, resolve_checkpoint_dir
from tests.support.torchrun_utils import run_torchrun_function

WORKER = Path(__file__).parent / "_train_worker.py"
MOE_WORKER = Path(__file__).parent / "_moe_checkpoint_worker.py"
SAME_LAYOUT_TOL = 1e-6
OTHER_LAYOUT_TOL = 1e-5
SAVE_LAYOUT = {"tp": 1, "pp": 2}
RESUME_LAYOUTS = [
    {"name": "same", "tp": 1, "pp": 2},
    {"name": "tp2_dp2", "tp": 2, "pp": 1},
    {"name": "tp2_pp2_dp1", "tp": 2, "pp": 2},
    {"name": "weights_only", "tp": 1, "pp": 2, "load_optimizer": False},
    {"name": "dp_same", "tp": 1, "pp": 2, "source": "dp"},
    {"name": "dp_fallback", "tp": 1, "pp": 2, "source": "dp_corrupt"},
    {"name": "ms_tp2_dp2", "tp": 2, "pp": 1, "source": "ms"},
    {"name": "ms_tp2_pp2_dp1", "tp": 2, "pp": 2, "source": "ms"},
    {"name": "local_same", "tp": 1, "pp": 2, "source": "local"},
    {"name": "local_tp2_dp2", "tp": 2, "pp": 1, "source": "local"},  # last: the error cases run at its layout
]


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("resume") / "checkpoints"


@pytest.fixture(scope="module")
def trained(tiny_model_dirs, root):
    result = run_torchrun_function(
        WORKER, "train_and_save", nproc=4, timeout=480,
        kwargs={"model_dir": str(tiny_model_dirs["qwen2"]), "root": str(root), "layout": SAVE_LAYOUT,
                "weights_root": str(root.parent / "weights_only"), "local_root": str(root.parent / "local"),
                "dp_root": str(root.parent / "dp"), "dp4_root": str(root.parent / "dp4"), "ms_root": str(root.parent / "ms")},
    )  # fmt: skip
    result.check()
    listing = sorted(p.name for p in root.iterdir())
    return result.rank_results, listing


@pytest.fixture(scope="module")
def crashed(tiny_model_dirs, root, trained):
    result = run_torchrun_function(
        WORKER, "resume_then_crash", nproc=1, use_torchrun=False, timeout=300,
        kwargs={"model_dir": str(tiny_model_dirs["qwen2"]), "root": str(root), "dp4_root": str(root.parent / "dp4")},
    )  # fmt: skip
    return result


@pytest.fixture(scope="module")
def resumed(tiny_model_dirs, root, crashed):
    result = run_torchrun_function(
        WORKER, "resume_layouts", nproc=4, timeout=540,
        kwargs={"model_dir": str(tiny_model_dirs["qwen2"]), "root": str(root), "layouts": RESUME_LAYOUTS,
                "qwen3_dir": str(tiny_model_dirs["qwen3"]), "weights_only_dir": str(root.parent / "weights_only"),
                "local_root": str(root.parent / "local"), "dp_root": str(root.parent / "dp"), "ms_root": str(root.parent / "ms")},
    )  # fmt: skip
    result.check()
    return result.rank_results


def test_saves_publish_atomically_and_prune(trained, root):
    results, listing = trained
    # step 1 was pruned by keep_last=1; the failed step-4 save left only its temp directory.
    assert listing == [".tmp-step_00000004", "latest", "step_00000002"]
    assert (root / "latest").read_text().strip() == "step_00000002"
    assert not (root / ".tmp-step_00000004" / "metadata.json").exists()
    assert results[0]["failed_save"].startswith("RuntimeError: injected failure")
    for other in results[1:]:
        assert other["failed_save"].startswith("CheckpointError: publishing the checkpoint failed on rank 0")
    meta = json.loads((root / "step_00000002" / "metadata.json").read_text())
    assert meta["step"] == 2 and meta["contents"]["optimizer"] == "distributed"
    assert meta["layout"] == {"tp": 1, "pp": 2, "vpp": None, "cp": 1, "ep": 1, "dp": 2, "world_size": 4}
    assert sorted(p.name for p in (root / "step_00000002" / "rng").iterdir()) == [f"rank_{r:05d}.pt" for r in range(4)]
    assert (root / "step_00000002" / "hf" / "config.json").is_file()


def test_crash_mid_save_keeps_the_previous_checkpoint(crashed, root, trained):
    assert crashed.returncode == 17, crashed.tail()
    assert (root / "latest").read_text().strip() == "step_00000002"
    temp = root / ".tmp-step_00000003"
    assert temp.is_dir() and any((temp / "dist").iterdir()) and not is_complete_checkpoint(temp)
    assert find_latest(root) == root / "step_00000002"
    assert resolve_checkpoint_dir(root) == root / "step_00000002"
    assert [step for step, _ in list_checkpoints(root)] == [2]
    # Before dying it resumed at TP=PP=DP=1 (another layout) and reproduced the reference step 3.
    resumed = crashed.rank_results[0]
    reference = trained[0][0]["losses"]
    assert resumed["step"] == 2 and not resumed["rng_restored"]
    assert abs(resumed["loss3"] - reference["3"]) <= OTHER_LAYOUT_TOL


def test_resume_at_the_same_layout_continues_exactly(resumed, trained):
    reference = trained[0][0]["losses"]
    for rank, result in enumerate(resumed):
        entry = result["layouts"]["same"]
        assert entry["step"] == 2 and entry["path"].endswith("step_00000002")  # the crashed temp dirs are ignored
        assert entry["optimizer_loaded"] and entry["scheduler_loaded"] and entry["rng_restored"]
        for step in ("3", "4"):
            assert abs(entry["losses"][step] - reference[step]) <= SAME_LAYOUT_TOL, (rank, step, entry["losses"], reference)
        # RNG streams continue where the saving run left them (python, numpy, torch), per rank.
        assert entry["rng_draw"] == trained[0][rank]["rng_after_save"]
        assert entry["trainer_state"] == {"next_step": 3, "losses": {"1": reference["1"], "2": reference["2"]}}
        assert entry["config"] == {"layout": SAVE_LAYOUT, "lr": 0.003}


@pytest.mark.parametrize("layout", ["tp2_dp2", "tp2_pp2_dp1"])
def test_resume_at_another_layout_reshards_model_and_optimizer(layout, resumed, trained):
    reference = trained[0][0]["losses"]
    for rank, result in enumerate(resumed):
        entry = result["layouts"][layout]
        assert entry["optimizer_loaded"] and entry["scheduler_loaded"]
        assert not entry["rng_restored"] and any("RNG states not restored" in n for n in entry["notes"])
        for step in ("3", "4"):
            assert abs(entry["losses"][step] - reference[step]) <= OTHER_LAYOUT_TOL, (rank, layout, step, entry["losses"], reference)


@pytest.mark.parametrize("layout, tol", [("local_same", SAME_LAYOUT_TOL), ("local_tp2_dp2", OTHER_LAYOUT_TOL)])
def test_non_distributed_optimizer_resumes_too(layout, tol, resumed, trained):
    reference = trained[0][0]["local_losses"]
    for rank, result in enumerate(resumed):
        entry = result["layouts"][layout]
        assert entry["optimizer_loaded"] and entry["scheduler_loaded"]
        for step in ("3", "4"):
            assert abs(entry["losses"][step] - reference[step]) <= tol, (rank, layout, step, entry["losses"], reference)


def test_without_optimizer_state_the_run_diverges(resumed, trained):
    """Negative control: the loss comparison above does see a missing optimizer state."""
    reference = trained[0][0]["losses"]
    entry = resumed[0]["layouts"]["weights_only"]
    assert not entry["optimizer_loaded"] and not entry["scheduler_loaded"]
    assert abs(entry["losses"]["3"] - reference["3"]) <= SAME_LAYOUT_TOL  # same weights
    assert abs(entry["losses"]["4"] - reference["4"]) > 100 * OTHER_LAYOUT_TOL  # different update


def test_clear_errors_when_the_checkpoint_does_not_fit(resumed):
    errors = resumed[0]["errors"]
    assert "another global shape" in errors["other_model"] and "linear_qkv.weight" in errors["other_model"]
    assert "holds no optimizer state" in errors["no_optimizer_state"] and "load_optimizer=False" in errors["no_optimizer_state"]
    assert errors["weights_only_step"] == 0  # the model-only checkpoint loads with load_optimizer=False
    assert "distributed optimizer but this run uses a local one" in errors["optimizer_kind"]


# ------------------------------------------------------------------ dp_reshardable, spread saves, checksums


def _bytes_per_rank(checkpoint: Path) -> tuple[dict[int, int], dict[int, int]]:
    """(all tensor bytes, optimizer-state bytes) each rank wrote, from DCP's index of the checkpoint."""
    from torch.distributed.checkpoint import FileSystemReader

    total: dict[int, int] = {}
    optimizer: dict[int, int] = {}
    for index, info in FileSystemReader(str(checkpoint / "dist")).read_metadata().storage_data.items():
        rank = int(info.relative_path.split("_")[2])
        total[rank] = total.get(rank, 0) + info.length
        if index.fqn.startswith("optimizer."):
            optimizer[rank] = optimizer.get(rank, 0) + info.length
    return total, optimizer


def test_dp_reshardable_save_is_spread_over_the_data_parallel_ranks(trained, root):
    """Item 4: the fully_reshardable save funnels all optimizer state through DP rank 0; the
    dp_reshardable one has every rank write its own optimizer shard, and the fully parallel save
    shares the weights out so that every rank writes about as much, in 2 files (writer threads) each."""
    results, _ = trained
    dp_rank = {rank: r["dp_rank"] for rank, r in enumerate(results)}
    assert sorted(dp_rank.values()) == [0, 0, 1, 1]
    fully_total, fully_optimizer = _bytes_per_rank(root / "step_00000002")
    spread_total, spread_optimizer = _bytes_per_rank(root.parent / "dp" / "step_00000002")
    for rank in range(4):
        assert len(list((root.parent / "dp" / "step_00000002" / "dist").glob(f"__{rank}_*.distcp"))) == 2
    assert all(fully_optimizer.get(r, 0) == 0 for r in range(4) if dp_rank[r] == 1), fully_optimizer
    assert all(fully_optimizer[r] > 0 for r in range(4) if dp_rank[r] == 0), fully_optimizer
    assert min(spread_optimizer.values()) > 0.8 * max(spread_optimizer.values()) and len(spread_optimizer) == 4, spread_optimizer
    assert min(spread_total.values()) > 0.8 * max(spread_total.values()), spread_total
    # The same optimizer state in the end (dp_reshardable adds the padding between parameters).
    assert 0.95 < sum(spread_optimizer.values()) / sum(fully_optimizer.values()) < 1.1, (spread_optimizer, fully_optimizer)


def test_every_file_has_a_correct_checksum(trained, root):
    import zlib

    for checkpoint in (root / "step_00000002", root.parent / "dp" / "step_00000002"):
        meta = json.loads((checkpoint / "metadata.json").read_text())
        files = sorted(p.relative_to(checkpoint).as_posix() for p in checkpoint.rglob("*") if p.is_file())
        assert sorted(meta["files"]) == [f for f in files if f != "metadata.json"]
        algorithm = meta["checksum"]
        for rel, entry in meta["files"].items():
            data = (checkpoint / rel).read_bytes()
            if algorithm == "crc32":
                expected = zlib.crc32(data)
            else:
                google_crc32c = pytest.importorskip("google_crc32c")
                expected = google_crc32c.value(data)
            assert entry == {"bytes": len(data), algorithm: f"{expected:08x}"}, rel


def test_dp_reshardable_resumes_exactly_at_its_layout(resumed, trained):
    reference = trained[0][0]["losses"]
    for rank, result in enumerate(resumed):
        entry = result["layouts"]["dp_same"]
        assert entry["step"] == 2 and entry["optimizer_loaded"] and entry["scheduler_loaded"] and entry["rng_restored"]
        for step in ("3", "4"):
            assert abs(entry["losses"][step] - reference[step]) <= SAME_LAYOUT_TOL, (rank, step, entry["losses"], reference)


def test_dp_reshardable_resumes_at_another_data_parallel_size(crashed, trained):
    """Saved at DP=4, loaded in one process (DP=1, same TP / PP): the optimizer state reshards over DP."""
    reference = trained[0][0]["dp4_losses"]
    result = crashed.rank_results[0]
    assert result["dp4_step"] == 2 and result["dp4_optimizer_loaded"]
    for step in ("3", "4"):
        assert abs(result["dp4_losses"][step] - reference[step]) <= OTHER_LAYOUT_TOL, (step, result, reference)


def test_dp_reshardable_at_another_layout_is_a_named_error(resumed):
    errors = resumed[0]["errors"]
    message = errors["dp_layout"]
    assert "dp_reshardable" in message and "tp 1 -> 2" in message and "pp 2 -> 1" in message, message
    assert "fully reshardable" in message and "weights only" in message
    assert errors["dp_weights_only_step"] == 2  # its weights load at any layout


def test_resume_falls_back_from_a_corrupt_checkpoint_under_torchrun(resumed, trained):
    """4 KiB of garbage inside one data file of step 2 (DP=2 under torchrun): every rank skips step 2,
    names the file, and continues from step 1 exactly like the uninterrupted run."""
    reference = trained[0][0]["losses"]
    for rank, result in enumerate(resumed):
        entry = result["layouts"]["dp_fallback"]
        assert entry["step"] == 1 and entry["path"].endswith("step_00000001")
        assert len(entry["skipped"]) == 1, entry["skipped"]
        corrupted = entry["corrupted"]  # "step_00000002/dist/__1_<n>.distcp"
        assert "step_00000002" in entry["skipped"][0] and corrupted.split("/", 1)[1] in entry["skipped"][0]
        assert "is corrupt" in entry["skipped"][0]
        assert any(n.startswith("skipped ") for n in entry["notes"])
        for step in ("2", "3", "4"):
            assert abs(entry["losses"][step] - reference[step]) <= SAME_LAYOUT_TOL, (rank, step, entry["losses"], reference)


# ------------------------------------------------------------------ fully_sharded_model_space


def _full_tensors(checkpoint: Path, scratch: Path) -> dict:
    """Every tensor of a checkpoint, whole (DCP's offline conversion, no process group)."""
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    target = scratch / f"{checkpoint.parent.name}.pt"
    dcp_to_torch_save(str(checkpoint / "dist"), str(target))
    return {k: v for k, v in torch.load(target, weights_only=False).items() if isinstance(v, torch.Tensor)}


def test_model_space_save_is_spread_and_holds_the_fully_reshardable_tensors(trained, root, tmp_path):
    """Item 26.7: the fully_sharded_model_space save has every rank write its own part of the optimizer
    state (fully_reshardable gathers it all into the DP-rank-0 ranks), and the tensors it holds are
    those of the fully_reshardable checkpoint of the same step, key for key, bit for bit."""
    import torch

    results, _ = trained
    dp_rank = {rank: r["dp_rank"] for rank, r in enumerate(results)}
    model_space = root.parent / "ms" / "step_00000002"
    meta = json.loads((model_space / "metadata.json").read_text())
    assert meta["contents"]["optimizer_sharding"] == "fully_sharded_model_space"
    _, fully_optimizer = _bytes_per_rank(root / "step_00000002")
    _, spread_optimizer = _bytes_per_rank(model_space)
    assert all(fully_optimizer.get(r, 0) == 0 for r in range(4) if dp_rank[r] == 1), fully_optimizer
    assert len(spread_optimizer) == 4 and min(spread_optimizer.values()) > 0.8 * max(spread_optimizer.values()), spread_optimizer
    for rank in range(4):
        assert len(list((model_space / "dist").glob(f"__{rank}_*.distcp"))) == 2
    fully, spread = _full_tensors(root / "step_00000002", tmp_path), _full_tensors(model_space, tmp_path)
    assert sorted(spread) == sorted(fully)
    state_keys = [k for k in fully if k.startswith("optimizer.state.")]
    assert {k.split(".")[2] for k in state_keys} == {"param", "exp_avg", "exp_avg_sq"}
    assert len(state_keys) == 3 * len([k for k in fully if not k.startswith("optimizer.")]), sorted(fully)
    for key, tensor in fully.items():
        assert spread[key].dtype == tensor.dtype and torch.equal(spread[key], tensor), key


@pytest.mark.parametrize("layout, reference", [("ms_tp2_dp2", "tp2_dp2"), ("ms_tp2_pp2_dp1", "tp2_pp2_dp1")])
def test_model_space_resumes_at_another_layout_like_fully_reshardable(layout, reference, resumed, trained):
    """Saved at TP=1 x PP=2 x DP=2, loaded at TP=2 (and PP=1 or DP=1): every rank's optimizer state as
    loaded is bit-identical to what the fully_reshardable checkpoint of the same step loads there,
    and so are the losses of the steps after it (within the cross-layout tolerance of the
    uninterrupted run's)."""
    uninterrupted = trained[0][0]["losses"]
    for rank, result in enumerate(resumed):
        entry, fully = result["layouts"][layout], result["layouts"][reference]
        assert entry["optimizer_sharding"] == "fully_sharded_model_space" and fully["optimizer_sharding"] == "fully_reshardable"
        assert entry["step"] == 2 and entry["optimizer_loaded"] and entry["scheduler_loaded"] and not entry["rng_restored"]
        assert entry["optimizer_digest"] == fully["optimizer_digest"], (rank, layout)
        assert entry["losses"] == fully["losses"], (rank, layout, entry["losses"], fully["losses"])
        for step in ("3", "4"):
            assert abs(entry["losses"][step] - uninterrupted[step]) <= OTHER_LAYOUT_TOL, (rank, layout, step)
    # The digest sees a missing optimizer state: the weights-only resume at the saving layout differs.
    assert resumed[0]["layouts"]["weights_only"]["optimizer_digest"] != resumed[0]["layouts"]["same"]["optimizer_digest"]


MOE_SAVE = {"ep": 2}
MOE_LOADS = [{"name": "ep4", "ep": 4}, {"name": "pp2_ep2", "pp": 2, "ep": 2}, {"name": "ep1", "ep": 1, "refused": True}]
# EP=1 is refused: Megatron gives the experts an optimizer of their own only at EP > 1, and the state
# of a ChainedOptimizer of two does not load into one (either fully reshardable format).
RESUMED_MOE_LOADS = [spec["name"] for spec in MOE_LOADS if not spec.get("refused")]


@pytest.fixture(scope="module")
def moe_formats(tmp_path_factory) -> tuple[Path, list]:
    from tests.support.tiny_models import save_tiny_model

    work = tmp_path_factory.mktemp("moe_formats")
    model_dir = save_tiny_model("qwen2_moe", work / "hf", seed=11)
    result = run_torchrun_function(
        MOE_WORKER, "optimizer_state_across_expert_layouts", nproc=4, timeout=480,
        kwargs={"model_dir": str(model_dir), "root": str(work / "checkpoints"), "save": MOE_SAVE, "loads": MOE_LOADS},
    )  # fmt: skip
    result.check()
    return work / "checkpoints", result.rank_results


def test_model_space_moe_checkpoint_holds_the_fully_reshardable_tensors(moe_formats, tmp_path):
    """Experts are sharded over the expert data-parallel group and saved under a prepended expert
    axis: the model-space save of them is still the fully_reshardable tensors, bit for bit."""
    import torch

    root, _ = moe_formats
    fully = _full_tensors(root / "fully_reshardable" / "step_00000002", tmp_path)
    spread = _full_tensors(root / "fully_sharded_model_space" / "step_00000002", tmp_path)
    assert sorted(spread) == sorted(fully)
    experts = [k for k in fully if k.startswith("optimizer.state.exp_avg.") and ".experts." in k]
    assert experts and any("shared_experts" in k for k in fully), sorted(fully)
    for key, tensor in fully.items():
        assert torch.equal(spread[key], tensor), key


@pytest.mark.parametrize("layout", RESUMED_MOE_LOADS)
def test_model_space_moe_resumes_at_another_expert_layout_like_fully_reshardable(layout, moe_formats):
    _, results = moe_formats
    reference = results[0]["losses"]["3"]
    for rank, result in enumerate(results):
        fully, spread = result["loads"][layout]["fully_reshardable"], result["loads"][layout]["fully_sharded_model_space"]
        assert (fully["sharding"], spread["sharding"]) == ("fully_reshardable", "fully_sharded_model_space")
        assert spread["step"] == 2 and spread["digest"] == fully["digest"], (rank, layout)
        assert spread["loss3"] == fully["loss3"] and abs(spread["loss3"] - reference) <= OTHER_LAYOUT_TOL, (rank, layout, spread, reference)


def test_moe_optimizer_state_saved_at_ep2_is_refused_by_name_at_ep1(moe_formats):
    _, results = moe_formats
    for result in results:
        for fmt, entry in result["loads"]["ep1"].items():
            assert entry["error"] and "holds the state of 2 optimizer(s), this run has 1" in entry["error"], (fmt, entry)
            assert "parallel.ep > 1" in entry["error"] and "weights only" in entry["error"]


def test_moe_with_the_non_distributed_optimizer_resumes(moe_formats):
    """At EP > 1 the non-distributed optimizer is a chain of two too: its periodic checkpoint resumes
    (it was saved with Megatron's "chained_<i>." key prefix and asked for without it)."""
    _, results = moe_formats
    for rank, result in enumerate(results):
        local = result["local"]
        assert local["optimizer_loaded"] and abs(local["resumed"] - local["reference"]) <= SAME_LAYOUT_TOL, (rank, local)
