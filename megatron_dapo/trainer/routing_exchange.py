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
3. the store is emptied: routing of groups dynamic sampling dropped is never sent anywhere; an
   asynchronous run keeps the routing of the groups it carries over to the next step
   (`RoutingStore.retain`) and saves it with its checkpoint (`trainer.async_state`).

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
"""(owner's global rank, key in the owner's `RoutingStore`) of one sample's routing."""


@dataclass
class RoutingStore:
    """The routing of this rank's own generations, kept until the train batch is chosen.

    Keys count up over the run and are never reused, so a reference kept across steps (a group
    carried over by asynchronous training) never points at another sample's routing."""

    kept: dict[int, torch.Tensor] = field(default_factory=dict)
    _next_key: int = 0

    def keep(self, owner: int, routings: Sequence[torch.Tensor]) -> list[RoutingRef]:
        """Hold `routings` (host tensors); returns their references for the shared samples."""
        refs = []
        for routing in routings:
            self.kept[self._next_key] = routing.cpu()
            refs.append((owner, self._next_key))
            self._next_key += 1
        return refs

    def retain(self, owner: int, refs: Sequence[RoutingRef]) -> None:
        """Keep only the routing of `refs` owned here (`owner`, this rank): the groups a step carries
        over; the rest (trained, or dropped by dynamic sampling) is let go."""
        wanted = {key for who, key in refs if who == owner}
        self.kept = {key: routing for key, routing in self.kept.items() if key in wanted}

    def export(self, owner: int, refs: Sequence[RoutingRef]) -> dict[int, torch.Tensor]:
        """{key: routing} of the `refs` owned here (saved with an asynchronous run's checkpoint)."""
        mine = [key for who, key in refs if who == owner]
        missing = [key for key in mine if key not in self.kept]
        if missing:
            raise KeyError(f"routing {missing[:5]} of rank {owner} is not in its store: it was let go before it was trained")
        return {key: self.kept[key] for key in mine}

    def adopt(self, entries: dict[int, torch.Tensor]) -> None:
        """Put back `export`ed routing under its keys (a resumed run); new keys follow them."""
        clash = sorted(set(entries) & set(self.kept))
        if clash:
            raise RuntimeError(f"routing keys {clash[:5]} are in the store already: adopt into a fresh store")
        self.kept.update({int(key): routing.cpu() for key, routing in entries.items()})
        self._next_key = max([self._next_key, *(int(key) + 1 for key in entries)])

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.kept.values())


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
