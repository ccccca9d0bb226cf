"""Rollout routing replay in the actor (`actor.routing`), against HF transformers, under torchrun + gloo.

One 4-process launch runs, for the tiny Qwen3-MoE and Qwen2-MoE, each layout on its data-parallel
shares with several micro-batches of different padded lengths: DP=4, TP=2 x SP (DP=2), CP=2 (DP=2),
PP=2 (DP=2; with full activation recompute checked), EP=2 (DP=4):

- replay: with a random routing (k distinct experts per token and layer, unlike what the routers
  choose) given as `PolicyBatch.routed_experts`, the actor's log-probs equal HF transformers' with
  its routers forced to the same experts (1e-5) and differ from the unreplayed ones (so the replay
  took effect on every layer and every token position a log-prob depends on);
- record: the routing the actor reports without replay equals HF's own routers' choice on 100% of
  (token, layer) pairs the model reads, every one of them written on the stage that holds the layer;
- recompute: an update's gradients with the routing replayed are the same with full activation
  recompute (the backward's re-run takes Megatron's REPLAY_BACKWARD queue) as without.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.tiny_models import MOE_ARCHS, save_tiny_model
from tests.support.torchrun_utils import run_torchrun_function

pytestmark = pytest.mark.launch

WORKER = Path(__file__).parent / "_routing_worker.py"
TOL = 1e-5
LAYOUTS = [
    {"name": "dp4"},
    {"name": "tp2sp", "tp": 2, "sp": True},
    {"name": "cp2", "cp": 2},
    {"name": "pp2_recompute", "pp": 2, "recompute_check": True},
    {"name": "ep2", "ep": 2},
]
LAYOUT_NAMES = [spec["name"] for spec in LAYOUTS]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    root = tmp_path_factory.mktemp("routing_models")
    model_dirs = {arch: str(save_tiny_model(arch, root / arch, seed=index)) for index, arch in enumerate(MOE_ARCHS)}
    kwargs = {"model_dirs": model_dirs, "out_dir": str(root), "layouts": LAYOUTS}
    result = run_torchrun_function(WORKER, "run_layouts", nproc=4, kwargs=kwargs, timeout=600)
    result.check()
    return {name: [r["layouts"][name] for r in result.rank_results] for name in LAYOUT_NAMES}


@pytest.mark.parametrize("layout", LAYOUT_NAMES)
@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_replayed_routing_gives_hf_log_probs_under_that_routing(results, layout, arch):
    ranks = [r[arch] for r in results[layout]]
    assert sum(r["sequences"] for r in ranks) >= 7  # every sequence is on some data-parallel rank
    for rank, r in enumerate(ranks):
        if not r["sequences"]:
            continue
        assert r["replay_max_abs_diff"] <= TOL, f"rank {rank}: |actor - HF| = {r['replay_max_abs_diff']:.2e}"
        assert r["replay_changes_log_probs"] > 1e-3, f"rank {rank}: the replay changed nothing"


@pytest.mark.parametrize("layout", LAYOUT_NAMES)
@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_recorded_routing_is_hf_routing_on_every_token(results, layout, arch):
    ranks = [r[arch] for r in results[layout]]
    layers = set()
    for rank, r in enumerate(ranks):
        layers.update(r["record_layers"])
        assert r["record_unwritten"] == 0, f"rank {rank}: {r['record_unwritten']} read (token, layer) pairs not recorded"
        assert r["record_equal"] == r["record_compared"], f"rank {rank}: {r['record_equal']}/{r['record_compared']} equal"
        assert r["record_log_probs_equal_plain"], f"rank {rank}: recording changed the log-probs"
    assert layers == {0, 1}
    assert sum(r["record_compared"] for r in ranks) > 0


@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_replay_under_full_recompute_gives_the_same_gradients(results, arch):
    for rank, r in enumerate(results["pp2_recompute"]):
        r = r[arch]
        assert r["micro_batches"] >= 2  # the backward queue spans several micro-batches
        assert r["recompute_grad_max_abs_diff"] <= 1e-6, f"rank {rank}: {r['recompute_grad_max_abs_diff']:.2e}"
        assert r["replay_changes_grads"] > 1e-4, f"rank {rank}: replay did not change the gradients"
