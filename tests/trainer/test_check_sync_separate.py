"""check-sync's separate placement, the decisions that need no engine (the end-to-end runs, with the
embedded engine and vLLM: tests/rollout/sync/test_check_sync.py): an owner that cannot answer fails
the check at once without leaving another owner, or itself, waiting in a send."""

from __future__ import annotations

import argparse
from types import SimpleNamespace

import pytest
import torch

from megatron_dapo.distributed.layout import ParallelLayout
from megatron_dapo.trainer.check_sync_separate import Answer, RemoteEngines, StopCheck, serve_check


class RecordingBridge:
    """The head's or an owner's end of the bridge: hands out `incoming` in order, records the rest."""

    def __init__(self, incoming=()) -> None:
        self.incoming, self.sent, self.read_from = list(incoming), [], []

    def recv(self, source: int, channel: str = "work"):
        self.read_from.append(source)
        return self.incoming.pop(0)

    def send(self, message, to: int, wait: bool = True, channel: str = "work"):
        self.sent.append((to, message))


def _layout(engines: int) -> ParallelLayout:
    return ParallelLayout(tp=2, placement="separate", rollout_ranks=engines).resolve(2 + engines)


def test_every_answer_is_read_before_an_owners_error_is_raised():
    bridge = RecordingBridge([Answer("ready"), Answer(error="the engine did not start: OSError: no such file"), Answer("ready")])
    engines = RemoteEngines(argparse.Namespace(), SimpleNamespace(layout=_layout(3), bridge=bridge))
    with pytest.raises(RuntimeError, match=r"engine owner 2 \(launch rank 3\): the engine did not start: OSError"):
        engines._answers()
    assert bridge.read_from == [1, 2, 3]  # owner 3's answer taken too: it does not wait in its send


def test_an_answer_of_the_wrong_kind_names_the_owner():
    engines = RemoteEngines(argparse.Namespace(), SimpleNamespace(layout=_layout(1), bridge=RecordingBridge(["ready"])))
    with pytest.raises(RuntimeError, match="engine owner 1 answered with 'ready'"):
        engines._answers()


def test_an_owner_whose_engine_does_not_start_answers_and_waits_for_the_stop():
    bridge = RecordingBridge([StopCheck()])
    ctx = SimpleNamespace(layout=_layout(1), bridge=bridge, device=torch.device("cpu"))

    def make_engine(devices):
        raise OSError("no model here")

    with pytest.raises(OSError, match="no model here"):
        serve_check(argparse.Namespace(engine="embedded", hf_dir="nowhere"), ctx, make_engine)
    assert len(bridge.sent) == 1 and bridge.sent[0][0] == 0
    assert bridge.sent[0][1].error == "the engine did not start: OSError: no model here"
    assert bridge.read_from == [0]  # it left only after the head's stop
