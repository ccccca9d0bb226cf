"""The separate placement's engine ranks: what the last `rollout.num_gpus` ranks of the launch run.

The same program as the trainer's ranks (`train`), which branches here after start-up
(`DistributedContext.role == "rollout"`). Each group of rollout.tp rollout ranks holds one engine,
built by its first rank, the *owner* (its vLLM / SGLang workers take the group's GPUs, as a
colocated leader's take its replica's); the group's other ranks lend their GPUs and wait until the
owners are done. An owner serves the trainer's head over the bridge (`distributed/bridge.py`), one
message at a time, in order:

* `GenerateShare`: generate and score the share (the reward function runs here, beside the engine),
  answer with the packed samples;
* `PushWeights`: receive the new weights bucket by bucket, load and commit them, answer `PushDone`;
* `StopServing`: shut the engine down and leave.

The weights an engine generates with are therefore always the last push before the request: the
trainer's order of messages decides it, which keeps a run reproducible.

With partial rollouts (`rollout.partial_rollouts`) the head announces pushes on a channel of their
own instead, which the engine reads between decode steps (`rollout.sync.remote.BridgePushes`) and
the owner while it waits for work: a push lands as soon as the trainer sends it, the sequences in
flight carry on with the new weights, and every sample records its tokens' versions.
"""

from __future__ import annotations

import signal
import time
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from megatron_dapo.config import Config
from megatron_dapo.distributed.objects import gather_objects
from megatron_dapo.distributed.placement import EngineDevices, assign_engine_devices
from megatron_dapo.rollout.group import RolloutGroup, make_engine, this_rank_gpu
from megatron_dapo.rollout.sync.remote import BridgePushes, PushWeights, receive_push
from megatron_dapo.trainer.parts import build_reward_manager
from megatron_dapo.trainer.remote_rollout import GenerateShare, ShareResult, StopServing
from megatron_dapo.trainer.samples import generate_and_score, pack_samples

__all__ = ["lend_until_done", "owner_done", "pool_engine_devices", "serve_rollout"]

_DONE_KEY = "mdapo_rollout_pool/done"
_POLL_S = 1.0


def pool_engine_devices(layout: Any, engine: str, device: torch.device) -> Optional[EngineDevices]:
    """The GPUs of the engine this rollout rank owns (None off the GPU, or where it owns none): each
    group of rollout.tp consecutive rollout ranks is one engine, placed as a colocated leader's
    (`placement.assign_engine_devices`). A collective of the rollout ranks."""
    mine = this_rank_gpu(device)
    if mine is None:
        return None
    ranks = gather_objects(mine)
    groups = [list(range(first, first + layout.rollout_tp)) for first in range(0, layout.rollout_ranks, layout.rollout_tp)]
    me = dist.get_rank()
    for devices in assign_engine_devices("leader", engine, layout.rollout_tp, ranks, groups):
        if devices.owner == me:
            return devices
    return None


def serve_rollout(cfg: Config, runtime: Any, say: Callable[[str], None] = print) -> None:
    """Run this rollout rank until the trainer stops the engines (see the module doc).

    SIGTERM (SLURM's preemption notice reaches every task) does not stop it: the trainer saves its
    checkpoint first, which takes the results still on their way from the engines, then stops them."""
    signal.signal(signal.SIGTERM, lambda signum, frame: None)
    ctx = runtime.ctx
    devices = pool_engine_devices(ctx.layout, cfg.rollout.engine, ctx.device)
    bridge = ctx.bridge
    if bridge is None:
        lend_until_done(ctx.layout.rollout_engines)
        return
    engine = make_engine(cfg, cfg.model.hf_dir, ctx.device, placement="leader", devices=devices)
    reward = build_reward_manager(cfg, runtime.tokenizer)
    rollout = RolloutGroup(engine, free_cache=False, engine_kind=cfg.rollout.engine, device_type=ctx.device.type)
    version = -1  # the weights the engine holds: none of the actor's before the first push
    timeline = OwnerTimeline()
    listener = bridge.listen(0, last=lambda message: isinstance(message, StopServing)) if cfg.rollout.partial_rollouts else None
    pushes = BridgePushes(bridge, listener, version, timeline.take) if listener is not None else None
    commit = getattr(engine, "commit_weights", None) or (lambda: None)
    sending: list = []  # results on their way: the next request is read while the head has not taken them yet
    try:
        while True:
            if pushes is None:
                waiting = time.perf_counter()
                message = bridge.recv(0)
                waited = time.perf_counter() - waiting
                timeline.waited(waited)
            else:
                message, waited = _next_work(listener, pushes, timeline, engine.load_weights, commit)
            if isinstance(message, GenerateShare):
                timeline.started()
                result = _generate_share(rollout, reward, message, version if pushes is None else pushes.version, waited, pushes)
                timeline.ended()
                sending = [pending for pending in sending if not pending.done()]
                sending.append(bridge.send(result, 0, wait=False))
            elif isinstance(message, PushWeights):
                version = receive_push(bridge, engine, message, *timeline.take()).version
            elif isinstance(message, StopServing):
                break
            else:
                raise RuntimeError(f"rollout rank {ctx.rank}: unexpected message from the trainer: {message!r}")
        if listener is not None:
            listener.join()
        for pending in sending:  # the head takes every result before it says stop
            pending.wait()
    finally:
        reward.close()
        rollout.shutdown()
        owner_done()


