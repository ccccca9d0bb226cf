"""`rollout.placement=separate` with `trainer.max_staleness=0` is the synchronous loop (issue 27).

The same run, colocated (2 processes, the leaders' embedded engines) and separate (the same
trainer plus as many rollout ranks as the colocated run has engines, each holding an embedded
engine): every engine gets the same share of the prompts with the same seed and the same weights
(pushed over the bridge as full tensors), so every deterministic metric of every step, validation
included, and the final weights must be equal. The separate run adds only its `async/*` metrics
(staleness 0 throughout). Two trainer layouts: TP=2 (one engine; 3 processes) and DP=2 (two
engines, one per replica colocated; 4 processes: the first replica exports, the head broadcasts to
both engines, every trainer rank gets every sample).
"""

from __future__ import annotations

import pytest

from tests.support.trainer_runs import (
    CONFIG, FAST, assert_ok, checkpoint_state, deterministic, read_metrics, run_cli, state_differences, workspace_overrides,
)  # fmt: skip

STEPS = 3
VALIDATION = ["trainer.val_before_train=true", "trainer.eval_every=2"]


# trainer layout -> (its overrides, the colocated run's engines: one per data-parallel replica)
LAYOUTS = {"tp2": (["parallel.tp=2"], 1), "dp2": (["parallel.tp=1"], 2)}
TRAINER_RANKS = 2


def _run(workspace, output, nproc: int, *extra: str) -> tuple[dict[int, dict], dict]:
    """(metrics per step, the final checkpoint's model, optimizer and scheduler state)."""
    args = ["train", "--config", str(CONFIG), *FAST, *VALIDATION, f"trainer.total_steps={STEPS}"]
    assert_ok(run_cli(*args, *workspace_overrides(workspace, output), *extra, nproc=nproc, timeout=600))
    return read_metrics(output), checkpoint_state(output / "checkpoints" / f"step_{STEPS:08d}")


@pytest.fixture(scope="module", params=sorted(LAYOUTS))
def finished(request, demo_workspace, tmp_path_factory):
    layout, engines = LAYOUTS[request.param]
    colocated = _run(demo_workspace, tmp_path_factory.mktemp(f"colocated-{request.param}"), TRAINER_RANKS, *layout)
    separate = _run(
        demo_workspace, tmp_path_factory.mktemp(f"separate-{request.param}"), TRAINER_RANKS + engines, *layout,
        "rollout.placement=separate", f"rollout.num_gpus={engines}",
    )  # fmt: skip
    return colocated, separate


@pytest.fixture(scope="module")
def runs(finished):
    (colocated, _), (separate, _) = finished
    return colocated, separate


def test_separate_equals_colocated_in_every_deterministic_metric(runs):
    colocated, separate = runs
    assert sorted(colocated) == sorted(separate) == list(range(0, STEPS + 1))  # step 0: validation before training
    for step in colocated:
        a, b = deterministic(colocated[step]), deterministic(separate[step])
        extra = sorted(k for k in set(b) - set(a))
        assert all(k.startswith("async/") for k in extra), extra
        problems = [f"{k}: {a[k]!r} vs {b.get(k)!r}" for k in sorted(a) if a[k] != b.get(k)]
        assert not problems, f"step {step}:\n" + "\n".join(problems[:20])
    assert any(k.startswith("val/") for k in separate[0]) and any(k.startswith("val/") for k in separate[2])


def test_the_separate_run_is_never_stale_and_its_engine_got_the_weights(runs):
    _, separate = runs
    for step in range(1, STEPS + 1):
        m = separate[step]
        assert m["async/staleness_max"] == 0 and m["async/staleness_frac_0"] == 1.0
        assert m["weight_sync/seconds"] > 0
        assert m["rollout_mismatch/max_abs"] < 1e-4  # the engine samples with the actor's weights of the step


def test_separate_ends_with_the_colocated_runs_weights_and_optimizer_state(finished):
    (_, colocated), (_, separate) = finished
    problems = state_differences(colocated, separate)
    assert not problems, "final weights / optimizer state differ:\n" + "\n".join(problems[:20])
