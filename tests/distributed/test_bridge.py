"""The bridge's listened channel (partial rollouts): a thread of the owner receives the head's
messages as they arrive; the engine takes a push ahead of the requests queued before it, without
waiting when there is none; the channel ends with its last message. Two real gloo ranks."""

from __future__ import annotations

from pathlib import Path

import pytest

from megatron_dapo.rollout.sync.remote import BridgePushes, PushWeights
from tests.support.torchrun_utils import run_torchrun_function

WORKER = Path(__file__).with_name("_bridge_worker.py")


def test_a_listener_receives_in_order_and_a_push_goes_first():
    result = run_torchrun_function(WORKER, "listened_channel", nproc=2, timeout=120)
    result.check()
    head, owner = result.rank_results
    assert head == {"from owner": "result 1"}
    assert owner["before"] is None
    assert owner["push first"] == 1 and owner["no other push"] is None
    assert owner["rest"] == ["request 1", "request 2", "stop"]
    assert "received its last message" in owner["after last"]


class _Listener:
    def __init__(self, *messages):
        self.messages = list(messages)

    def take(self, kind=None, block=True):
        for index, message in enumerate(self.messages):
            if kind is None or isinstance(message, kind):
                return self.messages.pop(index)
        return None


def test_bridge_pushes_hold_one_push_at_a_time():
    pushes = BridgePushes(bridge=None, listener=_Listener("request"), version=3, timeline=lambda: ((), 0.0))
    assert pushes.version == 3 and not pushes.pending()
    pushes.hold(PushWeights(4))
    assert pushes.pending()
    with pytest.raises(RuntimeError, match="two weight pushes waiting"):
        pushes.hold(PushWeights(5))
    with pytest.raises(RuntimeError, match="no weight push is waiting"):
        BridgePushes(None, _Listener(), 0, lambda: ((), 0.0)).receive(lambda bucket: None, lambda: None)
