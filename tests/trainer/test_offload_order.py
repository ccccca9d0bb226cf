"""The trainer with the actor offloaded (`actor.offload_*`, `rollout.sleep_level=2`): the order in
which the GPU changes hands, and steps equal to those of a resident actor.

One process runs the real trainer on the tiny demo workspace twice (`_offload_worker.py`): with
offload and without, two steps each and a checkpoint after the first, with spies on the rollout
group, the offloader and the actor that record every call and whether the actor's storages were
resident (or freed) at that moment. On this CPU machine the engine's sleep is a no-op, but the
calls, their order and the offload itself (copy to host tensors, storages freed) are real.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.support.torchrun_utils import run_torchrun_script
from tests.support.trainer_runs import CONFIG, FAST, deterministic, workspace_overrides

WORKER = Path(__file__).with_name("_offload_worker.py")
OFFLOAD = ["actor.offload_params=true", "actor.offload_grads=true", "actor.offload_optimizer=true", "rollout.sleep_level=2"]

# After an update the GPU goes back to the engine: grads + optimizer out, engine weights in, push,
# params out, KV cache in.
HAND_OVER = ["offload:grads+optimizer", "engine:wake:weights", "sync", "offload:params", "engine:wake:kv_cache"]
EXPECTED = {
    # The engine is created with the whole actor offloaded, then the first push follows the step's order.
    "start": ["offload:all", "engine:create", "engine:sleep", "onload:params", *HAND_OVER],
    "step": ["generate", "engine:sleep", "onload:all", "log_probs", "update", *HAND_OVER],
    # A checkpoint reads the actor: engine sleeps, actor back, save, and the hand-over again.
    "save": ["engine:sleep", "onload:all", *HAND_OVER],
    # At sleep level 1 the engine kept the weights it has: the same hand-over without the push.
    "save_level1": ["engine:sleep", "onload:all", *[event for event in HAND_OVER if event != "sync"]],
}


@pytest.fixture(scope="module")
def runs(demo_workspace, tmp_path_factory):
    out = tmp_path_factory.mktemp("offload")
    overrides = [*FAST, *workspace_overrides(demo_workspace, out)]
    kwargs = {"config": str(CONFIG), "overrides": overrides, "offload_overrides": OFFLOAD, "output_dir": str(out)}
    result = run_torchrun_script(WORKER, nproc=1, args=[json.dumps(kwargs)], timeout=300, use_torchrun=False)
    result.check()
    runs = result.rank_results[0]
    assert runs is not None and "error" not in runs, result.tail()
    return runs


def test_the_gpu_changes_hands_in_order(runs):
    on = runs["offload"]
    assert on["offload_enabled"] and on["host_bytes"] > 0
    phases = on["phases"]
    assert phases["start"] == EXPECTED["start"]
    assert phases["step1"] == phases["step2"] == EXPECTED["step"]
    assert phases["save"] == EXPECTED["save"]
    assert phases["save_level1"] == EXPECTED["save_level1"]
    # Every recorded moment found the storages where the order says: resident for log-probs and the
    # update, params alone resident for the sync, everything freed while generating.
    assert on["checks"] == []


def test_without_offload_the_engine_still_wakes_weights_before_kv_cache(runs):
    resident = runs["resident"]
    assert not resident["offload_enabled"]
    # The offloader's calls are no-ops here (they still appear: the trainer's code path is one).
    step = [e for e in resident["phases"]["step1"] if not e.startswith(("offload:", "onload:"))]
    assert step == ["generate", "engine:sleep", "log_probs", "update", "engine:wake:weights", "sync", "engine:wake:kv_cache"]
    assert resident["phases"]["save"] == resident["phases"]["save_level1"] == []  # nothing was away: no hand-over


def test_offloaded_steps_equal_resident_steps(runs):
    on, off = runs["offload"], runs["resident"]
    for step, (a, b) in enumerate(zip(on["metrics"], off["metrics"]), start=1):
        a = {k: v for k, v in deterministic(a).items() if not k.startswith("actor_offload/")}
        b = deterministic(b)
        assert a == b, f"step {step}: " + str({k: (a.get(k), b.get(k)) for k in set(a) | set(b) if a.get(k) != b.get(k)})
        assert a["actor/grad_norm"] > 0
    assert on["metrics"][0]["actor_offload/gb"] > 0
    assert on["weights"] == off["weights"]  # bit-identical weights after two updates
