"""The exit save (SIGTERM) needs no engine (issue 26, item 4): `GpuHandover.actor_for_exit`.

The actor is offloaded while the engine generates; the save brings it back. On exit the engine's
sleep is tried and a failure passed over (an engine that died), and the GPU never goes back to the
engine: no wake, no weight push. The control: the periodic save's `actor_on_gpu` with the same
dead engine fails (the checkpoint would never be written), and an offloaded actor with a level-2
sleep pushes the weights into the engine after the save.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from megatron_dapo.trainer.handover import GpuHandover


class DeadEngineGroup:
    """A rollout group whose engine is gone: every call into it fails (as vLLM's EngineDeadError)."""

    sleep_discards_weights = True

    def __init__(self, calls: list) -> None:
        self.calls = calls

    def _dead(self, name: str):
        self.calls.append(f"engine:{name}")
        raise RuntimeError("EngineCore died")

    def sleep(self, level=None):
        self._dead("sleep")

    def wake_up(self, tags=None):
        self._dead("wake")

    def sync_weights(self, models, hf_config, bucket_mb):
        self._dead("sync")


class Offload:
    enabled = True

    def __init__(self, calls: list) -> None:
        self.calls, self.offloaded = calls, ("all",)

    def onload(self, *kinds):
        self.calls.append("onload")
        self.offloaded = ()
        return 0

    def offload(self, *kinds):
        self.calls.append("offload:" + "+".join(kinds or ("all",)))
        self.offloaded = kinds or ("all",)
        return 0


def _handover(calls: list) -> GpuHandover:
    return GpuHandover(SimpleNamespace(models=[]), Offload(calls), DeadEngineGroup(calls), None, 1.0)


def test_the_exit_save_passes_over_a_dead_engine_and_never_gives_the_gpu_back(capsys):
    calls: list = []
    with _handover(calls).actor_for_exit():
        calls.append("save")
    assert calls == ["engine:sleep", "onload", "save"]
    assert "could not sleep before the exit save" in capsys.readouterr().out


def test_an_exit_save_of_a_resident_actor_does_not_touch_the_engine():
    calls: list = []
    handover = _handover(calls)
    handover.offload.offloaded = ()
    with handover.actor_for_exit():
        calls.append("save")
    assert calls == ["save"]


def test_the_periodic_save_path_needs_the_engine():
    """The control: what the exit save used before (`actor_on_gpu`) fails on a dead engine."""
    calls: list = []
    with pytest.raises(RuntimeError, match="EngineCore died"):
        with _handover(calls).actor_on_gpu():
            calls.append("save")
    assert calls == ["engine:sleep"]  # the checkpoint was never reached
