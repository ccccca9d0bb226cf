"""Asynchronous training in the separate placement (issue 27): `trainer.max_staleness=1`.

Three processes: a TP=2 trainer and one rollout rank with the embedded engine (`rollout.placement=
separate rollout.num_gpus=1`). With one step off, the engines generate the next step's batch with the
weights the current step starts from while it trains:

* every sample of the train batch is at most one version stale (`async/staleness_max`), and the
  batches generated ahead are exactly one (`async/staleness_frac_1`);
* the bound holds when the trainer is slow (its update sleeps 2 s a step): the engines wait for
  work instead of running ahead (`async/engine_wait_s`), nothing is ever older than one version;
* SIGTERM after step 2 leaves a checkpoint with the samples generated ahead (`async_state.pt`), and
  the resumed run's steps equal the uninterrupted run's in every deterministic metric;
* with partial rollouts and an engine slower than the update, pushes land in generations in flight:
  samples hold tokens of two versions, the token-level staleness is below the samples';
* a checkpoint without that file cannot resume the asynchronous run (a named error), and a
  resumed run from it would need it: the pure check in `async_state.load`;
* MoE routing replay (the demo's tiny Qwen3-MoE, `actor.router_replay=r3`, DP=2 trainer, two steps
  off so surplus groups stay within the bound): the engine's routing of groups carried over and of
  batches in flight is replayed after a SIGTERM and resume as in the uninterrupted run, and the
  checkpoint holds the carried groups' routing.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.support.trainer_runs import (
    CONFIG, FAST, REPO, assert_ok, cli, deterministic, read_metrics, run_cli, workspace_overrides,
)  # fmt: skip

STEPS = 5
ASYNC = ["parallel.tp=2", "rollout.placement=separate", "rollout.num_gpus=1", "trainer.max_staleness=1", "algorithm.tis_cap=2"]
SLOW_LAUNCH = Path(__file__).with_name("_slow_update_launch.py")
UPDATE_SLEEP_S = 2.0
DECODE_SLEEP_S = 0.3


def _args(workspace, output: Path, *extra: str) -> list[str]:
    return ["train", "--config", str(CONFIG), *FAST, *ASYNC, *workspace_overrides(workspace, output), *extra]


@pytest.fixture(scope="module")
def straight(demo_workspace, tmp_path_factory) -> dict[int, dict]:
    output = tmp_path_factory.mktemp("async-straight")
    assert_ok(run_cli(*_args(demo_workspace, output, f"trainer.total_steps={STEPS}"), nproc=3, timeout=600))
    return read_metrics(output)


def test_one_step_off_trains_on_samples_at_most_one_version_old(straight):
    assert sorted(straight) == list(range(1, STEPS + 1))
    assert straight[1]["async/staleness_max"] == 0  # nothing was generated ahead of step 1
    for step, metrics in straight.items():
        assert metrics["async/staleness_max"] <= 1, (step, metrics)
        assert metrics["async/staleness_frac_0"] + metrics["async/staleness_frac_1"] == pytest.approx(1.0)
        assert "actor/tis_weight_mean" in metrics or "tis/weight_mean" in metrics or any(k.startswith("actor/tis") for k in metrics)
    ahead = [s for s, m in straight.items() if m["async/staleness_frac_1"] > 0]
    assert ahead, "no step trained on a batch generated ahead of its update"
    assert any(m["async/batches_submitted_ahead"] > 0 for m in straight.values())


def test_sigterm_saves_the_samples_generated_ahead_and_the_resumed_run_equals_the_straight_one(straight, demo_workspace, tmp_path):
    output = tmp_path / "stopped"
    resumed, _ = _stop_and_resume(lambda *extra: _args(demo_workspace, output, *extra), output, stop_after=2, total=STEPS)
    _assert_equal_runs(resumed, straight, STEPS)


def _stop_and_resume(args, output: Path, stop_after: int, total: int) -> tuple[dict[int, dict], Path]:
    """Run `args` until SIGTERM after step `stop_after`, resume it to step `total`. Returns the
    resumed run's metrics and the checkpoint the SIGTERM left (with its `async_state.pt`)."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(cli(*args(f"trainer.total_steps={total}"), nproc=3), cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    stopped = _sigterm_ranks_after_step(proc, output, step=stop_after, timeout=600)
    assert stopped.returncode != 0 and "exitcode  : 143" in stopped.stdout, stopped.stdout[-4000:]
    assert "SIGTERM: checkpoint of step" in stopped.stdout, stopped.stdout[-4000:]
    saved = sorted((output / "checkpoints").glob("step_*"))
    assert saved and (saved[-1] / "async_state.pt").is_file()
    assert stop_after <= max(read_metrics(output)) < total
    assert_ok(run_cli(*args(f"trainer.total_steps={total}", "--resume"), nproc=3, timeout=600))
    return read_metrics(output), saved[-1]


def _assert_equal_runs(resumed: dict[int, dict], straight: dict[int, dict], steps: int) -> None:
    for step in range(1, steps + 1):
        a, b = deterministic(resumed[step]), deterministic(straight[step])
        problems = [f"{k}: {a.get(k)!r} vs {b.get(k)!r}" for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)]
        assert not problems, f"step {step} differs after the resume:\n" + "\n".join(problems[:20])


MOE_STEPS = 5
MOE_ASYNC = ["rollout.placement=separate", "rollout.num_gpus=1", "trainer.max_staleness=2", "algorithm.tis_cap=2", "actor.router_replay=r3"]


