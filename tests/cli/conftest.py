"""Fixtures of the command tests."""

from __future__ import annotations

import pytest


@pytest.fixture
def one_process(monkeypatch):
    """No launcher's variables (torchrun's, SLURM's) in the environment: the command runs as one plain
    process. Returns `monkeypatch`, to set some of them again."""
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "SLURM_PROCID", "SLURM_NTASKS"):
        monkeypatch.delenv(name, raising=False)
    return monkeypatch
