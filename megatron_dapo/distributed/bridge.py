"""The separate placement's link between the trainer and the engines' ranks.

With `rollout.placement=separate` a launch of W processes holds two worlds, made from the one
rendezvous store of the launch (torchrun's or the SLURM master's) under different key prefixes
(`split_worlds`):

* the trainer's ranks, launch ranks [0, T): the default process group that Megatron sees (its world
  size is T, so every size of the actor's layout reads as in a colocated run of T processes);
* the rollout ranks, launch ranks [T, W) (`rollout.num_gpus`): a default group of their own.

The bridge joins the trainer's *head* (launch rank 0: after the weight export it holds every full
tensor, and it hands the samples on to the other trainer ranks) to the engines' *owners* (the first
rank of each group of rollout.tp rollout ranks, `ParallelLayout.engine_leaders`). Bridge rank 0 is
the head, bridge rank i the i-th owner. It has three process groups of its own, made directly from
the store (outside torch.distributed's default world, so the two worlds never wait for each other
in a collective):

* messages (gloo): pickled point-to-point messages (`send` / `recv`) on two channels: the work
  (requests to the engines, their results back) and the replies to weight pushes, which overtake
  results still on their way; a rank may wait here for long (a generation batch), so its timeout
  is `rollout.gather_timeout_s`;
* meta (gloo): the names, shapes and dtypes of each weight bucket, broadcast from the head;
* weights: the buckets' bytes, broadcast from the head, one flat buffer per dtype: NCCL on GPUs
  (the buckets never leave the devices), gloo on the CPU (`weights_backend`).

Only members construct the groups (the store's rendezvous counts them); every other rank has no
bridge (None).
"""

from __future__ import annotations

import datetime
import pickle
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import torch
import torch.distributed as dist

__all__ = ["CHANNELS", "Bridge", "BucketMeta", "PendingSend", "bridge_members", "split_worlds", "weights_backend"]

CHANNELS = {"work": 7, "replies": 8}
"""Message channels (gloo tags): the requests and their results, and the replies to weight pushes,
which pass results still on their way (each channel keeps its own order)."""
_PREFIX = "mdapo_bridge/"


def weights_backend(device_type: str) -> str:
    """The weight broadcast's backend: NCCL between GPUs, gloo between CPU processes."""
    return "nccl" if device_type == "cuda" else "gloo"


def bridge_members(layout: Any) -> list[int]:
    """Launch ranks of the bridge, in bridge-rank order: the trainer's head, then every engine owner."""
    return [0, *layout.engine_leaders()]


def split_worlds(store: Any, layout: Any, launch_rank: int) -> tuple[Any, int, int]:
    """(store, rank, world size) of this rank's own world in the separate placement: the trainer's
    ranks [0, T) or the rollout ranks [T, W), each under a prefix of the launch's store. Pure."""
    trainer_world = layout.world_size
    if launch_rank < trainer_world:
        return dist.PrefixStore("mdapo_trainer/", store), launch_rank, trainer_world
    return dist.PrefixStore("mdapo_rollout/", store), launch_rank - trainer_world, layout.rollout_ranks


@dataclass(frozen=True)
class BucketMeta:
    """One weight bucket as the head announces it: (name, shape, dtype) per tensor, in order."""

    entries: tuple[tuple[str, tuple[int, ...], torch.dtype], ...]

    @classmethod
    def of(cls, bucket: Sequence[tuple[str, torch.Tensor]]) -> "BucketMeta":
        return cls(tuple((name, tuple(t.shape), t.dtype) for name, t in bucket))

    def dtypes(self) -> list[torch.dtype]:
        """The bucket's dtypes in first-seen order: one flat buffer (one broadcast) each."""
        seen: list[torch.dtype] = []
        for _, _, dtype in self.entries:
            if dtype not in seen:
                seen.append(dtype)
        return seen

    def numel(self, dtype: torch.dtype) -> int:
        return sum(_numel(shape) for _, shape, d in self.entries if d == dtype)


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


class PendingSend:
    """A message on its way (`Bridge.send(..., wait=False)`): holds its buffers until it arrived."""

    def __init__(self, works: list, buffers: tuple) -> None:
        self._works, self._buffers = works, buffers

    def done(self) -> bool:
        return all(work.is_completed() for work in self._works)

    def wait(self) -> None:
        for work in self._works:
            work.wait()
        self._buffers = ()


