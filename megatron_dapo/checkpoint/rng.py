"""Capture and restore every random number generator a training process draws from.

Python's `random`, NumPy's global generator, torch's CPU generator, the CUDA generators (when CUDA
is available) and Megatron's tensor-parallel RNG tracker (the named streams `get_cuda_rng_tracker()`
forks for dropout and initialisation inside TP regions). The states are per rank (ranks of
different pipeline stages are seeded differently), so each rank saves and restores its own.
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch
from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

__all__ = ["capture_rng_state", "restore_rng_state"]


def _tracker():
    return get_cuda_rng_tracker()


def capture_rng_state() -> dict[str, Any]:
    """This process's generator states (copies, safe to keep while training continues)."""
    tracker = _tracker()
    return {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch_cpu": torch.get_rng_state(),
        # On a CPU machine the compatibility layer maps torch.cuda's generator onto the CPU one,
        # which is already saved above; is_available() is the honest "is there a GPU" test.
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
        "megatron_tracker": {name: state.clone() for name, state in tracker.get_states().items()},
    }


def restore_rng_state(state: dict[str, Any]) -> None:
    """Put the generators back to `state` (from `capture_rng_state`)."""
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch_cpu"])
    if state.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    tracker_states = state.get("megatron_tracker")
    if tracker_states:
        _tracker().set_states(tracker_states)
