"""checkpoint/rng.py: RNG states saved as data only and read with weights_only loading, so a pickle
planted in `rng/rank_N.pt` (checkpoints sit on shared scratch) is refused before any of it runs."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from megatron_dapo.checkpoint import UnsafeCheckpointError
from megatron_dapo.checkpoint.rng import capture_rng_state, read_rng_file, restore_rng_state


def _draws() -> list:
    return [random.random(), float(np.random.rand()), float(torch.rand(()))]


def test_saved_states_load_as_data_and_restore_every_generator(tmp_path):
    random.seed(1), np.random.seed(2), torch.manual_seed(3)
    np.random.standard_normal()  # a cached Gaussian is part of NumPy's state
    path = tmp_path / "rank_00000.pt"
    torch.save(capture_rng_state(), path)
    expected = _draws()
    torch.load(path, weights_only=True)  # nothing but tensors and plain values
    restore_rng_state(read_rng_file(path))
    assert _draws() == expected


def test_files_of_the_previous_format_still_load(tmp_path):
    """Before, NumPy's state was saved as its ndarray tuple: NumPy's array reconstruction is allowed."""
    np.random.seed(5)
    state = capture_rng_state()
    state["numpy"] = np.random.get_state()
    path = tmp_path / "rank_00000.pt"
    torch.save(state, path)
    expected = float(np.random.rand())
    restore_rng_state(read_rng_file(path))
    assert float(np.random.rand()) == expected


class _Payload:
    """What an attacker plants: unpickling it would create a marker file."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (open, (str(self.marker), "w"))


def test_a_planted_pickle_is_refused_and_runs_nothing(tmp_path):
    marker = tmp_path / "payload_ran"
    path = tmp_path / "rng" / "rank_00000.pt"
    path.parent.mkdir()
    torch.save({"python": random.getstate(), "evil": _Payload(marker)}, path)
    with pytest.raises(UnsafeCheckpointError, match="asks to run code while loading") as caught:
        read_rng_file(path)
    assert not marker.exists()
    assert str(path) in str(caught.value) and "nothing of it was run" in str(caught.value)
    torch.load(path, weights_only=False).get("evil")  # the payload is real: loaded unsafely, it runs
    assert marker.exists()
