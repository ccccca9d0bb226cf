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

* messages (gloo): pickled point-to-point messages (`send` / `recv`) on the channels of
  `CHANNELS`: the work (requests to the engines, their results back) and the replies to weight
  pushes, which overtake results still on their way; a rank may wait here for long (a generation
  batch), so its timeout is `rollout.gather_timeout_s`;
* listened (gloo): partial rollouts' messages from the head to each owner, received there by a
  thread of their own (`listen`): a group apart, so that thread never shares one with the owner's
  other traffic;
* meta (gloo): the names, shapes and dtypes of each weight bucket, broadcast from the head;
* weights: the buckets' bytes, broadcast from the head, one flat buffer per dtype: NCCL on GPUs
  (the buckets never leave the devices), gloo on the CPU (`weights_backend`).

Only members construct the groups (the store's rendezvous counts them); every other rank has no
bridge (None).
"""

from __future__ import annotations

import datetime
import pickle
import threading
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

import torch
import torch.distributed as dist

__all__ = ["CHANNELS", "Bridge", "BucketMeta", "Listener", "PendingSend", "bridge_members", "split_worlds", "weights_backend"]

CHANNELS = {"work": 7, "replies": 8, "listened": 9}
"""Message channels (gloo tags): the requests and their results; the replies to weight pushes,
which pass results still on their way; and "listened", partial rollouts' channel from the head to an
owner (requests and pushes in one order), which a thread of the owner receives as messages arrive
(`Listener`), so that the engine sees a push between two decode steps. Each keeps its own order."""
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


def _receive(group: Any, source: int, tag: int) -> Any:
    size = torch.empty(1, dtype=torch.int64)
    group.recv([size], source, tag).wait()
    payload = torch.empty(int(size.item()), dtype=torch.uint8)
    group.recv([payload], source, tag).wait()
    return pickle.loads(payload.numpy().tobytes())


class Listener:
    """The messages of one channel from one rank, received by a daemon thread as they arrive and
    kept in order until taken (`Bridge.listen`): an owner that generates can look for a weight push
    between two decode steps without waiting (gloo's receives complete only by waiting on them)."""

    def __init__(self, group: Any, source: int, tag: int, last: Callable[[Any], bool]) -> None:
        self._arrived: deque = deque()
        self._changed = threading.Condition()
        self._failure: Optional[BaseException] = None
        self._done = False
        self._thread = threading.Thread(target=self._run, args=(group, source, tag, last), name="mdapo-bridge-listener", daemon=True)
        self._thread.start()

    def _run(self, group: Any, source: int, tag: int, last: Callable[[Any], bool]) -> None:
        try:
            while True:
                message = _receive(group, source, tag)
                with self._changed:
                    self._arrived.append(message)
                    self._changed.notify_all()
                if last(message):
                    break
        except BaseException as error:  # noqa: BLE001 - the owner's thread raises it at its next look
            with self._changed:
                self._failure = error
        finally:
            with self._changed:
                self._done = True
                self._changed.notify_all()

    def take(self, kind: Optional[type] = None, block: bool = True) -> Any:
        """The first message received and not taken yet (of type `kind`, if given, ahead of the others).
        `block`: wait for one; else None when there is none. Raises what ended the receiving thread."""
        with self._changed:
            while True:
                for index, message in enumerate(self._arrived):
                    if kind is None or isinstance(message, kind):
                        del self._arrived[index]
                        return message
                if self._failure is not None:
                    raise RuntimeError("the bridge's listener stopped receiving") from self._failure
                if not block:
                    return None
                if self._done:
                    raise RuntimeError("the bridge's listener received its last message: nothing more comes")
                self._changed.wait()

    def join(self) -> None:
        """Wait for the receiving thread to end (after the last message)."""
        self._thread.join()


class Bridge:
    """This rank's end of the bridge (see the module doc); `connect` makes it on the members."""

    def __init__(self, messages: Any, meta: Any, weights: Any, rank: int, size: int, device: torch.device) -> None:
        self._messages, self._meta, self._weights = messages, meta, weights
        self.rank, self.size, self.device = rank, size, device
        self._listened: Any = None  # its own group: set by `connect`

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
        bridge = cls(messages, meta, weights, rank, size, device)
        bridge._listened = dist.ProcessGroupGloo(dist.PrefixStore("listened/", store), rank, size, timeout)
        return bridge

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
        group = self._group(channel)
        works = [group.send([size], to, tag), group.send([payload], to, tag)]
        pending = PendingSend(works, (size, payload))
        if wait:
            pending.wait()
            return None
        return pending

    def recv(self, source: int, channel: str = "work") -> Any:
        """The next message from bridge rank `source` on `channel` (waits up to the bridge's timeout)."""
        if channel == "listened":
            raise ValueError("the listened channel is received by a Listener (`listen`)")
        return _receive(self._messages, source, CHANNELS[channel])

    def listen(self, source: int, last: Callable[[Any], bool]) -> "Listener":
        """Receive the listened channel from `source` on a thread of its own until a message for
        which `last(message)` is true (`Listener`)."""
        return Listener(self._listened, source, CHANNELS["listened"], last)

    def _group(self, channel: str) -> Any:
        return self._listened if channel == "listened" else self._messages

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
