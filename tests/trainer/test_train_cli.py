"""`megatron-dapo train` end to end on the tiny demo model (real Megatron actor, embedded engine, reward pool).

Every run of the module with the embedded engine starts from one pool, two at a time (`module_runs`,
longest first): a run spends much of its time in start-up (imports) and in phases where one process
works while the other waits, so a second run fills the idle core. The vLLM runs share a second pool
(`vllm_runs`). One uninterrupted five-step run is the reference of the resume and (its step 1) of the
two-process layouts; one one-step run serves the validation and the overlong-filter checks.

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
import subprocess
from pathlib import Path

import pytest

from tests.support.torchrun_utils import two_at_a_time
from tests.support.trainer_runs import CONFIG, FAST, REPO, cli, deterministic, read_metrics, run_cli, stop_after_step, workspace_overrides

TOTAL = ["trainer.total_steps=5"]
BAD_INPUT = {  # case: (overrides, the key the error must name)
    "hf_dir": (["model.hf_dir=/nonexistent/model"], "model.hf_dir"),
    "n": (["rollout.n=0"], "rollout.n"),
    "prompt_length": (["rollout.max_prompt_length=8"], "rollout.max_prompt_length"),  # every prompt is longer: empty dataset
    "gen_batch_size": (["trainer.gen_batch_size=3"], "trainer.gen_batch_size"),
    "tp": (["parallel.tp=3"], "parallel.tp"),
}


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


def _one_process(*args: str) -> list[str]:
    return cli("train", "--config", str(CONFIG), *FAST, *args)


def _env() -> dict[str, str]:
    # One OpenMP thread per process: two runs share the two cores (spinning OpenMP threads of one
    # would wait on the other), and the runs whose values are compared use the same thread count.
    return {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}


def _run(command: list[str]) -> subprocess.CompletedProcess:
    """`command` (a one-process `cli(...)`) through `run_cli`: ranks forked from the zygote where it runs."""
    assert command[1:3] == ["-m", "megatron_dapo.cli"], command
    return run_cli(*command[3:], timeout=600, threads=1)


def _run_stopped_after_step_3(command: list[str], output_dir: Path) -> subprocess.CompletedProcess:
    """The run, sent SIGTERM (SLURM preemption) once its metrics hold step 3; stdout and stderr together."""
    proc = subprocess.Popen(command, cwd=REPO, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    return stop_after_step(proc, output_dir, 3, timeout=600)


LAYOUTS = {"tp2": "parallel.tp=2", "pp2": "parallel.pp=2", "cp2": "parallel.cp=2"}  # run name: override


def _two_process(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return run_cli("train", "--config", str(CONFIG), *FAST, *args, nproc=2, timeout=timeout)


def _two_at_a_time(runs: dict, root: Path) -> dict[str, tuple[Path, object]]:
    """The runs two at a time, in order: name -> (root / name, what it returned)."""
    return {name: (root / name, result) for name, result in two_at_a_time(runs).items()}


def _stop_then_resume(command: list[str], output_dir: Path) -> tuple:
    """The run stopped after step 3, the checkpoint it left (`latest`, read before the resume moves
    it), then the same command with `--resume`: (stopped, latest, resumed)."""
    stopped = _run_stopped_after_step_3(command, output_dir)
    latest = output_dir / "checkpoints" / "latest"
    left = latest.read_text().strip() if latest.exists() else None
    return stopped, left, _run([*command, "--resume"])


@pytest.fixture(scope="module")
def module_runs(demo_workspace, tmp_path_factory) -> dict[str, tuple[Path, object]]:
    """Every run of the module with the embedded engine, two at a time, longest first:
    name -> (output dir, process; for "stopped": (process, its latest checkpoint, the resumed process))."""
    root = tmp_path_factory.mktemp("runs")
    bad_data = root / "bad.jsonl"
    bad_data.write_text(json.dumps({"prompt": [{"role": "user", "content": "What is 1 + 1?"}], "data_source": "x"}) + "\n")

    def out(name: str) -> list[str]:
        return workspace_overrides(demo_workspace, root / name)

    runs = {
        # The same run stopped and resumed, and uninterrupted; no periodic checkpoints (FAST: trainer.save_every=0).
        "stopped": lambda: _stop_then_resume(_one_process(*TOTAL, *out("stopped")), root / "stopped"),
        "straight": lambda: _run(_one_process(*TOTAL, *out("straight"))),
        # Two processes, one step each (the layouts) or two (DP=2).
        **{name: (lambda name=name, layout=layout: _two_process("trainer.total_steps=1", layout, *out(name))) for name, layout in LAYOUTS.items()},
        "dp2": lambda: _two_process("trainer.total_steps=2", *out("dp2")),
        # The config given positionally (`train CONFIG`).
        "validated_filtered": lambda: _run(cli("train", str(CONFIG), *FAST, "trainer.total_steps=1", "trainer.val_before_train=true",
                                               "trainer.eval_every=1", "rollout.val_n=4", "algorithm.overlong_filter=true",
                                               "algorithm.filter_groups.metric=score", *out("validated_filtered"))),  # fmt: skip
        # FAST but the default reward, which the untrained model never earns.
        "dry": lambda: _run(cli("train", "--config", str(CONFIG), *FAST[:-1], "algorithm.filter_groups.max_num_gen_batches=2", *out("dry"))),
        "no_ground_truth": lambda: _run(_one_process(*out("no_ground_truth"), f"data.train_files=[{bad_data}]")),
        **{case: (lambda overrides=overrides, case=case: _run(_one_process(*out(case), *overrides))) for case, (overrides, _) in BAD_INPUT.items()},
    }
    return _two_at_a_time(runs, root)


@pytest.fixture(scope="module")
def straight_run(module_runs) -> Path:
    """Five uninterrupted steps in one process (its output directory). Step 1 does not depend on
    trainer.total_steps (constant learning rate after the warm-up, same prompt sampler), so it is
    also the one-process reference of the two-process layouts, which run one step."""
    out, proc = module_runs["straight"]
    _assert_ok(proc)
    return out


def test_an_uninterrupted_run_logs_every_step_and_plots(straight_run):
    reference = read_metrics(straight_run)
    assert sorted(reference) == [1, 2, 3, 4, 5]
    assert (straight_run / "plot.png").stat().st_size > 10_000
    # Dynamic sampling ran for real and the update moved the policy.
    assert all(reference[s]["train/num_gen_batches"] >= 1 for s in reference)
    assert all(reference[s]["actor/grad_norm"] > 0 for s in reference)


def test_sigterm_checkpoint_then_resume_equals_uninterrupted(module_runs, straight_run):
    reference = read_metrics(straight_run)
    stopped, (proc, latest, resume) = module_runs["stopped"]
    assert proc.returncode == 143, proc.stdout[-4000:]
    assert latest is not None, "the stopped run left no checkpoints/latest"
    stopped_at = int(latest.split("_")[-1])
    assert stopped_at in (3, 4), latest  # the signal lands during step 3's logging or step 4
    assert "continue with --resume" in proc.stdout

    _assert_ok(resume)
    resumed = read_metrics(stopped)
    assert sorted(resumed) == [1, 2, 3, 4, 5]  # each step logged once
    for step in (4, 5):
        problems = _same(deterministic(resumed[step]), deterministic(reference[step]))
        assert not problems, f"step {step} differs after resume:\n" + "\n".join(problems[:20])


@pytest.mark.parametrize("name", list(LAYOUTS), ids=list(LAYOUTS.values()))
def test_two_process_layouts_match_one_process(module_runs, straight_run, name):
    two, proc = module_runs[name]
    _assert_ok(proc)
    a, b = deterministic(read_metrics(straight_run)[1]), deterministic(read_metrics(two)[1])
    exact = {k for k in a if k.startswith(("critic/", "response_length/", "prompt_length/", "train/"))}
    assert not _same({k: a[k] for k in exact}, {k: b[k] for k in exact}), "the rollout differs"
    if name == "cp2":  # rows are padded to a multiple of 2*CP, and the budget is per rank
        assert b.pop("actor/pad_fraction") >= a.pop("actor/pad_fraction")
    assert not _same(a, b, rel=1e-4), _same(a, b, rel=1e-4)


@pytest.fixture(scope="module")
def validated_filtered_run(module_runs) -> Path:
    """One step with validation before and after it, and `algorithm.overlong_filter=true` with groups
    filtered on the score: the filter changes what the update counts, not what validation measures."""
    out, proc = module_runs["validated_filtered"]
    _assert_ok(proc)
    return out


def test_validation_metrics_and_resolved_config(validated_filtered_run):
    out = validated_filtered_run
    metrics = read_metrics(out)
    for step in (0, 1):
        val = metrics[step]
        assert val["val/num_prompts"] == 8
        assert 0 <= val["val/acc/mean@4"] <= val["val/pass@2"] <= val["val/pass@4"] <= 1
        assert val["val/pass@1"] == pytest.approx(val["val/acc/mean@4"])  # unbiased pass@1 is the mean accuracy
    assert "model:" in (out / "config.yaml").read_text()
    # trainer.save_every=0 (FAST): no periodic checkpoints, but the last step is saved.
    assert (out / "checkpoints" / "latest").read_text().strip() == "step_00000001"


def test_overlong_filter_and_score_metrics(validated_filtered_run):
    """`algorithm.overlong_filter=true`: truncated responses (all exactly max_response_length tokens
    long) leave the loss, so the update counts the train batch's tokens minus theirs. The task score
    and the reward (score + overlong penalty) are logged apart; groups are filtered on the score."""
    max_len, samples = 16, 4 * 4  # FAST: rollout.max_response_length=16, train_batch_size=4 x n=4
    m = read_metrics(validated_filtered_run)[1]
    clipped = round(m["response_length/clip_ratio"] * samples)
    assert clipped > 0, "the test needs truncated responses"
    expected_tokens = m["response_length/mean"] * samples - clipped * max_len
    assert m["actor/tokens"] == pytest.approx(expected_tokens, abs=1e-6)
    # Truncated responses are in the overlong buffer: the reward is below the task score.
    assert m["critic/rewards/mean"] < m["critic/score/mean"]


@pytest.mark.parametrize("case", list(BAD_INPUT))
def test_bad_input_fails_with_the_key(module_runs, case):
    _, proc = module_runs[case]
    assert proc.returncode != 0
    assert BAD_INPUT[case][1] in proc.stderr, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr


def test_dataset_without_ground_truth_is_refused(module_runs):
    _, proc = module_runs["no_ground_truth"]
    assert proc.returncode == 2
    assert "ground_truth" in proc.stderr and "bad.jsonl" in proc.stderr


def test_dynamic_sampling_that_runs_dry_says_what_to_change(module_runs):
    """The untrained model answers nothing right: every group is all-wrong and the step cannot fill."""
    _, proc = module_runs["dry"]
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "max_num_gen_batches" in proc.stderr and "Traceback" not in proc.stderr


@pytest.fixture(scope="module")
def vllm_runs(demo_workspace, tmp_path_factory, require_vllm) -> dict[str, tuple[Path, subprocess.CompletedProcess]]:
    """The module's vLLM runs (two processes each), two at a time: name -> (output dir, process)."""
    root = tmp_path_factory.mktemp("vllm_runs")
    vllm = ["trainer.total_steps=2", "rollout.engine=vllm"]
    tp2 = ["parallel.tp=2", "rollout.tp=2", "rollout.seed_per_prompt=true"]  # seeds per prompt: batching-independent
    runs = {
        **{placement: (lambda placement=placement: _two_process(*vllm, *tp2, f"rollout.placement={placement}",
                                                                *workspace_overrides(demo_workspace, root / placement), timeout=900))
           for placement in ("spmd", "leader")},
        "dp2": lambda: _two_process(*vllm, *workspace_overrides(demo_workspace, root / "dp2"), timeout=900),
    }  # fmt: skip
    return _two_at_a_time(runs, root)