class Bridge:
    """This rank's end of the bridge (see the module doc); `connect` makes it on the members."""

    def __init__(self, messages: Any, meta: Any, weights: Any, rank: int, size: int, device: torch.device) -> None:
        self._messages, self._meta, self._weights = messages, meta, weights
        self.rank, self.size, self.device = rank, size, device

    @classmethod
    def connect(
        cls, store: Any, members: Sequence[int], launch_rank: int, device: torch.device, timeout_s: float
    ) -> Optional["Bridge"]:
        """The bridge of `members` (launch ranks, head first) on a member, None elsewhere. Every member
        calls it at start-up (each group's construction waits for all of them in the store)."""
        if launch_rank not in members:
            return None
        rank, size = list(members).index(launch_rank), len(members)
        timeout = datetime.timedelta(seconds=float(timeout_s))
        store = dist.PrefixStore(_PREFIX, store)
        messages = dist.ProcessGroupGloo(dist.PrefixStore("messages/", store), rank, size, timeout)
        meta = dist.ProcessGroupGloo(dist.PrefixStore("meta/", store), rank, size, timeout)
        if weights_backend(device.type) == "nccl":
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = timeout
            weights = dist.ProcessGroupNCCL(dist.PrefixStore("weights/", store), rank, size, options)
        else:
            weights = dist.ProcessGroupGloo(dist.PrefixStore("weights/", store), rank, size, timeout)
        return cls(messages, meta, weights, rank, size, device)

    @property
    def is_head(self) -> bool:
        return self.rank == 0

    # ------------------------------------------------------------------ messages

    def send(self, message: Any, to: int, wait: bool = True, channel: str = "work") -> Optional["PendingSend"]:
        """Send a picklable `message` to bridge rank `to` on `channel` (`CHANNELS`). `wait`: return
        once the receiver has it; else at once, with the `PendingSend` to wait for (messages to one
        rank on one channel arrive in order)."""
        tag = CHANNELS[channel]
        payload = torch.frombuffer(bytearray(pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)), dtype=torch.uint8)
        size = torch.tensor([payload.numel()], dtype=torch.int64)
        works = [self._messages.send([size], to, tag), self._messages.send([payload], to, tag)]
        pending = PendingSend(works, (size, payload))
        if wait:
            pending.wait()
            return None
        return pending

    def recv(self, source: int, channel: str = "work") -> Any:
        """The next message from bridge rank `source` on `channel` (waits up to the bridge's timeout)."""
        tag = CHANNELS[channel]
        size = torch.empty(1, dtype=torch.int64)
        self._messages.recv([size], source, tag).wait()
        payload = torch.empty(int(size.item()), dtype=torch.uint8)
        self._messages.recv([payload], source, tag).wait()
        return pickle.loads(payload.numpy().tobytes())

    # ------------------------------------------------------------------ weights

    def broadcast_bucket(self, bucket: Optional[Sequence[tuple[str, torch.Tensor]]]) -> Optional[list[tuple[str, torch.Tensor]]]:
        """Head: send one bucket of (name, tensor) to every engine owner (`bucket` None ends the push).
        Owner: receive the next one (None at the end of the push), on this rank's device; the
        tensors are views of one flat buffer per dtype."""
        box = [BucketMeta.of(bucket) if bucket is not None else None] if self.is_head else [None]
        box = self._broadcast_object(box[0])
        if box is None:
            return None
        meta: BucketMeta = box
        received: dict[str, torch.Tensor] = {}
        for dtype in meta.dtypes():
            if self.is_head:
                flat = torch.cat([t.detach().reshape(-1) for _, t in bucket if t.dtype == dtype]).to(self.device)
            else:
                flat = torch.empty(meta.numel(dtype), dtype=dtype, device=self.device)
            self._broadcast(self._weights, flat)
            if not self.is_head:
                offset = 0
                for name, shape, d in meta.entries:
                    if d == dtype:
                        n = _numel(shape)
                        received[name] = flat[offset : offset + n].view(shape)
                        offset += n
        if self.is_head:
            return list(bucket)
        return [(name, received[name]) for name, _, _ in meta.entries]

    def _broadcast_object(self, value: Any) -> Any:
        if self.is_head:
            data = torch.frombuffer(bytearray(pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)), dtype=torch.uint8)
            size = torch.tensor([data.numel()], dtype=torch.int64)
        else:
            size = torch.empty(1, dtype=torch.int64)
        self._broadcast(self._meta, size)
        if not self.is_head:
            data = torch.empty(int(size.item()), dtype=torch.uint8)
        self._broadcast(self._meta, data)
        return value if self.is_head else pickle.loads(data.numpy().tobytes())

    @staticmethod
    def _broadcast(group: Any, tensor: torch.Tensor) -> None:
        options = dist.BroadcastOptions()
        options.rootRank, options.rootTensor = 0, 0
        group.broadcast([tensor], options).wait()
