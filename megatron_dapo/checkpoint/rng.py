"""Capture and restore every random number generator a training process draws from.

Python's `random`, NumPy's global generator, torch's CPU generator, the CUDA generators (when CUDA
is available) and Megatron's tensor-parallel RNG tracker (the named streams `get_cuda_rng_tracker()`
forks for dropout and initialisation inside TP regions). The states are per rank (ranks of
different pipeline stages are seeded differently), so each rank saves and restores its own.

The states are saved as tensors and plain values only, and read back with `torch.load(...,
weights_only=True)` (`read_rng_file`): a checkpoint usually sits on shared scratch, and a pickle
planted in `rng/rank_N.pt` would otherwise run its code in every rank at `--resume`. A file that
needs anything else is refused with `UnsafeCheckpointError`, before any of it runs. Files written
before this format (NumPy's state as an ndarray) still load: NumPy's array reconstruction is the one
addition allowed, data only.
"""

from __future__ import annotations

import pickle
import random
from pathlib import Path
from typing import Any

import numpy as np
import torch
from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

from megatron_dapo.checkpoint.errors import UnsafeCheckpointError

__all__ = ["capture_rng_state", "read_rng_file", "restore_rng_state"]


def _tracker():
    return get_cuda_rng_tracker()


def capture_rng_state() -> dict[str, Any]:
    """This process's generator states (copies, safe to keep while training continues)."""
    tracker = _tracker()
    return {
        "python": random.getstate(),  # (version, tuple of 625 ints, float or None): plain values
        "numpy": _numpy_state_plain(np.random.get_state()),
        "torch_cpu": torch.get_rng_state(),
        # On a CPU machine the compatibility layer maps torch.cuda's generator onto the CPU one,
        # which is already saved above; is_available() is the honest "is there a GPU" test.
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
        "megatron_tracker": {name: state.clone() for name, state in tracker.get_states().items()},
    }


def restore_rng_state(state: dict[str, Any]) -> None:
    """Put the generators back to `state` (from `capture_rng_state`)."""
    python = state["python"]
    random.setstate((python[0], tuple(python[1]), python[2]))
    numpy_state = state["numpy"]
    if isinstance(numpy_state, dict):
        numpy_state = (numpy_state["kind"], numpy_state["key"].numpy().astype(np.uint32), numpy_state["pos"],
                       numpy_state["has_gauss"], numpy_state["cached_gaussian"])  # fmt: skip
    np.random.set_state(numpy_state)
    torch.set_rng_state(state["torch_cpu"])
    if state.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    tracker_states = state.get("megatron_tracker")
    if tracker_states:
        _tracker().set_states(tracker_states)


def _numpy_state_plain(state: tuple) -> dict[str, Any]:
    """NumPy's legacy generator state without an ndarray (which weights_only loading refuses)."""
    kind, key, pos, has_gauss, cached_gaussian = state
    return {"kind": str(kind), "key": torch.from_numpy(key.astype(np.int64)), "pos": int(pos),
            "has_gauss": int(has_gauss), "cached_gaussian": float(cached_gaussian)}  # fmt: skip


_LEGACY_NUMPY_GLOBALS = ("numpy._core.multiarray._reconstruct", "numpy.core.multiarray._reconstruct", "numpy.ndarray",
                         "numpy.dtype", "numpy.dtypes.UInt32DType")  # fmt: skip


def _legacy_numpy_globals() -> list:
    import importlib

    found = []
    for dotted in _LEGACY_NUMPY_GLOBALS:
        module, _, name = dotted.rpartition(".")
        try:
            found.append(getattr(importlib.import_module(module), name))
        except (ImportError, AttributeError):
            continue
    return found


def read_rng_file(path: Path) -> dict[str, Any]:
    """A rank's saved generator states, loaded without running any code the file could carry."""
    try:
        with torch.serialization.safe_globals(_legacy_numpy_globals()):
            return torch.load(path, weights_only=True)
    except pickle.UnpicklingError as error:
        first = str(error).strip().splitlines()
        reason = next((line.strip() for line in first if "GLOBAL" in line or "Unsupported" in line), first[0] if first else "")
        raise UnsafeCheckpointError(
            f"{path} asks to run code while loading ({reason[:200]}); megatron-dapo writes RNG states as tensors and "
            "plain values only, so this file was not written by it: nothing of it was run. Check who can write to the "
            "checkpoint directory, then resume from another checkpoint or delete this one"
        ) from None
