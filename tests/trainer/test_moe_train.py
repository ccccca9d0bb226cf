"""A mixture of experts through the real trainer: the demo's tiny Qwen3-MoE (8 experts, top-2; `megatron-dapo
demo --model moe`), the embedded engine, two processes (DP=2).

* EP=2 against EP=1: the same two steps (every logged value but wall-clock ones within float32
  rounding), the weights pushed into the engine after each update (the rollout/trainer log-prob
  mismatch at step 2 stays at rounding level), the MoE metrics logged;
* a checkpoint saved at EP=2 resumes at EP=2: step 2 after resuming from step 1 equals step 2 of the
  uninterrupted run;
* the EP=2 checkpoint converts to an HF directory equal to the EP=1 run's (`convert megatron-to-hf`);
* one process with vLLM's CPU build: the experts pushed in place after step 1 (vLLM's CPU kernel
  re-packed, `rollout/engines/vllm/experts.py`) generate step 2 with the actor's log-probs.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from safetensors.torch import load_file

from megatron_dapo.checkpoint import step_dir_name
from tests.support.torchrun_utils import two_at_a_time
from tests.support.trainer_runs import CONFIG, FAST, assert_ok, deterministic, read_metrics, run_cli, workspace_overrides

STEPS = ["trainer.total_steps=2", "trainer.save_every=1", "moe.z_loss_coeff=0.001"]


@pytest.fixture(scope="module")
def runs(moe_workspace, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("moe-runs")
    out = {f"ep{ep}": root / f"ep{ep}" for ep in (1, 2)}
    procs = two_at_a_time({
        name: (lambda ep=ep, name=name: run_cli("train", "--config", str(CONFIG), *FAST, *STEPS, f"parallel.ep={ep}",
                                                *workspace_overrides(moe_workspace, out[name]), nproc=2, timeout=600))
        for ep, name in ((1, "ep1"), (2, "ep2"))
    })  # fmt: skip
    for proc in procs.values():
        assert_ok(proc)
    return out


@pytest.fixture(scope="module")
def from_the_checkpoints(runs, moe_workspace, tmp_path_factory) -> dict[str, tuple[Path, object]]:
    """The EP=2 resume from step 1 and the conversion of each run's last checkpoint, two at a time:
    name -> (output directory, process)."""
    root = tmp_path_factory.mktemp("moe-from-checkpoints")
    resumed = root / "resumed"
    shutil.copytree(runs["ep2"], resumed)
    shutil.rmtree(resumed / "checkpoints" / step_dir_name(2))
    (resumed / "checkpoints" / "latest").write_text(step_dir_name(1) + "\n")
    jobs = {
        "resumed": lambda: run_cli("train", "--config", str(CONFIG), *FAST, *STEPS, "parallel.ep=2", "--resume",
                                   *workspace_overrides(moe_workspace, resumed), nproc=2, timeout=600),
        **{f"converted_{name}": (lambda name=name: run_cli("convert", "megatron-to-hf", "--megatron-dir", str(runs[name] / "checkpoints"),
                                                            "--output", str(root / name), "--no-progress", threads=1))
           for name in ("ep1", "ep2")},
    }  # fmt: skip
    procs = two_at_a_time(jobs)
    return {"resumed": (resumed, procs["resumed"]), **{f"converted_{n}": (root / n, procs[f"converted_{n}"]) for n in ("ep1", "ep2")}}


def _close(a: dict, b: dict, rel: float = 1e-4, abs_: float = 1e-6) -> list[str]:
    return [f"{k}: {a.get(k)} vs {b.get(k)}" for k in sorted(set(a) | set(b))
            if k not in a or k not in b or abs(a[k] - b[k]) > abs_ + rel * abs(b[k])]  # fmt: skip


def test_expert_parallel_training_equals_ep1(runs):
    ep1, ep2 = read_metrics(runs["ep1"]), read_metrics(runs["ep2"])
    assert sorted(ep1) == sorted(ep2) == [1, 2]
    for step in (1, 2):
        problems = _close(deterministic(ep2[step]), deterministic(ep1[step]))
        assert not problems, f"step {step}:\n" + "\n".join(problems[:20])
        m = ep2[step]
        assert m["actor/moe_aux_loss"] > 0 and m["actor/moe_z_loss"] > 0 and m["actor/moe_load_ratio_max"] >= 1
        assert m["actor/grad_norm"] > 0 and m["weight_sync/seconds"] > 0
    # Step 2 generated with the weights pushed after step 1's update: the engine's experts are the actor's.
    assert ep2[2]["rollout_mismatch/mean_abs"] < 1e-5, ep2[2]["rollout_mismatch/mean_abs"]
    layout = json.loads((runs["ep2"] / "checkpoints" / step_dir_name(2) / "metadata.json").read_text())["layout"]
    assert layout["ep"] == 2 and layout["dp"] == 2


def test_ep2_checkpoint_resumes_at_ep2(runs, from_the_checkpoints):
    resumed, proc = from_the_checkpoints["resumed"]
    assert_ok(proc)
    before, after = read_metrics(runs["ep2"]), read_metrics(resumed)
    assert sorted(after) == [1, 2]
    assert deterministic(after[2]) == deterministic(before[2])


def test_ep2_checkpoint_converts_to_the_ep1_weights(from_the_checkpoints):
    exported = {}
    for name in ("ep1", "ep2"):
        out, proc = from_the_checkpoints[f"converted_{name}"]
        assert_ok(proc)
        exported[name] = {k: v for f in sorted(out.glob("*.safetensors")) for k, v in load_file(f).items()}
    assert sorted(exported["ep1"]) == sorted(exported["ep2"])
    assert any(".mlp.experts.7.down_proj.weight" in k for k in exported["ep2"])  # every expert, under its global id
    worst = max(float((exported["ep2"][k] - exported["ep1"][k]).abs().max()) for k in exported["ep1"])
    assert worst < 1e-6, worst


def test_vllm_engine_trains_the_moe_with_its_experts_pushed_in_place(moe_workspace, tmp_path, require_vllm):
    out = tmp_path / "vllm"
    assert_ok(run_cli("train", "--config", str(CONFIG), *FAST, "trainer.total_steps=2", "rollout.engine=vllm",
                      *workspace_overrides(moe_workspace, out), timeout=900))  # fmt: skip
    metrics = read_metrics(out)
    assert sorted(metrics) == [1, 2]
    for step in (1, 2):
        assert metrics[step]["weight_sync/seconds"] > 0 and metrics[step]["actor/moe_aux_loss"] > 0
        # A stale expert kernel (the in-place push not re-packed) is off by whole nats here.
        assert metrics[step]["rollout_mismatch/max_abs"] < 1e-3, metrics[step]
