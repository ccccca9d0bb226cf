"""Rollout routing replay through the real trainer (the CLI, the demo's tiny Qwen3-MoE, one process).

* bfloat16, the embedded engine, `actor.router_replay` r2 and r3, two steps each. Step 1 of both runs
  generates the same responses (same weights, same seeds), so their rollout/trainer mismatch is a
  paired comparison of the old-log-prob pass: r2 routes as the actor likes there (as "off" does), so
  some tokens go to other experts than in the engine (`rollout_mismatch/routing_token_frac` > 0) and
  their log-probs jump; r3 replays the engine's routing and its mismatch is smaller, its largest
  token error several times smaller. The r2 run's update replays the routing it recorded.
* float32, SGLang's CPU engine, r3: SGLang returns each token's routed experts, the actor replays
  them, and the MoE weights are pushed into SGLang after each step (a stale or partial push after
  step 1 would show as a large mismatch at step 2).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.trainer_runs import CONFIG, FAST, assert_ok, assert_weights_pushed_every_step, read_metrics, run_cli, workspace_overrides

pytestmark = pytest.mark.launch

STEPS = ["trainer.total_steps=2"]
ROUTING_KEYS = ("rollout_mismatch/routing_token_frac", "rollout_mismatch/routing_layer_frac")


@pytest.fixture(scope="module")
def bf16_runs(moe_workspace, tmp_path_factory) -> dict[str, dict[int, dict]]:
    root = tmp_path_factory.mktemp("replay-runs")
    metrics = {}
    for mode in ("r2", "r3"):
        out = root / mode
        assert_ok(run_cli("train", "--config", str(CONFIG), *FAST, *STEPS, "model.dtype=bfloat16",
                          f"actor.router_replay={mode}", *workspace_overrides(moe_workspace, out), timeout=600))  # fmt: skip
        metrics[mode] = read_metrics(out)
    return metrics


def test_replaying_the_engines_routing_shrinks_the_mismatch(bf16_runs):
    r2, r3 = bf16_runs["r2"], bf16_runs["r3"]
    assert sorted(r2) == sorted(r3) == [1, 2]
    for runs in (r2, r3):
        for step in (1, 2):
            assert runs[step]["actor/grad_norm"] > 0 and runs[step]["weight_sync/seconds"] > 0
    # Step 1: the same generations; only the old-log-prob pass differs.
    assert r2[1]["rollout_mismatch/tokens"] == r3[1]["rollout_mismatch/tokens"]
    assert r2[1]["rollout_mismatch/routing_token_frac"] > 0, r2[1]
    assert r2[1]["rollout_mismatch/routing_layer_frac"] <= r2[1]["rollout_mismatch/routing_token_frac"]
    assert r3[1]["rollout_mismatch/mean_abs"] < r2[1]["rollout_mismatch/mean_abs"], (r3[1], r2[1])
    assert 2 * r3[1]["rollout_mismatch/max_abs"] < r2[1]["rollout_mismatch/max_abs"], (r3[1], r2[1])
    for step in (1, 2):
        assert not any(key in r3[step] for key in ROUTING_KEYS)  # replayed: nothing to compare
        assert all(key in r2[step] for key in ROUTING_KEYS)


@pytest.mark.usefixtures("require_sglang")
def test_sglang_engine_returns_the_routing_the_actor_replays(moe_workspace, tmp_path):
    out = tmp_path / "sglang-r3"
    assert_ok(run_cli("train", "--config", str(CONFIG), *FAST, *STEPS, "rollout.engine=sglang", "actor.router_replay=r3",
                      *workspace_overrides(moe_workspace, out), timeout=900))  # fmt: skip
    metrics = read_metrics(out)
    assert_weights_pushed_every_step(metrics, steps=2)
    for step in (1, 2):
        assert metrics[step]["rollout_mismatch/mean_abs"] < 1e-4, metrics[step]
        assert metrics[step]["actor/moe_load_ratio_max"] >= 1