class OwnerTimeline:
    """What an engine owner did since the last push, reported with the next one (`PushDone`): the
    wall-clock (start, end) of its work on each request (a request a push lands in is split there)
    and the seconds it waited for work or weights."""

    def __init__(self) -> None:
        self._busy: list[tuple[float, float]] = []
        self._since: Optional[float] = None  # the request in progress began (or was split) then
        self._waited = 0.0

    def waited(self, seconds: float) -> None:
        self._waited += seconds

    def started(self) -> None:
        self._since = time.time()

    def ended(self) -> None:
        self._busy.append((self._since, time.time()))
        self._since = None

    def take(self) -> tuple[tuple[tuple[float, float], ...], float]:
        """(busy intervals, seconds waited) since the last push, and start counting anew."""
        now = time.time()
        busy = self._busy + ([(self._since, now)] if self._since is not None else [])
        waited = self._waited
        self._busy, self._waited = [], 0.0
        if self._since is not None:
            self._since = now
        return tuple(busy), waited


def _next_work(listener: Any, pushes: BridgePushes, timeline: OwnerTimeline, load: Callable, commit: Callable) -> tuple[Any, float]:
    """Partial rollouts: (the head's next message other than a push, seconds waited for messages),
    taking every push that arrives meanwhile (a push goes first: a request waiting beside it is
    then generated with the new weights). Only the waits count as waiting, not the pushes' loads."""
    waited = 0.0
    while True:
        if pushes.pending():
            pushes.receive(load, commit)
            continue
        waiting = time.perf_counter()
        message = listener.take(block=True)
        seconds = time.perf_counter() - waiting
        timeline.waited(seconds)  # before a push this wait is reported with it
        waited += seconds
        if not isinstance(message, PushWeights):
            return message, waited
        pushes.hold(message)


def _generate_share(
    rollout: RolloutGroup, reward: Any, request: GenerateShare, version: int, waited_s: float, pushes: Optional[BridgePushes]
) -> ShareResult:
    started = time.time()
    samples = generate_and_score(
        rollout, reward, request.examples, request.params, uid_prefix=request.uid_prefix, validating=request.validating,
        apply_overlong=request.apply_overlong, routing_dtype=request.routing_dtype, pushes=pushes,
    )  # fmt: skip
    packed = pack_samples(samples) if samples is not None and len(samples) else None
    return ShareResult(packed=packed, version=version, started=started, ended=time.time(), waited_s=waited_s)


def _store() -> Any:
    return dist.distributed_c10d._get_default_store()


def owner_done() -> None:
    """An owner leaves: counted in the rollout world's store, where the lenders look."""
    if dist.is_initialized():
        _store().add(_DONE_KEY, 1)


def lend_until_done(owners: int) -> None:
    """A rank that lends its GPU to its group's engine waits until the `owners` engine owners have
    left (the trainer stopped them), looking at the store once a second: no collective that could
    time out during a run of days."""
    while int(_store().add(_DONE_KEY, 0)) < owners:
        time.sleep(_POLL_S)
