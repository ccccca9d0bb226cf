"""The rules of asynchronous training (`trainer.max_staleness`), as pure functions of counts.

Versions count updates: the weights after v updates are version v, the starting weights version 0;
step t trains from version t - 1 and pushes version t. A sample generated with version v and
trained at step t is t - 1 - v versions stale. With `max_staleness` k:

* a sample may be trained at step t only if its version is at least `oldest_version(t, k)`; older
  groups are dropped and counted (`DynamicSamplingBuffer.drop_stale` / `note_stale`);
* the trainer hands the engines, before each update, the generation batches the next k steps will
  need beyond the groups carried over (`batches_ahead`): generated with the weights the step
  starts from, they are at most k versions stale where they are meant to be used, and the engines
  never run further ahead than that (generation waits instead of producing what would be too old).

k = 0 is the synchronous loop: nothing is handed out ahead, nothing is ever stale.
"""

from __future__ import annotations

import math

__all__ = ["batches_ahead", "oldest_version", "staleness"]


def oldest_version(step: int, max_staleness: int) -> int:
    """The oldest weight version step `step` may train on."""
    return step - 1 - max_staleness


def staleness(step: int, version: int) -> int:
    """How many versions older than step `step`'s own weights (version step - 1) `version` is."""
    return step - 1 - version


def batches_ahead(max_staleness: int, train_batch_size: int, carried_groups: int, kept_per_batch: float, in_flight: int) -> int:
    """How many generation batches to hand out now, before the update, for the next `max_staleness`
    steps: enough for max_staleness train batches of `train_batch_size` groups beyond the
    `carried_groups` already kept, at `kept_per_batch` groups a batch (the run's estimate), less the
    `in_flight` batches handed out already. 0 with max_staleness 0."""
    if max_staleness < 0 or train_batch_size < 1 or carried_groups < 0 or in_flight < 0:
        raise ValueError("max_staleness, carried_groups and in_flight must be >= 0 and train_batch_size >= 1")
    if max_staleness == 0:
        return 0
    if not kept_per_batch > 0:
        raise ValueError(f"kept_per_batch must be > 0, got {kept_per_batch}")
    needed = max_staleness * train_batch_size - carried_groups
    wanted = math.ceil(max(0, needed) / kept_per_batch)
    return max(0, wanted - in_flight)
