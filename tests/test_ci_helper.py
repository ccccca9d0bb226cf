"""`tests/support/ci.py`: one definition of "under CI" for the vLLM and SLURM tests (true / 1 / yes, any case)."""

from __future__ import annotations

import pytest

from tests.support.ci import skip_or_fail, under_ci


@pytest.mark.parametrize("value", ["true", "TRUE", "1", "yes", " Yes "])
def test_ci_values_that_count(monkeypatch, value):
    monkeypatch.setenv("CI", value)
    assert under_ci()
    with pytest.raises(pytest.fail.Exception, match="must not be skipped"):
        skip_or_fail("vLLM is not installed")


@pytest.mark.parametrize("value", [None, "", "false", "0", "no"])
def test_values_that_do_not(monkeypatch, value):
    if value is None:
        monkeypatch.delenv("CI", raising=False)
    else:
        monkeypatch.setenv("CI", value)
    assert not under_ci()
    with pytest.raises(pytest.skip.Exception, match="vLLM is not installed"):
        skip_or_fail("vLLM is not installed")