def test_two_spmd_vllm_engines_train_with_weight_sync_every_step(vllm_runs):
    """The demo with `rollout.engine=vllm` (vLLM's CPU build, spmd placement) over two processes
    (DP=2, rollout.tp=1): two SPMD engines, each generating half of the prompts; the pooled batch
    holds every prompt group; weights pushed after each of the two steps. (One process with one
    engine: test_vllm_resume.py, on its uninterrupted run.)"""
    out, proc = vllm_runs["dp2"]
    _assert_ok(proc)
    metrics = read_metrics(out)
    assert sorted(metrics) == [1, 2]
    for step in (1, 2):
        assert metrics[step]["train/num_groups_generated"] == 8 * metrics[step]["train/num_gen_batches"]
        # The engine's sampled-token log-probs against the actor's, float32 on both sides: a stale or
        # wrong weight push after step 1 would show up as a large mismatch at step 2.
        assert metrics[step]["rollout_mismatch/mean_abs"] < 1e-3, metrics[step]
        assert metrics[step]["weight_sync/seconds"] > 0


def test_spmd_vllm_tp2_steps_equal_the_leader_placement(vllm_runs):
    """TP=2 actor over two processes with a TP=2 vLLM engine: `rollout.placement=spmd` (each process
    holds one engine shard, weights handed over in-process per rank: tp_shards) against the leader
    placement (rank 0's engine spawns two vLLM workers; shared-memory hand-over). Same seeds, same
    weights: the two steps must log the same values (wall-clock ones aside)."""
    runs = {}
    for placement in ("spmd", "leader"):
        out, proc = vllm_runs[placement]
        _assert_ok(proc)
        assert f"weight sync: {'tp_shards' if placement == 'spmd' else 'shared_memory'}" in proc.stdout, proc.stdout[-2000:]
        runs[placement] = read_metrics(out)
    assert sorted(runs["spmd"]) == sorted(runs["leader"]) == [1, 2]
    for step in (1, 2):
        spmd, leader = deterministic(runs["spmd"][step]), deterministic(runs["leader"][step])
        problems = _same(spmd, leader)
        assert not problems, f"step {step}: spmd differs from leader:\n" + "\n".join(problems[:20])
        assert spmd["rollout_mismatch/mean_abs"] < 1e-3


def test_two_data_parallel_replicas_each_generate_their_share(module_runs):
    """DP=2: two engines (one per replica), gathered generation batches, one decision, one update."""
    out, proc = module_runs["dp2"]
    _assert_ok(proc)
    assert "dp 2" in proc.stdout, proc.stdout[-2000:]
    metrics = read_metrics(out)
    assert sorted(metrics) == [1, 2]
    for step in (1, 2):
        m = metrics[step]
        # Both replicas' generations were pooled: gen_batch_size prompts per generation batch.
        assert m["train/num_groups_generated"] == 8 * m["train/num_gen_batches"]
        assert m["actor/grad_norm"] > 0 and m["rollout_mismatch/mean_abs"] < 1e-3
