"""Small collectives over Python objects for the driver loop (rollout results, flags, stats).

The rollout engine of each data-parallel replica lives on the replica's first rank (its
model-parallel "leader": TP rank 0, PP rank 0, CP rank 0). What it produces - responses, rewards,
validation scores - is small next to the model and moves as pickled objects. Every helper is a
collective over the whole world (or the named group) so that every rank takes the same decision
from the same values (DESIGN.md: "same decision on every rank"); each inherits the process-group
timeout set by `init_distributed`, so a rank that never arrives fails the job instead of hanging.

Gathers that follow independent generation (`gather_from_leaders`, `tensor_gather`) meet on the
gather group (`meeting_group()`: gloo, `rollout.gather_timeout_s`) instead: there a rank may wait
for another replica's engine far longer than `trainer.collective_timeout_s`. They first wait for
every rank's arrival in the job's store (`liveness.await_ranks`): a rank that is gone ends that wait
within the liveness window, not after the gather group's timeout. `any_rank` stays on
the default group; call it where ranks are in step (right after such a gather), never as the first
collective after generating.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps

from megatron_dapo.distributed import liveness
from megatron_dapo.distributed.setup import gather_group, process_role


def _initialised() -> bool:
    return dist.is_available() and dist.is_initialized()


def data_parallel_rank_and_size() -> tuple[int, int]:
    """This rank's data-parallel replica and the number of replicas (0, 1 without Megatron state)."""
    if not ps.model_parallel_is_initialized():
        return 0, 1
    return ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()


def is_replica_leader() -> bool:
    """True on the first rank of this data-parallel replica's model-parallel group (TP x PP x CP)."""
    if not ps.model_parallel_is_initialized():
        return True
    return (
        ps.get_tensor_model_parallel_rank() == 0
        and ps.get_pipeline_model_parallel_rank() == 0
        and ps.get_context_parallel_rank() == 0
    )


def is_logging_rank() -> bool:
    """The trainer's rank 0 (launch rank 0): the one process that prints tables, writes metrics and
    plots (the separate placement's rollout ranks have a rank 0 of their own world: not this one)."""
    return not _initialised() or (dist.get_rank() == 0 and process_role() == "trainer")


def meeting_group(explicit: Optional[Any] = None) -> Optional[Any]:
    """The group where ranks meet after generating independently: `explicit` if given, else the gather
    group of `init_distributed` (gloo, `rollout.gather_timeout_s`), else None (the default group,
    where torch.distributed was set up without `init_distributed`)."""
    if explicit is not None:
        return explicit

    return gather_group()


def await_everyone(what: str, meet_on: Optional[Any] = None) -> None:
    """Before a collective on the gather group: wait until every rank has arrived, or fail as soon as
    one stops beating (`liveness.await_ranks`). Nothing when the meeting is on an `explicit` group
    (`meeting_group`) or without a beat (torch.distributed not set up by `init_distributed`)."""
    if meet_on is None and _initialised():
        liveness.await_ranks(range(dist.get_world_size()), liveness.GATHER, what=what)


def gather_from_leaders(payload: Any, meet_on: Optional[Any] = None) -> list[Any]:
    """Every rank gets the leaders' payloads ordered by data-parallel rank (world collective).

    Non-leaders pass anything (it is ignored: they send None). Pickles travel on the gather group
    (`meeting_group`), so leaders that finish their work minutes apart do not trip the default timeout.
    """
    dp_rank, dp_size = data_parallel_rank_and_size()
    mine = (dp_rank, payload) if is_replica_leader() else None
    if not _initialised():
        return [payload]
    await_everyone("gathering the replica leaders' results", meet_on)
    gathered: list[Optional[tuple[int, Any]]] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine, group=meeting_group(meet_on))
    by_replica = {entry[0]: entry[1] for entry in gathered if entry is not None}
    if sorted(by_replica) != list(range(dp_size)):
        raise RuntimeError(f"expected one payload per data-parallel replica 0..{dp_size - 1}, got {sorted(by_replica)}")
    return [by_replica[r] for r in range(dp_size)]


def any_rank(flag: bool) -> bool:
    """True on every rank when `flag` is True on at least one (e.g. a SIGTERM seen by one process)."""
    if not _initialised():
        return bool(flag)
    value = torch.tensor([1 if flag else 0], dtype=torch.int32, device=_collective_device())
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return bool(value.item())


def broadcast_object(value: Any, src: int = 0, group: Optional[dist.ProcessGroup] = None) -> Any:
    """`value` of global rank `src`, on every rank (of `group`, which must contain `src`)."""
    if not _initialised():
        return value
    box = [value if dist.get_rank() == src else None]
    dist.broadcast_object_list(box, src=src, group=group)
    return box[0]


def gather_objects(value: Any, group: Optional[dist.ProcessGroup] = None) -> list[Any]:
    """Every rank's `value`, in group-rank order, on every rank of `group` (one process: [value])."""
    if not _initialised():
        return [value]
    values: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(values, value, group=group)
    return values


def _collective_device() -> torch.device:
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
