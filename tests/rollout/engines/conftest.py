"""Fixtures of the engine tests."""

from __future__ import annotations

import sys

import pytest

from megatron_dapo.rollout.engines.sglang import engine as sglang_engine
from tests.support.fake_sglang import FakeSGLang


@pytest.fixture
def fake(monkeypatch) -> FakeSGLang:
    """The fake `sglang` package in sys.modules (SGLang's Engine records the adapter's calls instead of
    starting), outside any launcher."""
    package = FakeSGLang()
    for name, module in package.modules.items():
        monkeypatch.setitem(sys.modules, name, module)
    monkeypatch.setattr(sglang_engine, "_PATCHED", False)
    for name in ("LOCAL_RANK", "SLURM_LOCALID"):  # outside a launcher: SGLang picks its ports (see the port test)
        monkeypatch.delenv(name, raising=False)
    return package
