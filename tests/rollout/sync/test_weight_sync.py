"""Resharding: the actor's Megatron shards -> HF-named tensors -> a rollout engine, bucket by bucket.

Four processes over gloo, one launch per engine (see _sync_worker.py): actor layouts TP2xPP2, TP1
(x DP4), TP2 (x DP2), PP2 (x DP2) and PP2xVPP2 (x DP2), the engine on rank 0 only, through the
trainer's `RolloutGroup.sync_weights`; the TP layouts in both sync modes (the TP gather, and the
shared-memory hand-over where each TP rank writes only its own slices). A third launch: a TP=2
actor feeding a TP=2 vLLM engine (two vLLM workers, each reading its own slices):

* after a sync every engine tensor equals the actor's HF export bit for bit, and every one of them
  was stale before it (so the check can fail); the embedded engine reports none left unloaded;
* every rank's TP-shard stream equals narrow() of the full export;
* buckets respect the size limit and no more than one bucket of yielded tensors is alive at once;
* the engine's log-probs of its own sampled responses equal the actor's forward-only log-probs:
  |diff| mean < 1e-5, max < MAX_LOGPROB_DIFF (float32 on both sides; observed: mean ~7e-7, max ~3e-6
  for the embedded engine), before and after one real optimizer step;
* 100 consecutive update + sync rounds at TP2xPP2 (both sync modes) with the embedded engine, 10
  at its other layouts, 5 at every layout with vLLM: after each, the engine's per-tensor
  checksums equal those of an independently updated HF mirror, and every checksum changed since
  the previous round (a stale tensor would show).

The vLLM launch uses the tiny Qwen3 (head_dim 32: vLLM's CPU attention needs 32 or 64) and vLLM's
own read-back (`VLLMEngine.named_weights`, which reads the weights through its kernels). Without
vLLM the test skips, except under CI (`tests/support/ci.py`: CI=true, 1 or yes) where it fails.

The three launches start two at a time (`launches`). The parts that need no process group run in
one process: bucketing (tests/model/test_bucketing.py), the TP-shard rule (test_shards.py), the dispatcher
(test_dispatch.py).
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from tests.support.torchrun_utils import run_torchrun_script, two_at_a_time

WORKER = Path(__file__).parent / "_sync_worker.py"
LAYOUTS = [
    {"name": "tp2pp2", "tp": 2, "pp": 2, "rounds": 100, "dist_opt": True, "sync_mode": "shared_memory"},
    {"name": "tp2pp2_gather", "tp": 2, "pp": 2, "rounds": 100, "dist_opt": True, "sync_mode": "gather"},
    {"name": "tp1", "tp": 1, "pp": 1, "rounds": 10, "liveness": True, "dist_opt": False, "sync_mode": "gather"},
    {"name": "tp2", "tp": 2, "pp": 1, "rounds": 10, "dist_opt": True, "sync_mode": "shared_memory"},
    {"name": "tp2_gather", "tp": 2, "pp": 1, "rounds": 10, "dist_opt": True, "sync_mode": "gather"},
    {"name": "pp2", "tp": 1, "pp": 2, "rounds": 10, "dist_opt": False, "sync_mode": "gather"},
    {"name": "pp2vpp2", "tp": 1, "pp": 2, "vpp": 2, "rounds": 10, "dist_opt": True, "sync_mode": "gather"},
]
# vLLM: the same layouts, 5 rounds each. The many-round checks of the actor side (every layout's
# stream over 100 updates) are the embedded engine's; the engine side of a round does not depend
# on the actor layout, and a vLLM round costs 0.5-2 s here. The stream's liveness is measured once.
VLLM_LAYOUTS = [{key: value for key, value in {**spec, "rounds": 5}.items() if key != "liveness"} for spec in LAYOUTS]
# The engine's TP equals the actor's: a 2-worker vLLM engine fed by a TP=2 actor (2 processes).
VLLM_TP2_LAYOUTS = [{"name": "tp2_engine_tp2", "tp": 2, "pp": 1, "rounds": 10, "dist_opt": True, "sync_mode": "shared_memory"}]
BUCKET_MB = 0.03  # ~31 KB: the tiny model (~0.75 MB) travels in ~20 buckets, the embedding alone
# The rounds check that no tensor goes stale over many syncs, not the bucketing (the first two syncs
# of each layout do): they sync in ~3 buckets, which makes a round ~5x cheaper here than in ~20.
ROUNDS_BUCKET_MB = 0.25
MEAN_LOGPROB_DIFF = 1e-5
MAX_LOGPROB_DIFF = 5e-5


def _launch(model_dir: Path, engine: str, timeout: float, layouts=LAYOUTS, nproc: int = 4, engine_tp: int = 1):
    kwargs = {"model_dir": str(model_dir), "layouts": layouts, "engine_kind": engine, "bucket_mb": BUCKET_MB, "engine_tp": engine_tp,
              "rounds_bucket_mb": ROUNDS_BUCKET_MB}  # fmt: skip
    return run_torchrun_script(WORKER, nproc=nproc, args=[json.dumps(kwargs)], timeout=timeout, preloaded=True)


def _rank_results(result):
    result.check()
    assert all(r is not None and "error" not in r for r in result.rank_results), result.tail()
    return result.rank_results


@pytest.fixture(scope="module")
def launches(tiny_model_dirs):
    """The three launches, two at a time, longest first (the vLLM ones only where vLLM imports; their
    tests then fail or skip through `require_vllm`): name -> TorchrunResult."""
    jobs = {
        "vllm": lambda: _launch(tiny_model_dirs["qwen3"], "vllm", timeout=900, layouts=VLLM_LAYOUTS),
        "embedded": lambda: _launch(tiny_model_dirs["qwen2"], "embedded", timeout=600),
        "vllm_tp2": lambda: _launch(tiny_model_dirs["qwen3"], "vllm", timeout=900, layouts=VLLM_TP2_LAYOUTS, nproc=2, engine_tp=2),
    }
    if importlib.util.find_spec("vllm") is None:
        jobs = {"embedded": jobs["embedded"]}
    return two_at_a_time(jobs)


@pytest.fixture(scope="module")
def embedded_results(launches):
    return _rank_results(launches["embedded"])


@pytest.fixture(scope="module")
def vllm_results(require_vllm, launches):
    return _rank_results(launches["vllm"])


@pytest.fixture(scope="module")
def vllm_tp2_results(require_vllm, launches):
    return _rank_results(launches["vllm_tp2"])


def _summary(rank_results, engine: str) -> str:
    """One line per layout (shown with `pytest -s`): timings and the observed log-prob mismatch."""
    lines = [f"{engine}: engine start {rank_results[0].get('engine_start_seconds', 0):.1f} s"]
    for name, r in rank_results[0]["layouts"].items():
        m, u = r["mismatch"], r["mismatch_after_update"]
        lines.append(
            f"  {name} ({r['sync_mode']}): {r['seconds']:.1f} s ({len(r['rounds'])} rounds {r['rounds_seconds']:.1f} s); log-prob |diff| "
            f"mean {m['mean_abs']:.2e} max {m['max_abs']:.2e}; after update mean {u['mean_abs']:.2e} max {u['max_abs']:.2e}"
        )
    return "\n".join(lines)


def _check_layouts(rank_results, engine: str, layouts=LAYOUTS) -> None:
    print(_summary(rank_results, engine))
    rank0 = rank_results[0]["layouts"]
    for spec in layouts:
        name = spec["name"]
        result = rank0[name]
        assert result["sync_mode"] == spec["sync_mode"], name
        # The engine was stale everywhere before the sync, identical to the export after it.
        assert result["stale_before_sync"] == result["expected_tensors"], name
        for key in ("after_sync", "after_update_sync"):
            check = result[key]
            assert check["missing"] == [] and check["differ"] == [], (name, key, check)
            assert check["num_compared"] == result["expected_tensors"]
        if engine == "embedded":
            assert result["after_sync"]["extra"] == [] and result["not_loaded"] == [], name
        # Stream accounting: every byte once, in buckets no bigger than the limit (or one tensor).
        sync = result["sync"]
        assert sync["num_tensors"] == result["expected_tensors"]
        if spec["sync_mode"] == "gather":
            assert sync["bytes"] == result["expected_bytes"]
        else:  # rank 0 streamed only its own slices (plus the small replicated norms)
            assert result["expected_bytes"] / spec["tp"] <= sync["bytes"] < 0.75 * result["expected_bytes"], (name, sync)
        assert sync["num_buckets"] > 5
        assert sync["peak_bucket_bytes"] <= max(int(BUCKET_MB * 2**20), result["largest_tensor_bytes"])
        # Log-prob mismatch of sampled responses, before and after one real optimizer step.
        for key in ("mismatch", "mismatch_after_update"):
            m = result[key]
            assert m["tokens"] > 20, (name, m)
            assert m["mean_abs"] < MEAN_LOGPROB_DIFF and m["max_abs"] < MAX_LOGPROB_DIFF, (name, key, m)
        assert result["update"]["num_optimizer_steps"] == 1.0 and result["update"]["grad_norm"] > 0
        # Update + sync rounds: no stale tensor, and every tensor changed in every round.
        assert len(result["rounds"]) == spec["rounds"], name
        for index, round_result in enumerate(result["rounds"]):
            assert round_result["stale_or_wrong"] == [], (name, index, round_result)
            assert round_result["unchanged_since_last_round"] == [], (name, index, round_result)
    # Every rank (engine owner or not) checked its own TP-shard stream.
    for rank, rank_result in enumerate(rank_results):
        for name, layout in rank_result["layouts"].items():
            shards = layout["shards"]
            assert shards["bad"] == [] and shards["names_in_order"], (rank, name, shards)
    tp2_ranks = {r["layouts"][layouts[0]["name"]]["shards"]["tp_rank"] for r in rank_results}
    assert tp2_ranks == {0, 1}


def test_sync_into_embedded_engine_all_layouts(embedded_results):
    _check_layouts(embedded_results, "embedded")
    liveness = embedded_results[0]["layouts"]["tp1"]["liveness"]
    # Never more than one bucket of yielded tensors alive: the stream does not hold the model.
    assert liveness["peak_live_bytes"] <= liveness["peak_bucket_bytes"] < liveness["total_bytes"] / 5


def test_sync_into_vllm_all_layouts(vllm_results):
    _check_layouts(vllm_results, "vllm", VLLM_LAYOUTS)


def test_tp2_actor_hands_its_shards_to_a_tp2_vllm_engine(vllm_tp2_results):
    """The engine's TP equals the actor's: each vLLM worker reads its slices of the shared bucket files."""
    _check_layouts(vllm_tp2_results, "vllm", VLLM_TP2_LAYOUTS)
