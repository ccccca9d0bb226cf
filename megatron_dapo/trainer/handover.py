"""The GPU changing hands between the rollout engine and the actor, twice per step.

Before the log-probs the engine sleeps (`rollout.sleep_level`) and the actor's offloaded state comes
back (`actor.offload_*`). After the update grads and optimizer state go to host memory, the engine's
weights wake, the new weights are pushed, the actor's params go to host memory, and only then does
the engine's KV cache wake: the KV cache never shares the GPU with the actor state that is
offloaded. Without offload the calls are the same (the offloader's are no-ops), so the trainer has
one code path.
"""

from __future__ import annotations

from contextlib import contextmanager, nullcontext
from typing import Any, Iterator, Optional

from megatron_dapo.actor.offload import ActorOffload, OffloadStats
from megatron_dapo.config import Config
from megatron_dapo.distributed.layout import ParallelLayout
from megatron_dapo.rollout.group import RolloutGroup
from megatron_dapo.rollout.sync.dispatch import SyncStats
from megatron_dapo.trainer.metrics import Phase


class GpuHandover:
    """Moves the GPU between `rollout` (the engine) and `actor` (through `offload`)."""

    def __init__(self, actor: Any, offload: ActorOffload, rollout: RolloutGroup, hf_config: Any, bucket_mb: float) -> None:
        self.actor, self.offload, self.rollout = actor, offload, rollout
        self.hf_config, self.bucket_mb = hf_config, bucket_mb

    def to_actor(self, timer=None) -> OffloadStats:
        """The engine sleeps, then the actor's offloaded state comes back. Returns the onload's figures."""
        self.rollout.sleep()
        with _phase(timer, Phase.ONLOAD, self.offload.enabled):
            return self.offload.onload()

    def to_engine(self, timer=None, *, push: bool = True) -> tuple[Optional[SyncStats], OffloadStats]:
        """After an update: grads + optimizer to host -> engine weights wake -> weight sync -> params to
        host -> engine KV cache wakes. Returns the sync's figures (None without `push`: the engine
        still holds the actor's current weights) and the offloads' figures."""
        with _phase(timer, Phase.OFFLOAD, self.offload.enabled):
            moved = self.offload.offload("grads", "optimizer")
        self.rollout.wake_up(["weights"])
        synced = None
        if push:
            with _phase(timer, Phase.SYNC):
                synced = self.rollout.sync_weights(self.actor.models, self.hf_config, self.bucket_mb)
        with _phase(timer, Phase.OFFLOAD, self.offload.enabled):
            moved += self.offload.offload("params")
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


def start_engine(
    cfg: Config, layout: ParallelLayout, actor: Any, offload: ActorOffload, hf_config: Any, device
) -> tuple[GpuHandover, SyncStats]:
    """Create the rollout engine beside the actor and push the actor's weights into it.

    The engine starts from the HF weights; after a resume (or from a Megatron checkpoint) the
    actor's differ, hence the push. With offload the engine starts on a GPU without the actor's
    state (vLLM sizes its pool from the free memory); the first push then follows every step's order.
    Returns the hand-over and the first push's figures."""
    offload.offload()
    rollout = RolloutGroup.create(cfg, layout, cfg.model.hf_dir, device)
    if offload.enabled:
        rollout.sleep()
        offload.onload("params")
    handover = GpuHandover(actor, offload, rollout, hf_config, cfg.rollout.weight_sync_bucket_mb)
    first_push, _ = handover.to_engine()
    return handover, first_push


def _phase(timer, name: str, timed: bool = True):
    """`timer.phase(name)`, or nothing when there is no timer (start-up, checkpoints) or nothing to time."""
    return timer.phase(name) if timer is not None and timed else nullcontext()
