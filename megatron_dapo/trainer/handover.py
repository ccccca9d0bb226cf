"""The GPU changing hands between the rollout engine and the actor, twice per step.

Before the log-probs the engine sleeps (`rollout.sleep_level`) and the actor's offloaded state comes
back (`actor.offload_*`). After the update grads and optimizer state go to host memory, the engine's
weights wake, the new weights are pushed, the actor's params go to host memory, and only then does
the engine's KV cache wake: the KV cache never shares the GPU with the actor state that is
offloaded. Without offload the calls are the same (the offloader's are no-ops), so the trainer has
one code path.

Leader placement (vLLM, SGLang): the replica's leader alone sleeps and wakes the engine, but the
engine's memory lies on the GPUs of the replica's other ranks too (its TP workers), and each rank
onloads or offloads only its own actor state. So the replica's ranks meet (`ReplicaBarrier`) after
every engine sleep, before any rank onloads into memory the engine may still hold, and before
every engine wake (and the engine's creation), once every rank has put its actor state away. The
spmd placement needs no meeting: there each rank's engine shard lives on that rank's own GPU, and
its sleep returns in the same thread before that rank onloads. Neither does the embedded engine: it
runs in the leader's process, on the leader's GPU alone.
"""

from __future__ import annotations

import datetime
from contextlib import contextmanager, nullcontext
from typing import Any, Iterator, Optional, Sequence

import torch.distributed as dist

from megatron_dapo.actor.offload import ActorOffload, OffloadStats
from megatron_dapo.config import Config
from megatron_dapo.distributed import liveness
from megatron_dapo.distributed.layout import ParallelLayout
from megatron_dapo.distributed.placement import replica_groups
from megatron_dapo.rollout.group import RolloutGroup
from megatron_dapo.rollout.sync.dispatch import SyncStats
from megatron_dapo.trainer.metrics import Phase
from megatron_dapo.trainer.remote_rollout import RemoteRollout


def handover_groups(layout: ParallelLayout, engine: str) -> list[list[int]]:
    """The sets of global ranks that meet around every engine sleep and wake (pure; see the module doc).

    Leader placement with an engine in processes of its own (vLLM, SGLang): each replica of more
    than one rank (its TP x PP x CP ranks, leader first), since the leader's engine may hold memory on
    any of their GPUs. spmd placement or the embedded engine: none (a rank's own engine memory is
    freed by its own thread before it onloads)."""
    if layout.placement in ("spmd", "separate") or engine == "embedded":
        return []
    coordinates = [layout.coordinates(r) for r in range(layout.world_size)]
    groups = replica_groups([(c["dp"], c["pp"], c["cp"], c["tp"]) for c in coordinates])
    return [group for group in groups if len(group) > 1]


class ReplicaBarrier:
    """The meeting of this rank's replica around engine sleeps and wakes (a no-op where none is needed).

    The wait is on the host, outside NCCL's watchdog, and touches no GPU memory while the engine may
    still hold it: in the job's store (`liveness.await_ranks`), so that the replica waits for its
    leader's engine start (minutes) as long as the leader beats, and stops within the liveness window
    if it is gone; a gloo group per replica (`handover_groups`) where no beat runs (torch.distributed
    not set up by `init_distributed`)."""

    def __init__(self, group: Optional[Any] = None, ranks: Sequence[int] = ()) -> None:
        self.group, self.ranks = group, tuple(ranks)

    @classmethod
    def create(cls, layout: ParallelLayout, engine: str, timeout_s: float) -> "ReplicaBarrier":
        """Every rank calls it (`new_group` is a world collective, once per replica, same order)."""
        groups = handover_groups(layout, engine)
        if not groups or not dist.is_initialized():
            return cls()
        me, mine = dist.get_rank(), cls()
        timeout = datetime.timedelta(seconds=float(timeout_s))
        for ranks in groups:
            group = dist.new_group(ranks, backend="gloo", timeout=timeout)
            if me in ranks:
                mine = cls(group, ranks)
        return mine

    def wait(self, what: str = "the replica's meeting around its engine") -> None:
        """Return once every rank of this replica has called it."""
        if self.group is None:
            return
        if liveness.beating():
            liveness.await_ranks(self.ranks, f"replica{self.ranks[0]}", what=what)
        else:
            dist.barrier(group=self.group)


