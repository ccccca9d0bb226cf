"""Weight sync to engines on ranks of their own (`rollout.placement=separate`): full tensors over the bridge.

    transport = BridgeBroadcast(bridge)            # the trainer's head; None elsewhere in replica 0
    sync_weights(actor.gpt_models, hf_cfg, transport, bucket_mb=...)
    # every engine owner, told by the head's PushWeights message:
    receive_push(bridge, engine)

The stream is the "gather" mode's (`gather.iter_full_tensors`, the architecture's mapping table):
every rank of the first data-parallel replica takes part in the export, which leaves each full HF
tensor on every one of them; the head (launch rank 0) alone hands the buckets on. Each bucket
crosses the bridge once, as one broadcast per dtype from the head to every engine owner
(`distributed/bridge.py`: NCCL between GPUs, gloo on the CPU), and each owner loads it with
`RolloutEngine.load_weights`, whose loaders take what the engine's TP ranks need. The push ends
with an end-of-push marker and each owner's reply after its engine committed the weights, so the
push returns when every engine is ready to generate with them.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Optional

from megatron_dapo.rollout.base import WeightPushes
from megatron_dapo.rollout.sync.dispatch import FullTensors

__all__ = ["BridgePushes", "BridgeBroadcast", "PushDone", "PushWeights", "receive_push"]


@dataclass(frozen=True)
class PushWeights:
    """The head's message to every engine owner: weight buckets follow on the bridge until the end marker."""

    version: int
    """How many updates the weights have had (0: the starting weights)."""


@dataclass(frozen=True)
class PushDone:
    """An owner's reply once its engine committed the push, with what the engine did since the last one."""

    version: int
    load_seconds: float
    busy: tuple[tuple[float, float], ...] = ()
    """(start, end) wall-clock times (`time.time()`) of the work on each request since the last push."""
    waited_s: float = 0.0
    """Seconds the owner waited for a message (work or weights) since the last push."""


class BridgeBroadcast(FullTensors):
    """Mode "gather" to engines across the bridge: the "gather" stream of full tensors, and the head
    broadcasts every bucket to the owners instead of loading it into an engine of its own."""

    def __init__(self, bridge: Optional[Any], announce_on: str = "work") -> None:
        """`bridge`: the head's end of the bridge; None on the other ranks of the exporting replica.
        `announce_on`: the channel of the push's announcement: "work" (behind the requests sent
        before it: every engine finishes those first) or "listened" (partial rollouts: seen between
        decode steps, `BridgePushes`)."""
        if bridge is not None and not bridge.is_head:
            raise ValueError("only the trainer's head pushes weights over the bridge")
        super().__init__(None)
        self.bridge = bridge
        self.announce_on = announce_on
        self.version = 0
        self._announced = False
        self.replies: list[PushDone] = []
        """Every owner's `PushDone` of the last push (the head)."""

    @property
    def delivers(self) -> bool:
        return self.bridge is not None

    def deliver(self, bucket) -> None:
        if not self._announced:
            for owner in range(1, self.bridge.size):
                self.bridge.send(PushWeights(self.version), owner, channel=self.announce_on)
            self._announced = True
        self.bridge.broadcast_bucket(bucket)

    def commit(self) -> None:
        """End the push and wait until every engine has committed it."""
        self.bridge.broadcast_bucket(None)
        self.replies = []
        for owner in range(1, self.bridge.size):
            reply = self.bridge.recv(owner, channel="replies")  # results of earlier requests may still be on their way
            if not isinstance(reply, PushDone) or reply.version != self.version:
                raise RuntimeError(f"engine owner {owner} answered the push of version {self.version} with {reply!r}")
            self.replies.append(reply)
        self._announced = False


def receive_push(
    bridge: Any, engine: Any, message: PushWeights, busy: tuple = (), waited_s: float = 0.0
) -> PushDone:
    """An engine owner's side of one push (after `message`): load every bucket, commit, reply (with
    the owner's `busy` intervals and `waited_s` since the last push)."""
    return _receive(bridge, message, engine.load_weights, getattr(engine, "commit_weights", None) or (lambda: None), busy, waited_s)


def _receive(bridge: Any, message: PushWeights, load, commit, busy: tuple, waited_s: float) -> PushDone:
    loading = 0.0
    while True:
        bucket = bridge.broadcast_bucket(None)
        if bucket is None:
            break
        started = time.perf_counter()
        load(bucket)
        loading += time.perf_counter() - started
        del bucket
    started = time.perf_counter()
    commit()
    done = PushDone(message.version, loading + time.perf_counter() - started, tuple(busy), waited_s)
    bridge.send(done, 0, channel="replies")
    return done


class BridgePushes(WeightPushes):
    """An engine owner's pushes with partial rollouts: the head sends every message to the owner on
    the listened channel (`BridgeBroadcast(announce_on="listened")`), which a thread receives as it
    arrives (`distributed.bridge.Listener`), so the engine finds a push there between two decode
    steps (`pending`) and the owner while it waits for work; `receive` takes the buckets from the
    bridge into the engine. `timeline()` gives the owner's busy intervals and waiting since the last
    push, reported with it (`PushDone`)."""

    def __init__(self, bridge: Any, listener: Any, version: int, timeline) -> None:
        self._bridge, self._listener, self._version, self._timeline = bridge, listener, int(version), timeline
        self._waiting: Optional[PushWeights] = None

    @property
    def version(self) -> int:
        return self._version

    def pending(self) -> bool:
        if self._waiting is None:
            self._waiting = self._listener.take(PushWeights, block=False)
        return self._waiting is not None

    def hold(self, message: PushWeights) -> None:
        """A push the owner took from the listener while it waited for work: the next to receive."""
        if self._waiting is not None:
            raise RuntimeError(f"two weight pushes waiting (versions {self._waiting.version} and {message.version})")
        self._waiting = message

    def receive(self, load, commit) -> int:
        if not self.pending():
            raise RuntimeError("no weight push is waiting")
        message, self._waiting = self._waiting, None
        busy, waited_s = self._timeline()
        self._version = _receive(self._bridge, message, load, commit, busy, waited_s).version
        return self._version
