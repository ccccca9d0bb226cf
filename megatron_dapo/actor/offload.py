"""Actor offload: the actor's accelerator state goes to host memory while the rollout engine generates.

    offload = ActorOffload(actor.models, actor.optimizer, kinds=("params", "grads", "optimizer"))
    offload.onload()                         # everything offloaded comes back (before the old log-probs)
    ... log-probs, update ...
    offload.offload("grads", "optimizer")    # after the update
    ... wake the engine's weights, weight sync (reads the params) ...
    offload.offload("params")                # before the engine's KV cache comes back
    stats.bytes, stats.seconds, stats.gb_per_s

What each kind moves (checked against megatron-core 0.16.1; the names are those of 0.17 too):

* "params": Megatron DDP's contiguous parameter buffer of each model chunk (``model.buffers`` and
  ``model.expert_parallel_buffers``, each a ``_ParamAndGradBuffer`` with ``param_data``; it exists
  with the distributed optimizer, and every ``param.data`` is a view into it). Without the
  distributed optimizer ``param_data`` is None and each parameter is its own tensor: moved one by one.
* "grads": the DDP gradient buffers (``grad_data``; ``param.main_grad`` and the buckets' views point
  into it). Their values are dead between updates (every update starts with ``zero_grad_buffer()``),
  so by default they are dropped, not copied: the device memory is freed and onload re-allocates it
  filled with zeros (``keep_grads=True`` copies them like the other kinds). On a 32B model at TP=8
  the fp32 grad buffer is 15 GiB per GPU: that much less pinned host memory and PCIe traffic.
* "optimizer": what the Megatron optimizer holds besides those, for each optimizer of a
  ``ChainedOptimizer``: the fp32 main parameters (``shard_fp32_from_float16_groups`` of the
  ``DistributedOptimizer``, ``fp32_from_float16_groups`` of ``Float16OptimizerWithFloat16Params``,
  i.e. the tensors in the inner ``optimizer.param_groups``), their ``.grad`` where it is a separate
  tensor, and every tensor of the inner optimizer's ``state`` (Adam's ``exp_avg`` / ``exp_avg_sq``).
  Only tensors on the actor's device move (torch's Adam keeps ``step`` on the CPU on a GPU).

How: whole storages move, no tensor object is replaced. Each storage is copied byte for byte into
a host buffer and then resized to 0 bytes (its accelerator memory is freed); onload re-allocates it
and copies the bytes back. Every view (parameters into ``param_data``, ``main_grad``, bucket views,
the distributed optimizer's shard views) and every Python reference (the optimizer's param groups
and state keys, DDP's hooks) stays valid, and the values come back bit for bit. A storage reachable
from several kinds belongs to the first of params, grads, optimizer (the distributed optimizer's
"main" shards of an fp32 model are views of the parameter buffer: they are params). Until onload,
touching an offloaded tensor is undefined (a segmentation fault on the CPU, an illegal address on a
GPU): the trainer's order (`trainer/handover.py`) keeps the actor untouched while it is away.

Host buffers: one per copied kind, allocated at the first offload and reused while the kind's storages
keep their sizes (Adam's state appears at the first optimizer step: the next offload of
"optimizer" allocates once more). On a GPU they are pinned, so copies run at PCIe speed; PyTorch's
pinned allocator rounds every allocation up to a power of two (``CachingHostAllocator``), so a
buffer is made of power-of-two chunks (``host_chunk_bytes`` each, the remainder in its binary
digits) and a storage may span several chunks: nothing is wasted but the 64-byte alignment of each
storage. On a CPU-only machine the same path runs with plain host tensors (copy, then free the
original storage), which is how the tests check the round trip.

Offloading a kind that is already offloaded, or onloading one that is resident, is a no-op; kinds
not enabled at construction are skipped, so the trainer's calls read the same whatever the config.
"""

from __future__ import annotations

import bisect
import time
from dataclasses import dataclass
from typing import Any, Iterable, Iterator, Optional, Sequence

import torch

__all__ = ["KINDS", "ActorOffload", "OffloadStats", "grad_storages", "optimizer_tensors", "param_storages"]

KINDS = ("params", "grads", "optimizer")
"""What can be offloaded, in priority order (a storage reachable from two kinds belongs to the first)."""

_ALIGN = 64
DEFAULT_HOST_CHUNK_BYTES = 1 << 28  # 256 MiB
_OPTIMIZER_GROUP_ATTRIBUTES = (
    "shard_fp32_from_float16_groups",  # DistributedOptimizer: fp32 main shards of bf16/fp16 params
    "shard_fp32_groups",  # DistributedOptimizer: views of fp32 params (params' storage)
    "fp32_from_float16_groups",  # Float16OptimizerWithFloat16Params: fp32 main params
    "fp32_from_fp32_groups",  # Float16OptimizerWithFloat16Params: the fp32 params themselves
)


