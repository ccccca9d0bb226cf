"""pass@k / avg@k / maj@k against brute-force enumeration and hand-computed values."""

from __future__ import annotations

import itertools
import math
from fractions import Fraction

import numpy as np
import pytest

from megatron_dapo.algorithm.metrics import aggregate_at_k, avg_at_k, maj_at_k, majority_vote, pass_at_k


@pytest.mark.parametrize("n", range(1, 9))
def test_pass_at_k_equals_enumeration_of_all_k_subsets(n):
    for c in range(n + 1):
        flags = [True] * c + [False] * (n - c)
        for k in range(1, n + 1):
            subsets = list(itertools.combinations(range(n), k))
            brute = sum(any(flags[i] for i in s) for s in subsets) / len(subsets)
            assert pass_at_k(n, c, k) == pytest.approx(brute, abs=1e-12), (n, c, k)


def test_pass_at_k_large_n_is_stable_and_exact():
    n, c, k = 1000, 3, 100
    exact = 1 - Fraction(math.comb(n - c, k), math.comb(n, k))
    assert pass_at_k(n, c, k) == pytest.approx(float(exact), rel=1e-12)
    assert pass_at_k(np.int64(1000), np.int64(0), np.int64(10)) == 0.0


def test_pass_at_k_edge_cases():
    assert pass_at_k(5, 4, 2) == 1.0  # n - c < k
    assert pass_at_k(5, 5, 5) == 1.0
    assert pass_at_k(5, 0, 5) == 0.0
    assert pass_at_k(4, 1, 1) == pytest.approx(0.25)
    with pytest.raises(ValueError, match="at least k"):
        pass_at_k(3, 1, 4)
    with pytest.raises(ValueError):
        pass_at_k(3, 1, 0)
    with pytest.raises(ValueError):
        pass_at_k(3, 4, 1)
    with pytest.raises(TypeError):
        pass_at_k(3.0, 1, 1)


def test_avg_at_k():
    assert avg_at_k([True, False, True, True]) == 0.75
    assert avg_at_k([0.5, 1.0]) == 0.75
    with pytest.raises(ValueError):
        avg_at_k([])


def test_majority_vote_and_tie_break_by_first_appearance():
    assert majority_vote(["3", "4", "4", "3", "5", "4"]) == 1
    assert majority_vote(["7", "2", "2", "7"]) == 0  # tie 2-2: "7" appears first
    assert majority_vote(["2", "7", "7", "2"]) == 0
    assert majority_vote([None, "9", None, None]) == 1  # None abstains
    assert majority_vote([None, None]) is None
    assert maj_at_k(["3", "4", "4"], [True, False, False]) == 0.0
    assert maj_at_k(["3", "4", "3"], [True, False, True]) == 1.0
    assert maj_at_k(["a", "b"], [False, True]) == 0.0  # tie -> "a", which is wrong
    assert maj_at_k([None, None], [False, False]) == 0.0
    with pytest.raises(ValueError):
        maj_at_k(["a"], [True, False])


def test_aggregate_at_k_over_prompts():
    results = {
        "p1": [("1", True), ("2", False), ("2", False), ("1", True)],  # c=2; maj@4 tie -> "1" correct
        "p2": [("x", False), ("y", False), ("y", False), ("z", True)],  # c=1
    }
    got = aggregate_at_k(results, ks=[1, 2, 4])
    assert got["pass@1"] == pytest.approx((0.5 + 0.25) / 2)
    assert got["pass@2"] == pytest.approx(((1 - 1 / 6) + 0.5) / 2)  # C(2,2)/C(4,2) = 1/6; C(3,2)/C(4,2) = 1/2
    assert got["pass@4"] == pytest.approx(1.0)
    assert got["avg@1"] == got["avg@4"] == pytest.approx((0.5 + 0.25) / 2)
    assert got["maj@1"] == pytest.approx((1.0 + 0.0) / 2)  # first samples: "1" right, "x" wrong
    assert got["maj@2"] == pytest.approx((1.0 + 0.0) / 2)  # tie -> first
    assert got["maj@4"] == pytest.approx((1.0 + 0.0) / 2)  # p2 votes "y"
    assert set(got) == {f"{m}@{k}" for m in ("pass", "avg", "maj") for k in (1, 2, 4)}
    with pytest.raises(ValueError, match="fewer than k=8"):
        aggregate_at_k(results, ks=[8])
    with pytest.raises(ValueError):
        aggregate_at_k({}, ks=[1])
