"""`megatron-dapo train` end to end on the tiny demo model (real Megatron actor, embedded engine, reward pool).

* resume: a run stopped by SIGTERM after step 3 writes a checkpoint and exits 143; `--resume`
  continues it, and steps 4-5 equal those of an uninterrupted run (every logged value that is not a
  wall-clock time);
* TP=2, PP=2 and CP=2 over two gloo processes: step 1 equals the single-process run (same responses,
  same rewards; losses within float32 reduction-order noise);
* clear errors (exit code 2, the key to change) for bad input.
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from tests.trainer.conftest import CONFIG, FAST, cli, deterministic, read_metrics, run_cli, workspace_overrides

TOTAL = ["trainer.total_steps=5"]


def _assert_ok(proc: subprocess.CompletedProcess) -> None:
    assert proc.returncode == 0, f"exit {proc.returncode}\n--- stdout\n{proc.stdout[-4000:]}\n--- stderr\n{proc.stderr[-6000:]}"


def _same(a: dict, b: dict, rel: float = 0.0) -> list[str]:
    problems = []
    for key in sorted(set(a) | set(b)):
        x, y = a.get(key), b.get(key)
        if x is None or y is None:
            problems.append(f"{key}: {x} vs {y}")
        elif isinstance(x, float) and isinstance(y, float) and math.isnan(x) and math.isnan(y):
            continue
        elif rel == 0.0 and x != y:
            problems.append(f"{key}: {x!r} vs {y!r}")
        elif rel and not math.isclose(x, y, rel_tol=rel, abs_tol=rel):
            problems.append(f"{key}: {x!r} vs {y!r}")
    return problems


def test_sigterm_checkpoint_then_resume_equals_uninterrupted(demo_workspace, tmp_path):
    straight = tmp_path / "straight"
    _assert_ok(run_cli("train", "--config", str(CONFIG), *FAST, *TOTAL, *workspace_overrides(demo_workspace, straight)))
    reference = read_metrics(straight)
    assert sorted(reference) == [1, 2, 3, 4, 5]
    assert (straight / "plot.png").stat().st_size > 10_000
    # Dynamic sampling ran for real and the update moved the policy.
    assert all(reference[s]["train/num_gen_batches"] >= 1 for s in reference)
    assert all(reference[s]["actor/grad_norm"] > 0 for s in reference)

    # The same run, stopped by SIGTERM (SLURM preemption) once step 3 is logged; no periodic checkpoints.
    stopped = tmp_path / "stopped"
    args = ["train", "--config", str(CONFIG), *FAST, *TOTAL, *workspace_overrides(demo_workspace, stopped)]
    proc = subprocess.Popen(cli(*args), cwd=Path(CONFIG).parents[1], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})  # fmt: skip
    metrics_file = stopped / "metrics.jsonl"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and proc.poll() is None:
        if metrics_file.exists() and any(json.loads(l)["step"] == 3 for l in metrics_file.read_text().splitlines() if l.strip()):
            proc.send_signal(signal.SIGTERM)
            break
        time.sleep(0.2)
    output, _ = proc.communicate(timeout=300)
    assert proc.returncode == 143, output[-4000:]
    latest = (stopped / "checkpoints" / "latest").read_text().strip()
    stopped_at = int(latest.split("_")[-1])
    assert stopped_at in (3, 4), latest  # the signal lands during step 3's logging or step 4
    assert "continue with --resume" in output

    _assert_ok(run_cli(*args, "--resume"))
    resumed = read_metrics(stopped)
    assert sorted(resumed) == [1, 2, 3, 4, 5]  # each step logged once
    for step in (4, 5):
        problems = _same(deterministic(resumed[step]), deterministic(reference[step]))
        assert not problems, f"step {step} differs after resume:\n" + "\n".join(problems[:20])


@pytest.fixture(scope="module")
def one_process_step(demo_workspace, tmp_path_factory) -> dict:
    """Step 1 of the tiny run in one process: the reference of the two-process layouts."""
    one = tmp_path_factory.mktemp("one_process")
    _assert_ok(run_cli("train", "--config", str(CONFIG), *FAST, "trainer.total_steps=1", *workspace_overrides(demo_workspace, one)))
    return read_metrics(one)[1]


@pytest.mark.parametrize("layout", ["parallel.tp=2", "parallel.pp=2", "parallel.cp=2"])
def test_two_process_layouts_match_one_process(demo_workspace, one_process_step, tmp_path, layout):
    two = tmp_path / "two"
    steps = ["trainer.total_steps=1"]
    _assert_ok(run_cli("train", "--config", str(CONFIG), *FAST, *steps, layout, *workspace_overrides(demo_workspace, two), nproc=2))
    a, b = deterministic(one_process_step), deterministic(read_metrics(two)[1])
    exact = {k for k in a if k.startswith(("critic/", "response_length/", "prompt_length/", "train/"))}
    assert not _same({k: a[k] for k in exact}, {k: b[k] for k in exact}), "the rollout differs"
    if layout == "parallel.cp=2":  # rows are padded to a multiple of 2*CP, and the budget is per rank
        assert b.pop("actor/pad_fraction") >= a.pop("actor/pad_fraction")
    assert not _same(a, b, rel=1e-4), _same(a, b, rel=1e-4)


def test_validation_metrics_and_resolved_config(demo_workspace, tmp_path):
    out = tmp_path / "val"
    _assert_ok(run_cli("train", "--config", str(CONFIG), *FAST, "trainer.total_steps=1", "trainer.val_before_train=true",
                       "trainer.eval_every=1", "rollout.val_n=4", *workspace_overrides(demo_workspace, out)))  # fmt: skip
    metrics = read_metrics(out)
    for step in (0, 1):
        val = metrics[step]
        assert val["val/num_prompts"] == 8
        assert 0 <= val["val/acc/mean@4"] <= val["val/pass@2"] <= val["val/pass@4"] <= 1
        assert val["val/pass@1"] == pytest.approx(val["val/acc/mean@4"])  # unbiased pass@1 is the mean accuracy
    assert "model:" in (out / "config.yaml").read_text()
    # trainer.save_every=0 (FAST): no periodic checkpoints, but the last step is saved.
    assert (out / "checkpoints" / "latest").read_text().strip() == "step_00000001"


@pytest.mark.parametrize(
    "overrides, expected",
    [
        (["model.hf_dir=/nonexistent/model"], "model.hf_dir"),
        (["rollout.n=0"], "rollout.n"),
        (["rollout.max_prompt_length=8"], "rollout.max_prompt_length"),  # every prompt is longer: empty dataset
        (["trainer.gen_batch_size=3"], "trainer.gen_batch_size"),
        (["parallel.tp=3"], "parallel.tp"),
    ],
)
def test_bad_input_fails_with_the_key(demo_workspace, tmp_path, overrides, expected):
    proc = run_cli("train", "--config", str(CONFIG), *FAST, *workspace_overrides(demo_workspace, tmp_path / "x"), *overrides)
    assert proc.returncode != 0
    assert expected in proc.stderr, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr


def test_dataset_without_ground_truth_is_refused(demo_workspace, tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"prompt": [{"role": "user", "content": "What is 1 + 1?"}], "data_source": "x"}) + "\n")
    proc = run_cli("train", "--config", str(CONFIG), *FAST, *workspace_overrides(demo_workspace, tmp_path / "x"), f"data.train_files=[{bad}]")
    assert proc.returncode == 2
    assert "ground_truth" in proc.stderr and "bad.jsonl" in proc.stderr


@pytest.mark.parametrize("nproc", [1, 2], ids=["one_process", "dp2_two_spmd_engines"])
def test_vllm_engine_trains_with_weight_sync_every_step(demo_workspace, tmp_path, require_vllm, nproc):
    """The demo with `rollout.engine=vllm` (vLLM's CPU build, spmd placement): two steps, weights pushed
    after each. With two processes (DP=2, rollout.tp=1) there are two SPMD engines, each generating
    half of the prompts; the pooled batch holds every prompt group."""
    out = tmp_path / "vllm"
    _assert_ok(run_cli("train", "--config", str(CONFIG), *FAST, "trainer.total_steps=2", "rollout.engine=vllm",
                       *workspace_overrides(demo_workspace, out), nproc=nproc))  # fmt: skip
    metrics = read_metrics(out)
    assert sorted(metrics) == [1, 2]
    for step in (1, 2):
        assert metrics[step]["train/num_groups_generated"] == 8 * metrics[step]["train/num_gen_batches"]
        # The engine's sampled-token log-probs against the actor's, float32 on both sides: a stale or
        # wrong weight push after step 1 would show up as a large mismatch at step 2.
        assert metrics[step]["rollout_mismatch/mean_abs"] < 1e-3, metrics[step]
        assert metrics[step]["weight_sync/seconds"] > 0


def test_spmd_vllm_tp2_steps_equal_the_leader_placement(demo_workspace, tmp_path, require_vllm):
    """TP=2 actor over two processes with a TP=2 vLLM engine: `rollout.placement=spmd` (each process
    holds one engine shard, weights handed over in-process per rank: tp_shards) against the leader
    placement (rank 0's engine spawns two vLLM workers; shared-memory hand-over). Same seeds, same
    weights: the two steps must log the same values (wall-clock ones aside)."""
    runs = {}
    for placement in ("spmd", "leader"):
        out = tmp_path / placement
        proc = run_cli("train", "--config", str(CONFIG), *FAST, "trainer.total_steps=2", "rollout.engine=vllm", "parallel.tp=2",
                       "rollout.tp=2", f"rollout.placement={placement}", "rollout.seed_per_prompt=true",  # batching-independent
                       *workspace_overrides(demo_workspace, out), nproc=2, timeout=600)  # fmt: skip
        _assert_ok(proc)
        assert f"weight sync: {'tp_shards' if placement == 'spmd' else 'shared_memory'}" in proc.stdout, proc.stdout[-2000:]
        runs[placement] = read_metrics(out)
    assert sorted(runs["spmd"]) == sorted(runs["leader"]) == [1, 2]
    for step in (1, 2):
        spmd, leader = deterministic(runs["spmd"][step]), deterministic(runs["leader"][step])
        problems = _same(spmd, leader)
        assert not problems, f"step {step}: spmd differs from leader:\n" + "\n".join(problems[:20])
        assert spmd["rollout_mismatch/mean_abs"] < 1e-3


def test_dynamic_sampling_that_runs_dry_says_what_to_change(demo_workspace, tmp_path):
    """The untrained model answers nothing right: every group is all-wrong and the step cannot fill."""
    proc = run_cli("train", "--config", str(CONFIG), *FAST[:-1], "algorithm.filter_groups.max_num_gen_batches=2",
                   *workspace_overrides(demo_workspace, tmp_path / "dry"))  # fmt: skip
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "max_num_gen_batches" in proc.stderr and "Traceback" not in proc.stderr


def test_two_data_parallel_replicas_each_generate_their_share(demo_workspace, tmp_path):
    """DP=2: two engines (one per replica), gathered generation batches, one decision, one update."""
    out = tmp_path / "dp2"
    proc = run_cli("train", "--config", str(CONFIG), *FAST, "trainer.total_steps=2", *workspace_overrides(demo_workspace, out), nproc=2)
    _assert_ok(proc)
    assert "dp 2" in proc.stdout, proc.stdout[-2000:]
    metrics = read_metrics(out)
    assert sorted(metrics) == [1, 2]
    for step in (1, 2):
        m = metrics[step]
        # Both replicas' generations were pooled: gen_batch_size prompts per generation batch.
        assert m["train/num_groups_generated"] == 8 * m["train/num_gen_batches"]
        assert m["actor/grad_norm"] > 0 and m["rollout_mismatch/mean_abs"] < 1e-3


def test_overlong_filter_and_score_metrics(demo_workspace, tmp_path):
    """`algorithm.overlong_filter=true`: truncated responses (all exactly max_response_length tokens
    long) leave the loss, so the update counts the train batch's tokens minus theirs. The task score
    and the reward (score + overlong penalty) are logged apart; groups are filtered on the score."""
    out = tmp_path / "filter"
    max_len, samples = 16, 4 * 4  # FAST: rollout.max_response_length=16, train_batch_size=4 x n=4
    _assert_ok(run_cli("train", str(CONFIG), *FAST, "trainer.total_steps=1", "algorithm.overlong_filter=true",  # positional config
                       "algorithm.filter_groups.metric=score", *workspace_overrides(demo_workspace, out)))  # fmt: skip
    m = read_metrics(out)[1]
    clipped = round(m["response_length/clip_ratio"] * samples)
    assert clipped > 0, "the test needs truncated responses"
    expected_tokens = m["response_length/mean"] * samples - clipped * max_len
    assert m["actor/tokens"] == pytest.approx(expected_tokens, abs=1e-6)
    # Truncated responses are in the overlong buffer: the reward is below the task score.
    assert m["critic/rewards/mean"] < m["critic/score/mean"]
