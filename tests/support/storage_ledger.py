"""Count the tensor memory a piece of code allocates: bytes of new storages, and the peak still alive.

    with StorageLedger() as ledger:
        with ledger.paused():              # not counted (e.g. the export's transforms, the engine's loader)
            ...
        sync(...)
    ledger.allocated_bytes, ledger.peak_live_bytes, ledger.top_ops()

    with weight_path_ledger() as ledger:   # the export and vLLM's own loading paused
        sync_weights(...)

A `TorchDispatchMode` sees every ATen operation of this thread while it is active. An operation's
output is a new allocation when it is not a view or an in-place/out= result (its storage is none of
the inputs'); its bytes are the storage's. A weak reference to each storage (not to the tensor:
views made later, anywhere, keep the storage alive) says when it is freed, so the live total is
exact at every operation and the peak is taken where allocations happen. Tensors whose memory is
not torch's (a memory-mapped file: `torch.frombuffer`) are not allocations and are not counted.

Used by the weight-push memory test (tests/rollout/sync/test_push_memory.py and its worker) and
benchmark (benchmarks/bench_push_memory.py) only, hence here and not in the package: on a CPU
machine the "device" is host memory, so the weight path is measured by what it allocates between
the actor's export and the engine's loader (both paused), whatever the device: a model-sized total
there means a full copy per sync.
"""

from __future__ import annotations

import collections
import contextlib
import functools
from typing import Any, Callable, Iterable, Iterator

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from megatron_dapo.model import load
from megatron_dapo.rollout.engines.vllm.worker import VLLMWorkerExtension
from megatron_dapo.rollout.sync import shards

__all__ = ["StorageLedger", "weight_path_ledger"]


def _storage_key(tensor: torch.Tensor):
    """(data pointer, bytes) of a tensor's storage; None for tensors without torch-owned memory."""
    if tensor.device.type == "meta":
        return None
    try:
        storage = tensor.untyped_storage()
    except (RuntimeError, NotImplementedError):  # wrapper subclasses hold no storage of their own
        return None
    return storage.data_ptr(), storage.nbytes()


class StorageLedger(TorchDispatchMode):
    """Bytes of tensor storages created while active (see the module doc); this thread only."""

    def __init__(self) -> None:
        super().__init__()
        self.allocated_bytes = 0
        """Sum of the bytes of every storage created (freed ones included)."""
        self.allocations = 0
        self.peak_live_bytes = 0
        """Largest total of storages created here and alive at the same time."""
        self.live_bytes = 0
        self.by_op: collections.Counter = collections.Counter()
        self._live: list[tuple[StorageWeakRef, int]] = []
        self._paused = 0

    # ---- scope -----------------------------------------------------------------------------------

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Allocations inside are not counted (their frees do not matter: they were never counted)."""
        self._paused += 1
        try:
            yield
        finally:
            self._paused -= 1

    def paused_iter(self, items: Iterable[Any]) -> Iterator[Any]:
        """`items`, each produced with the ledger paused (a generator's work is not counted)."""
        iterator = iter(items)
        while True:
            with self.paused():
                try:
                    item = next(iterator)
                except StopIteration:
                    return
            yield item

    def paused_call(self, fn: Callable) -> Callable:
        """`fn` wrapped so that its own allocations are not counted."""

        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            with self.paused():
                return fn(*args, **kwargs)

        return wrapper

    @contextlib.contextmanager
    def pausing(self, owner: Any, name: str, returns_iterator: bool = False) -> Iterator[None]:
        """Within the block, the function `owner.<name>` runs paused (and the iterator it returns
        produces its items paused). Restored afterwards."""
        original = getattr(owner, name)
        if returns_iterator:
            wrapped = functools.wraps(original)(lambda *args, **kwargs: self.paused_iter(original(*args, **kwargs)))
        else:
            wrapped = self.paused_call(original)
        setattr(owner, name, wrapped)
        try:
            yield
        finally:
            setattr(owner, name, original)

    def top_ops(self, count: int = 5) -> list[tuple[str, int]]:
        """The operations that allocated the most bytes: [(op name, bytes)]."""
        return self.by_op.most_common(count)

    # ---- accounting ------------------------------------------------------------------------------

    def _prune(self) -> None:
        if any(ref.expired() for ref, _ in self._live):
            kept = [(ref, size) for ref, size in self._live if not ref.expired()]
            self.live_bytes = sum(size for _, size in kept)
            self._live = kept

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        result = func(*args, **(kwargs or {}))
        if self._paused:
            return result
        self._prune()
        if func.is_view or any(ret.alias_info is not None for ret in func._schema.returns):
            return result  # views and in-place / out= results share an input's storage
        inputs = {key[0] for key in map(_storage_key, _tensors(args, kwargs)) if key is not None}
        for tensor in _tensors(result):
            key = _storage_key(tensor)
            if key is None or key[1] == 0 or key[0] in inputs:
                continue
            inputs.add(key[0])  # two outputs on one storage count once
            self.allocated_bytes += key[1]
            self.allocations += 1
            self.by_op[str(func)] += key[1]
            self._live.append((StorageWeakRef(tensor.untyped_storage()), key[1]))
            self.live_bytes += key[1]
        self.peak_live_bytes = max(self.peak_live_bytes, self.live_bytes)
        return result

    def summary(self) -> dict[str, Any]:
        """JSON-ready figures."""
        return {
            "allocated_bytes": self.allocated_bytes,
            "allocations": self.allocations,
            "peak_live_bytes": self.peak_live_bytes,
            "top_ops": self.top_ops(),
        }


def _tensors(*trees: Any) -> list[torch.Tensor]:
    leaves, _ = tree_flatten(trees)
    return [leaf for leaf in leaves if isinstance(leaf, torch.Tensor)]


@contextlib.contextmanager
def weight_path_ledger() -> Iterator[StorageLedger]:
    """An active ledger that counts what a weight push allocates between the actor's export and
    vLLM's own loading, both paused: the export streams (`shards.iter_engine_shards`,
    `model.load.export_megatron_to_hf`: the per-tensor transforms a push needs on any device) and,
    in this process, vLLM's loaders, layer-wise reload and commit (`VLLMWorkerExtension._mdapo_load`,
    `_mdapo_finish_weight_update`: the engine's own work on its parameters' device)."""
    ledger = StorageLedger()
    with contextlib.ExitStack() as stack:
        stack.enter_context(ledger.pausing(shards, "iter_engine_shards", returns_iterator=True))
        stack.enter_context(ledger.pausing(load, "export_megatron_to_hf", returns_iterator=True))
        stack.enter_context(ledger.pausing(VLLMWorkerExtension, "_mdapo_load"))
        stack.enter_context(ledger.pausing(VLLMWorkerExtension, "_mdapo_finish_weight_update"))
        with ledger:
            yield ledger