def test_moe_routing_replay_of_carried_and_in_flight_groups_survives_a_resume(moe_workspace, tmp_path):
    import torch

    def args(output):
        return lambda *extra: ["train", "--config", str(CONFIG), *FAST, *MOE_ASYNC, *workspace_overrides(moe_workspace, output), *extra]

    straight_out = tmp_path / "straight"
    assert_ok(run_cli(*args(straight_out)(f"trainer.total_steps={MOE_STEPS}"), nproc=3, timeout=600))
    straight = read_metrics(straight_out)
    assert sorted(straight) == list(range(1, MOE_STEPS + 1))
    for step, m in straight.items():
        assert m["async/staleness_max"] <= 2, (step, m)
        assert "rollout_mismatch/routing_token_frac" not in m, m  # the engine's routing is replayed: nothing to compare
    assert straight[2]["train/num_groups_carried"] > 0 and straight[2]["train/num_gen_batches"] == 0  # step 1's surplus
    assert max(m["async/staleness_max"] for m in straight.values()) == 2

    # Step 3 carries groups over (the step-3 checkpoint holds them): the resume replays their routing.
    stopped_out = tmp_path / "stopped"
    resumed, checkpoint = _stop_and_resume(args(stopped_out), stopped_out, stop_after=3, total=MOE_STEPS)
    _assert_equal_runs(resumed, straight, MOE_STEPS)
    state = torch.load(checkpoint / "async_state.pt", weights_only=True)
    assert state["engine_routing"] and state["carried"], f"{checkpoint.name} carries no groups"
    refs = state["carried"]["fields"]["routing_ref"]
    assert len(refs) == state["carried"]["groups"] * 4  # rollout.n samples a group, each its routing in the file
    assert sorted(key for _, key in refs) == sorted(state["carried_routing"]) and {owner for owner, _ in refs} == {0}
    assert all(result["routing"] is not None for batch in state["inflight"] for result in batch["results"])


def _sigterm_ranks_after_step(proc: subprocess.Popen, output: Path, step: int, timeout: float) -> subprocess.CompletedProcess:
    """SIGTERM to every rank of the launch (as SLURM's preemption notice reaches every task), once the
    run's metrics hold `step`; then wait for it."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        if (output / "metrics.jsonl").exists() and step in read_metrics(output):
            subprocess.run(["pkill", "-TERM", "-P", str(proc.pid)], check=False)
            break
        time.sleep(0.2)
    out, _ = proc.communicate(timeout=timeout)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, "")


def test_the_bound_holds_under_a_slow_trainer(demo_workspace, tmp_path):
    metrics = _run_slowed(demo_workspace, tmp_path / "slow", {"MDAPO_TEST_UPDATE_SLEEP_S": str(UPDATE_SLEEP_S)}, "trainer.total_steps=4")
    for step, m in metrics.items():
        assert m["async/staleness_max"] <= 1, (step, m)
        assert m["async/batches_in_flight"] <= 1, (step, m)  # one train batch of 4 groups: one generation batch ahead
    # After the first step the engines finish what they were handed long before the slow update ends,
    # and then wait: most of the step, not generating further ahead.
    assert all(m["async/engine_wait_s"] > UPDATE_SLEEP_S / 2 for s, m in metrics.items() if s >= 3), metrics


def _run_slowed(demo_workspace, output: Path, environment: dict, *extra: str) -> dict[int, dict]:
    from megatron_dapo.distributed.launch import find_free_port

    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "3", "--master_addr", "127.0.0.1",
               "--master_port", str(find_free_port()), str(SLOW_LAUNCH), *_args(demo_workspace, output, *extra)]  # fmt: skip
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", **environment}
    assert_ok(subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=600))
    return read_metrics(output)


def test_partial_rollouts_push_into_a_generation_in_flight(demo_workspace, tmp_path):
    """`rollout.partial_rollouts=true` with an engine slower than the update (each decode step sleeps):
    the push of step t lands while the engine generates step t + 1's batch, whose rows carry on with
    the new weights. Samples then hold tokens of two versions (`async/partial_frac`), the token-level
    staleness is below the samples' (their oldest token's), and the bound still holds."""
    metrics = _run_slowed(
        demo_workspace, tmp_path / "partial", {"MDAPO_TEST_DECODE_SLEEP_S": str(DECODE_SLEEP_S)},
        "trainer.total_steps=4", "rollout.partial_rollouts=true",
    )  # fmt: skip
    assert sorted(metrics) == [1, 2, 3, 4]
    crossed = [s for s, m in metrics.items() if m.get("async/partial_frac", 0) > 0]
    assert crossed, {s: {k: v for k, v in m.items() if k.startswith("async/")} for s, m in metrics.items()}
    for step, m in metrics.items():
        assert m["async/staleness_max"] <= 1, (step, m)
        assert 0 <= m["async/token_staleness_mean"] <= m["async/staleness_mean"], (step, m)
    assert any(metrics[s]["async/token_staleness_mean"] < metrics[s]["async/staleness_mean"] for s in crossed)


def test_a_checkpoint_without_the_async_state_is_a_named_error(tmp_path):
    from megatron_dapo.trainer import async_state

    with pytest.raises(FileNotFoundError, match="has no async_state.pt: it was not written by a run with trainer.max_staleness > 0"):
        async_state.load(tmp_path)