@dataclass
class OffloadStats:
    """What one `offload` / `onload` call moved on this rank."""

    bytes: int = 0
    """Bytes copied between the device and host memory."""
    seconds: float = 0.0
    storages: int = 0
    dropped: int = 0
    """Gradient bytes freed without a copy (offload) or re-allocated as zeros (onload)."""

    @property
    def gb_per_s(self) -> float:
        """Throughput in GB/s (1e9 bytes per second); 0 when nothing moved."""
        return self.bytes / self.seconds / 1e9 if self.seconds > 0 and self.bytes else 0.0

    def __add__(self, other: "OffloadStats") -> "OffloadStats":
        return OffloadStats(
            self.bytes + other.bytes, self.seconds + other.seconds, self.storages + other.storages,
            self.dropped + other.dropped,
        )  # fmt: skip


# ---------------------------------------------------------------------------------------------
# Which storages belong to which kind
# ---------------------------------------------------------------------------------------------


def _ddp_buffers(model: torch.nn.Module) -> Optional[list]:
    """The `_ParamAndGradBuffer`s of a Megatron DDP chunk; None for a module without them.

    (DDP's ``buffers`` attribute is a list that shadows ``nn.Module.buffers``, a method.)
    """
    buffers = getattr(model, "buffers", None)
    if not isinstance(buffers, (list, tuple)):
        return None
    return list(buffers) + list(getattr(model, "expert_parallel_buffers", None) or [])


def _flatten(groups: Any) -> Iterator[torch.Tensor]:
    if isinstance(groups, torch.Tensor):
        yield groups
    elif isinstance(groups, (list, tuple)):
        for item in groups:
            yield from _flatten(item)


def _inner_optimizers(optimizer: Any) -> list:
    if optimizer is None:
        return []
    chained = getattr(optimizer, "chained_optimizers", None)
    return list(chained) if chained is not None else [optimizer]


def param_storages(models: Sequence[torch.nn.Module]) -> list[torch.Tensor]:
    """Tensors whose storages hold the weights: DDP ``param_data`` buffers, else each parameter."""
    tensors: list[torch.Tensor] = []
    for model in models:
        for buffer in _ddp_buffers(model) or []:
            if getattr(buffer, "param_data", None) is not None:
                tensors.append(buffer.param_data)
        tensors.extend(p.data for p in model.parameters())  # with a param_data buffer: views of it
    return tensors


def grad_storages(models: Sequence[torch.nn.Module]) -> list[torch.Tensor]:
    """Tensors whose storages hold the gradients: DDP ``grad_data`` buffers (and stray ``.grad``s)."""
    tensors: list[torch.Tensor] = []
    for model in models:
        for buffer in _ddp_buffers(model) or []:
            if getattr(buffer, "grad_data", None) is not None:
                tensors.append(buffer.grad_data)
        tensors.extend(p.grad for p in model.parameters() if p.grad is not None)
    return tensors


def optimizer_tensors(optimizer: Any) -> list[torch.Tensor]:
    """Every tensor a Megatron optimizer (or a ``ChainedOptimizer``) holds: main params, their
    gradients, the inner optimizer's state. Includes views of params and grads (removed by kind)."""
    tensors: list[torch.Tensor] = []
    for opt in _inner_optimizers(optimizer):
        for name in _OPTIMIZER_GROUP_ATTRIBUTES:
            tensors.extend(_flatten(getattr(opt, name, None)))
        inner = getattr(opt, "optimizer", opt)  # a Megatron optimizer wraps a torch one
        if inner is None:  # a stub optimizer of a rank without parameters
            continue
        for group in inner.param_groups:
            for p in group["params"]:
                tensors.append(p)
                if p.grad is not None:
                    tensors.append(p.grad)
        for state in inner.state.values():
            tensors.extend(v for v in state.values() if isinstance(v, torch.Tensor))
    return tensors


# ---------------------------------------------------------------------------------------------
# Host buffers
# ---------------------------------------------------------------------------------------------


