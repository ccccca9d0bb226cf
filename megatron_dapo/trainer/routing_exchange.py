"""MoE routing delivered to the data-parallel replica that trains on it, and to nobody else.

The engine's routing of a sample (``[tokens read, MoE layers, top-k]``, `actor.routing`) is needed
by the ranks of the one replica whose share of the train batch holds that sample: every rank of the
replica (each pipeline stage replays its own layers, context- and sequence-parallel ranks their
own tokens). Gathered to every rank like the token ids, one generation batch of the Qwen3-30B-A3B
recipe is ~200 GiB of routing per GPU even at one byte an entry (`megatron-dapo plan`), so:

1. the contributor of a generation keeps its samples' routing in a `RoutingStore` (host memory),
   and `gather_samples` shares only where each lives: ``routing_ref`` = (owner rank, index);
2. once the train batch is chosen (dynamic sampling needs every group first), `fetch_routing`
   moves each needed routing from its owner straight to the ranks of its replica, point to point
   over the gloo gather group (host memory, never a GPU); a rank receives exactly its own rows;
3. the store is emptied: routing of groups dynamic sampling dropped is never sent anywhere.

`plan_transfers` is the pure part (who sends which samples to whom), tested on its own; the
multi-process test runs `fetch_routing` with real gloo groups.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch
import torch.distributed as dist

__all__ = ["RoutingRef", "RoutingStore", "fetch_routing", "plan_transfers"]

RoutingRef = tuple[int, int]
"""(owner's global rank, index in the owner's `RoutingStore`) of one sample's routing."""


@dataclass
class RoutingStore:
    """The routing of this rank's own generations, kept until the train batch is chosen."""

    kept: list[torch.Tensor] = field(default_factory=list)

    def keep(self, owner: int, routings: Sequence[torch.Tensor]) -> list[RoutingRef]:
        """Hold `routings` (host tensors); returns their references for the shared samples."""
        start = len(self.kept)
        self.kept.extend(routing.cpu() for routing in routings)
        return [(owner, start + i) for i in range(len(routings))]

    def clear(self) -> None:
        self.kept = []

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.kept)


def plan_transfers(refs: Sequence[RoutingRef], needed_by: Sequence[Sequence[int]]) -> dict[tuple[int, int], list[int]]:
    """{(owner rank, destination rank): positions (in `refs` order) of the samples owner sends to it}.

    `refs[i]` is where sample i's routing lives, `needed_by[i]` the ranks that need it. Pure; every
    rank computes the same plan, so each knows what it sends and what it receives (and its size)."""
    if len(refs) != len(needed_by):
        raise ValueError(f"{len(refs)} routing references for {len(needed_by)} samples")
    plan: dict[tuple[int, int], list[int]] = {}
    for position, ((owner, _), ranks) in enumerate(zip(refs, needed_by)):
        for rank in ranks:
            plan.setdefault((owner, rank), []).append(position)
    return plan


def fetch_routing(
    refs: Sequence[RoutingRef],
    needed_by: Sequence[Sequence[int]],
    read_lengths: Sequence[int],
    entry_shape: Sequence[int],
    dtype: torch.dtype,
    store: RoutingStore,
    group: Optional[object] = None,
) -> dict[int, torch.Tensor]:
    """{sample position: routing} of the samples this rank needs (a collective over `group`'s ranks).

    Every rank calls it with the same `refs`, `needed_by` and `read_lengths` (the tokens each sample's
    model reads: its routing is ``[read_lengths[i], *entry_shape]`` of `dtype`). Each owner sends one
    buffer per destination (its samples for that rank, in sample order); each rank receives one per
    owner. Host tensors over a gloo group (the gather group at run time)."""
    me = dist.get_rank() if dist.is_initialized() else 0
    per_token = 1
    for size in entry_shape:
        per_token *= int(size)
    entries = [int(n) * per_token for n in read_lengths]
    plan = plan_transfers(refs, needed_by)
    received: dict[int, torch.Tensor] = {}
    requests, inbox = [], []
    for (owner, destination), positions in sorted(plan.items()):
        if owner == me and destination == me:
            for position in positions:
                received[position] = store.kept[refs[position][1]]
        elif owner == me:
            buffer = torch.cat([store.kept[refs[p][1]].reshape(-1) for p in positions])
            requests.append(dist.isend(buffer.contiguous(), dst=destination, group=group))
            inbox.append((None, buffer))  # kept alive until the send completes
        elif destination == me:
            buffer = torch.empty(sum(entries[p] for p in positions), dtype=dtype)
            requests.append(dist.irecv(buffer, src=owner, group=group))
            inbox.append((positions, buffer))
    for request in requests:
        request.wait()
    for positions, buffer in inbox:
        if positions is None:
            continue
        for position, part in zip(positions, torch.split(buffer, [entries[p] for p in positions])):
            received[position] = part.view(read_lengths[position], *entry_shape)
    return received
