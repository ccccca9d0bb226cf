"""The lists in tests/support/tiers.py that choose what runs where name files that exist: a renamed or
moved file would otherwise drop out of the second stack (or of the longest-first order) unnoticed."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.tiers import LONGEST_FIRST, SECOND_STACK_FILES

TESTS_DIR = Path(__file__).resolve().parent


@pytest.mark.parametrize("listing", [SECOND_STACK_FILES, LONGEST_FIRST], ids=["second_stack", "longest_first"])
def test_every_listed_file_exists(listing):
    missing = [name for name in listing if not (TESTS_DIR / name).is_file()]
    assert not missing, f"tests/support/tiers.py lists files that do not exist: {missing}"
    assert len(set(listing)) == len(listing)


def test_the_second_stack_covers_conversion_layouts_resume_and_both_engines():
    """What issue 28 asks of the cluster stack: conversion round trips, CP matching HF, resume past a
    corrupted checkpoint, and the engines' numerics."""
    for needed in ("checkpoint/test_convert_roundtrip.py", "distributed/test_context_parallel_dist.py",
                   "trainer/test_output_dir.py", "rollout/engines/test_vllm_engine.py", "rollout/engines/test_sglang_engine.py"):  # fmt: skip
        assert needed in SECOND_STACK_FILES
