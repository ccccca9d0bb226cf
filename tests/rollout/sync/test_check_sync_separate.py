"""`megatron-dapo check-sync --placement separate` end to end, as a user runs it (a subprocess).

Its own file, outside the second stack's selection (tests/support/tiers.py): the bridge and the
owners' comparison do not depend on the Megatron-Core release, whose export the second stack
checks in test_check_sync.py. The owners' requests on a real engine and their error paths, in
process: tests/trainer/test_check_sync_separate.py.
"""

from __future__ import annotations

import re

from tests.support.check_sync_runs import run_check_sync


def test_separate_placement_checks_every_engine_on_its_own_ranks(tiny_model_dirs):
    """--placement separate: a TP=2 actor (ranks 0-1) and two embedded engines on ranks 2 and 3; the
    weights cross the bridge as in training (gather), each owner compares its engine's tensors with
    the export streamed to it and samples for the mismatch."""
    out = run_check_sync("--hf-dir", str(tiny_model_dirs["qwen2_tied"]), "--tp", "2", "--placement", "separate",
                         "--rollout-ranks", "2", timeout=400)  # fmt: skip
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "starting 4 processes (tp=2 x pp=1, + 2 for the engines)" in out.stdout
    assert "2 engine(s) of TP=1 on 2 rank(s) of their own" in out.stdout
    assert "before the sync, 50 of 50 engine tensors differ from the actor" in out.stdout
    assert "(gather)" in out.stdout
    assert "engine 1 (launch rank 2):" in out.stdout and "engine 2 (launch rank 3):" in out.stdout
    assert len(re.findall(r"^   OK    ", out.stdout, flags=re.M)) == 2 * 50  # every tensor of both engines
    assert "50 of 50 tensors equal" in out.stdout and "PASS" in out.stdout
    diffs = [float(m) for m in re.findall(r"max \|diff\| (\S+)   k3", out.stdout)]
    assert len(diffs) == 2 and max(diffs) < 1e-4, out.stdout[-2000:]  # one line per engine


def test_separate_placement_with_one_vllm_engine_of_tp_2_on_two_ranks(require_vllm, demo_workspace):
    """--rollout-ranks 2 --rollout-tp 2: one vLLM engine of TP=2 whose owner (launch rank 1) starts
    both TP workers while the other rollout rank lends its GPU and waits (on a cluster, the worker's
    GPU) until the owner is done; each TP worker loads its slices of the full tensors pushed to the
    owner. The demo's model: vLLM's CPU attention has no kernel for the tiny test models' head size."""
    out = run_check_sync("--hf-dir", str(demo_workspace["model"]), "--engine", "vllm", "--placement", "separate",
                         "--rollout-ranks", "2", "--rollout-tp", "2", timeout=400)  # fmt: skip
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "1 engine(s) of TP=2 on 2 rank(s) of their own (separate, from launch rank 1)" in out.stdout
    assert "51 of 51 tensors equal" in out.stdout and "PASS" in out.stdout