def _chunk_sizes(total: int, chunk: int) -> list[int]:
    """Power-of-two chunk sizes that add up to `total` (a multiple of _ALIGN): full chunks, then the
    remainder's binary digits (PyTorch's pinned allocator would round one remainder chunk up)."""
    sizes = [chunk] * (total // chunk)
    rest = total % chunk
    bit = chunk >> 1
    while rest:
        if rest & bit:
            sizes.append(bit)
            rest -= bit
        bit >>= 1
    return sizes


class _HostBuffer:
    """`total` bytes of host memory as power-of-two chunks; byte ranges map onto chunk pieces."""

    def __init__(self, total: int, chunk: int, pin: bool) -> None:
        self.total = total
        self.chunks = [torch.empty(size, dtype=torch.uint8, pin_memory=pin) for size in _chunk_sizes(total, chunk)]
        self.starts = []
        start = 0
        for c in self.chunks:
            self.starts.append(start)
            start += c.numel()

    def pieces(self, offset: int, length: int) -> Iterator[tuple[torch.Tensor, int, int]]:
        """(host slice, start inside the range, length) covering ``[offset, offset + length)``."""
        done = 0
        index = bisect.bisect_right(self.starts, offset) - 1
        while done < length:
            chunk, chunk_start = self.chunks[index], self.starts[index]
            inside = offset + done - chunk_start
            n = min(length - done, chunk.numel() - inside)
            yield chunk[inside : inside + n], done, n
            done += n
            index += 1


def _bytes_of(storage: torch.UntypedStorage) -> torch.Tensor:
    """A flat uint8 tensor over the whole storage (a view, no copy)."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


def _aligned(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


class _Region:
    """One kind's storages while offloaded, and its (reused) host buffer."""

    def __init__(self) -> None:
        self.storages: list[torch.UntypedStorage] = []
        self.sizes: list[int] = []
        self.host: Optional[_HostBuffer] = None
        self.host_sizes: Optional[list[int]] = None
        self.offloaded = False

    @property
    def nbytes(self) -> int:
        return sum(self.sizes)


# ---------------------------------------------------------------------------------------------
# The offloader
# ---------------------------------------------------------------------------------------------


class ActorOffload:
    """Moves the enabled `kinds` of the actor's state between its device and host memory.

    ``models``: the actor's (DDP-wrapped) chunks; ``optimizer``: its Megatron optimizer (None for a
    model without one, e.g. the reference). ``pin_memory`` None pins exactly when CUDA is available.
    ``keep_grads``: copy the gradient buffers to host and back instead of dropping them (see above).
    """

    def __init__(
        self,
        models: Sequence[torch.nn.Module],
        optimizer: Any = None,
        kinds: Iterable[str] = KINDS,
        *,
        pin_memory: Optional[bool] = None,
        host_chunk_bytes: int = DEFAULT_HOST_CHUNK_BYTES,
        keep_grads: bool = False,
    ) -> None:
        kinds = tuple(kinds)
        _check_kinds(kinds)
        if host_chunk_bytes < _ALIGN or host_chunk_bytes & (host_chunk_bytes - 1):
            raise ValueError(f"host_chunk_bytes must be a power of two >= {_ALIGN}, got {host_chunk_bytes}")
        self.models = list(models)
        self.optimizer = optimizer
        self.kinds = tuple(k for k in KINDS if k in kinds)
        self.pin_memory = torch.cuda.is_available() if pin_memory is None else bool(pin_memory)
        self.host_chunk_bytes = host_chunk_bytes
        self.keep_grads = keep_grads
        params = [p for m in self.models for p in m.parameters()]
        self.device = params[0].device if params else torch.device("cpu")
        self._regions = {kind: _Region() for kind in KINDS}

    @classmethod
    def from_config(cls, actor: Any, actor_cfg: Any) -> "ActorOffload":
        """From a `MegatronActor` and the `actor` config section (offload_params / _grads / _optimizer)."""
        kinds = [k for k in KINDS if getattr(actor_cfg, f"offload_{k}")]
        return cls(actor.models, actor.optimizer, kinds)

    # ------------------------------------------------------------------ state

    @property
    def enabled(self) -> bool:
        return bool(self.kinds)

    @property
    def offloaded(self) -> tuple[str, ...]:
        """The kinds whose storages are in host memory now."""
        return tuple(k for k in KINDS if self._regions[k].offloaded)

    def host_bytes(self, kind: Optional[str] = None) -> int:
        """Bytes of the host buffers (one kind, or all): the host memory offload keeps allocated."""
        kinds = KINDS if kind is None else (kind,)
        return sum(self._regions[k].host.total for k in kinds if self._regions[k].host is not None)

    def storages(self, kind: str) -> list[torch.UntypedStorage]:
        """The storages of `kind` on the actor's device, each once, without those of earlier kinds."""
        _check_kinds((kind,))
        taken: set[int] = set()
        for earlier in KINDS[: KINDS.index(kind)]:
            taken.update(s._cdata for s in self._unique(self._tensors(earlier)))
        return [s for s in self._unique(self._tensors(kind)) if s._cdata not in taken]

    def _tensors(self, kind: str) -> list[torch.Tensor]:
        if kind == "params":
            return param_storages(self.models)
        if kind == "grads":
            return grad_storages(self.models)
        return optimizer_tensors(self.optimizer)

    def _unique(self, tensors: Iterable[torch.Tensor]) -> list[torch.UntypedStorage]:
        seen: dict[int, torch.UntypedStorage] = {}
        for tensor in tensors:
            if tensor.device != self.device:
                continue
            storage = tensor.untyped_storage()
            seen.setdefault(storage._cdata, storage)
        return list(seen.values())

    # ------------------------------------------------------------------ moves

    @torch.no_grad()
    def offload(self, *kinds: str) -> OffloadStats:
        """Move `kinds` (default: every enabled kind) to host memory; enabled, resident ones only."""
        kinds = kinds or self.kinds
        _check_kinds(kinds)
        started = time.perf_counter()
        stats = OffloadStats()
        # Collect every kind first: ownership (params > grads > optimizer) is decided while all are resident.
        todo = [k for k in KINDS if k in kinds and k in self.kinds and not self._regions[k].offloaded]
        plan = {kind: self.storages(kind) for kind in todo}
        for kind in todo:
            region, storages = self._regions[kind], plan[kind]
            for s in storages:
                if not s.resizable():
                    raise RuntimeError(f"cannot offload the actor's {kind}: a storage of {s.nbytes()} bytes is not resizable")
            zero = [s for s in storages if s.nbytes() == 0]
            if zero and kind != "optimizer":
                raise RuntimeError(
                    f"the actor's {kind} have {len(zero)} storage(s) of 0 bytes while resident: something else "
                    "freed them (e.g. Megatron's own offload_grad_buffers); offload them through ActorOffload only"
                )
            storages = [s for s in storages if s.nbytes() > 0]
            sizes = [s.nbytes() for s in storages]
            region.storages, region.sizes = storages, sizes
            if self._drops(kind):
                stats.dropped += sum(sizes)
                stats.storages += len(storages)
                continue
            if region.host is None or region.host_sizes != sizes:
                region.host = None  # free the old buffer before allocating the new one
                region.host = _HostBuffer(sum(_aligned(n) for n in sizes), self.host_chunk_bytes, self.pin_memory)
                region.host_sizes = sizes
            offset = 0
            for s, n in zip(storages, sizes):
                source = _bytes_of(s)
                for host, start, length in region.host.pieces(offset, n):
                    host.copy_(source[start : start + length], non_blocking=self.pin_memory)
                offset += _aligned(n)
            stats.bytes += sum(sizes)
            stats.storages += len(storages)
        self._synchronize()  # the copies have landed before the device memory goes
        for kind in todo:
            region = self._regions[kind]
            for s in region.storages:
                s.resize_(0)
            region.offloaded = True
        if todo and self.device.type == "cuda":
            torch.cuda.empty_cache()  # hand the memory back to the driver: the engine allocates outside torch's cache
        stats.seconds = time.perf_counter() - started
        return stats

    @torch.no_grad()
    def onload(self, *kinds: str) -> OffloadStats:
        """Bring `kinds` (default: everything offloaded) back to the device, bit for bit (dropped grads: zeros)."""
        kinds = kinds or KINDS
        _check_kinds(kinds)
        started = time.perf_counter()
        stats = OffloadStats()
        for kind in KINDS:
            region = self._regions[kind]
            if kind not in kinds or not region.offloaded:
                continue
            offset = 0
            for s, n in zip(region.storages, region.sizes):
                s.resize_(n)
                target = _bytes_of(s)
                if self._drops(kind):
                    target.zero_()  # what zero_grad_buffer() would write before the next backward
                    continue
                for host, start, length in region.host.pieces(offset, n):
                    target[start : start + length].copy_(host, non_blocking=self.pin_memory)
                offset += _aligned(n)
            if self._drops(kind):
                stats.dropped += region.nbytes
            else:
                stats.bytes += region.nbytes
            stats.storages += len(region.storages)
            region.storages, region.offloaded = [], False
            # region.sizes stays: the host buffer's layout, reused by the next offload of the same storages
        self._synchronize()
        stats.seconds = time.perf_counter() - started
        return stats

    def _drops(self, kind: str) -> bool:
        return kind == "grads" and not self.keep_grads

    def _synchronize(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)


def _check_kinds(kinds: Iterable[str]) -> None:
    unknown = [k for k in kinds if k not in KINDS]
    if unknown:
        raise ValueError(f"unknown offload kind(s) {unknown}: choose from {', '.join(KINDS)}")
