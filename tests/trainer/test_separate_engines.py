"""vLLM's CPU build and SGLang's CPU engine on a rollout rank of their own (`rollout.placement=separate`).

Three processes: a TP=2 trainer and one rollout rank owning the engine. Synchronous, the engine
samples with the actor's weights of each step (pushed over the bridge): its sampled-token log-probs
equal the actor's to float32 noise (`rollout_mismatch/max_abs`). vLLM runs one step off
(`trainer.max_staleness=1`; one vLLM start covers both checks): its first step is generated with the
weights it trains from (the first push, equal to float32 noise), and the batches generated ahead
were sampled with the weights one update older, so from then on the same comparison shows the
update's size, and staleness is at most 1. Its pushes land between decode steps
(`rollout.partial_rollouts=true`, the vLLM path of test_vllm_partial.py inside a run): a sample a
push landed in still counts as one update behind (its oldest token). SGLang runs synchronously:
every step's push equal.
"""

from __future__ import annotations

import pytest

from tests.support.trainer_runs import CONFIG, FAST, assert_ok, read_metrics, run_cli, workspace_overrides

SEPARATE = ["parallel.tp=2", "rollout.placement=separate", "rollout.num_gpus=1"]
SAME_WEIGHTS = 1e-4  # float32 engine and actor; an update of the tiny model moves log-probs by ~1e-2


def _run(workspace, output, engine: str, steps: int, *extra: str) -> dict[int, dict]:
    args = ["train", "--config", str(CONFIG), *FAST, *SEPARATE, f"rollout.engine={engine}", f"trainer.total_steps={steps}", *extra]
    assert_ok(run_cli(*args, *workspace_overrides(workspace, output), nproc=3, timeout=900))
    return read_metrics(output)


def test_vllm_on_its_own_rank_gets_the_pushes_and_runs_one_step_off(require_vllm, demo_workspace, tmp_path):
    metrics = _run(
        demo_workspace, tmp_path / "vllm-async", "vllm", 3, "trainer.max_staleness=1", "algorithm.tis_cap=2", "rollout.partial_rollouts=true"
    )
    # step 1: generated after the first push with the starting weights, and trained from them
    assert metrics[1]["rollout_mismatch/max_abs"] < SAME_WEIGHTS and metrics[1]["async/staleness_max"] == 0
    for step in (2, 3):
        m = metrics[step]
        assert m["async/staleness_max"] <= 1
        assert 0 <= m["async/token_staleness_mean"] <= m["async/staleness_mean"] and 0 <= m["async/partial_frac"] <= 1
        assert m["weight_sync/seconds"] > 0  # every step pushes
        if m["async/staleness_frac_1"] == 1.0:  # generated ahead: one update behind the actor
            assert m["rollout_mismatch/max_abs"] > SAME_WEIGHTS, m
        elif m["async/staleness_frac_0"] == 1.0:  # generated after this step's push: the actor's weights
            assert m["rollout_mismatch/max_abs"] < SAME_WEIGHTS, m
    assert any(metrics[s]["async/staleness_frac_1"] == 1.0 for s in (2, 3))


def test_sglang_on_its_own_rank_gets_every_push(require_sglang, demo_workspace, tmp_path):
    metrics = _run(demo_workspace, tmp_path / "sglang", "sglang", 2)
    for step in (1, 2):
        assert metrics[step]["rollout_mismatch/max_abs"] < SAME_WEIGHTS, metrics[step]