class GpuHandover:
    """Moves the GPU between `rollout` (the engine) and `actor` (through `offload`)."""

    def __init__(
        self, actor: Any, offload: ActorOffload, rollout: RolloutGroup, hf_config: Any, bucket_mb: float,
        barrier: Optional[ReplicaBarrier] = None,
    ) -> None:  # fmt: skip
        self.actor, self.offload, self.rollout = actor, offload, rollout
        self.hf_config, self.bucket_mb = hf_config, bucket_mb
        self.barrier = barrier or ReplicaBarrier()

    def to_actor(self, timer=None) -> OffloadStats:
        """The engine sleeps, then the actor's offloaded state comes back. Returns the onload's figures."""
        self.rollout.sleep()
        self.barrier.wait("waiting for the leader's engine to sleep")  # its memory is free on every GPU
        with _phase(timer, Phase.ONLOAD, self.offload.enabled):
            return self.offload.onload()

    def to_engine(self, timer=None, *, push: bool = True) -> tuple[Optional[SyncStats], OffloadStats]:
        """After an update: grads + optimizer to host -> engine weights wake -> weight sync -> params to
        host -> engine KV cache wakes. Returns the sync's figures (None without `push`: the engine
        still holds the actor's current weights) and the offloads' figures."""
        with _phase(timer, Phase.OFFLOAD, self.offload.enabled):
            moved = self.offload.offload("grads", "optimizer")
        self.barrier.wait()  # every rank's grads and optimizer state are away
        self.rollout.wake_up(["weights"])
        synced = None
        if push:
            with _phase(timer, Phase.SYNC):
                synced = self.rollout.sync_weights(self.actor.models, self.hf_config, self.bucket_mb)
        with _phase(timer, Phase.OFFLOAD, self.offload.enabled):
            moved += self.offload.offload("params")
        self.barrier.wait()  # every rank's params are away
        self.rollout.wake_up(["kv_cache"])
        return synced, moved

    @contextmanager
    def actor_on_gpu(self) -> Iterator[None]:
        """Between steps, for what reads the actor's state (a checkpoint): when the actor is offloaded
        the GPU changes hands once more, and back. The engine then still has the actor's weights,
        unless a deep sleep discarded them (then they are pushed again)."""
        away = bool(self.offload.offloaded)
        if away:
            self.to_actor()
        yield
        if away:
            self.to_engine(push=self.rollout.sleep_discards_weights)


    @contextmanager
    def actor_for_exit(self) -> Iterator[None]:
        """The exit save's hand-over (SIGTERM): the actor's offloaded state comes back for the save,
        and the GPU never goes back to the engine (no wake, no push: the process ends). The save
        needs no engine: where the leader's engine cannot sleep (it died, or its sleep fails) that
        is said and passed over; the replica still meets, so every rank onloads only after the
        leader is done with its engine either way."""
        if self.offload.offloaded:
            try:
                self.rollout.sleep()
            except Exception as error:  # noqa: BLE001 - the checkpoint must not depend on the engine
                print(f"the rollout engine could not sleep before the exit save ({type(error).__name__}: {error}); saving anyway", flush=True)
            self.barrier.wait()
            self.offload.onload()
        yield


def start_engine(
    cfg: Config, layout: ParallelLayout, actor: Any, offload: ActorOffload, hf_config: Any, device, bridge: Optional[Any] = None,
    weight_version: int = 0,
) -> tuple[GpuHandover, SyncStats]:
    """Create the rollout engine beside the actor and push the actor's weights into it.

    The engine starts from the HF weights; after a resume (or from a Megatron checkpoint) the
    actor's differ, hence the push. With offload the engine starts on a GPU without the actor's
    state (vLLM sizes its pool from the free memory); the first push then follows every step's order.
    In the separate placement the engines start on their own ranks (`rollout_worker`) and this
    makes the trainer's handle on them (`RemoteRollout`, `bridge`: the head's end of the bridge;
    `weight_version`: how many updates the actor's weights have had, the step it resumes after).
    Returns the hand-over and the first push's figures."""
    if layout.separate:
        rollout = RemoteRollout.create(cfg, layout, bridge, weight_version=weight_version)
        handover = GpuHandover(actor, offload, rollout, hf_config, cfg.rollout.weight_sync_bucket_mb)
        first_push, _ = handover.to_engine()
        return handover, first_push
    barrier = ReplicaBarrier.create(layout, cfg.rollout.engine, cfg.rollout.gather_timeout_s)
    offload.offload()
    barrier.wait("waiting for the replica's actor state to leave the GPUs")  # then the engine starts and sizes its pool
    rollout = RolloutGroup.create(cfg, layout, cfg.model.hf_dir, device)
    if offload.enabled:
        rollout.sleep()
        barrier.wait("waiting for the leader's engine to start")
        offload.onload("params")
    handover = GpuHandover(actor, offload, rollout, hf_config, cfg.rollout.weight_sync_bucket_mb, barrier)
    first_push, _ = handover.to_engine()
    return handover, first_push


def _phase(timer, name: str, timed: bool = True):
    """`timer.phase(name)`, or nothing when there is no timer (start-up, checkpoints) or nothing to time."""
    return timer.phase(name) if timer is not None and timed else nullcontext()
