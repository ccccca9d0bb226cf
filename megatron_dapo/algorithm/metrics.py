"""Validation metrics over k sampled responses per prompt: pass@k, avg@k, maj@k."""

from __future__ import annotations

import operator
from collections.abc import Hashable, Mapping, Sequence
from typing import Optional, Union

__all__ = ["pass_at_k", "avg_at_k", "majority_vote", "maj_at_k", "aggregate_at_k"]

Score = Union[bool, int, float]


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased estimate of pass@k from ``n`` samples of which ``c`` are correct.

    ``1 - C(n-c, k) / C(n, k)``, the probability that a random k-subset of the n samples holds
    at least one correct one (Chen et al. 2021, "Evaluating Large Language Models Trained on
    Code"). Computed as ``1 - prod_{i=n-c+1}^{n} (1 - k/i)``, which never forms the huge binomials.

    Raises:
        ValueError: unless ``0 <= c <= n`` and ``1 <= k <= n``.
    """
    try:  # accepts Python and numpy integers, rejects floats
        n, c, k = operator.index(n), operator.index(c), operator.index(k)
    except TypeError:
        raise TypeError(f"n, c, k must be integers, got {n!r}, {c!r}, {k!r}") from None
    if not 0 <= c <= n:
        raise ValueError(f"need 0 <= c <= n, got n={n}, c={c}")
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    if k > n:
        raise ValueError(f"pass@{k} needs at least k samples, got n={n}")
    if n - c < k:
        return 1.0  # every k-subset contains a correct sample
    failure = 1.0  # C(n-c, k) / C(n, k) = prod_{i=n-c+1}^{n} (i - k) / i
    for i in range(n - c + 1, n + 1):
        failure *= 1.0 - k / i
    return 1.0 - failure


def avg_at_k(scores: Sequence[Score]) -> float:
    """Mean accuracy over the k samples of one prompt (bools count as 0/1)."""
    if len(scores) == 0:
        raise ValueError("avg@k of an empty list of scores")
    return sum(float(s) for s in scores) / len(scores)


def majority_vote(predictions: Sequence[Optional[Hashable]]) -> Optional[int]:
    """Index of the sample whose prediction wins the majority vote, or None if nobody votes.

    ``None`` predictions (no answer extracted) abstain; map any other "no answer" sentinel to
    None to exclude it. Ties between equally frequent predictions go to the one that appears
    first in ``predictions`` (deterministic given the sample order); the returned index is that
    prediction's first occurrence.
    """
    counts: dict[Hashable, int] = {}
    first_index: dict[Hashable, int] = {}
    for i, pred in enumerate(predictions):
        if pred is None:
            continue
        counts[pred] = counts.get(pred, 0) + 1
        first_index.setdefault(pred, i)
    if not counts:
        return None
    # max() returns the first maximal element of an iterable, and dicts iterate in insertion
    # (= first appearance) order, which is the documented tie-break.
    winner = max(counts, key=counts.__getitem__)
    return first_index[winner]


def maj_at_k(predictions: Sequence[Optional[Hashable]], correct_flags: Sequence[Score]) -> float:
    """1.0 if the majority-voted prediction is correct, else 0.0 (see `majority_vote`).

    The correctness of the voted answer is the flag of its first occurrence. No votes at all
    (every prediction None) counts as wrong.
    """
    if len(predictions) != len(correct_flags):
        raise ValueError(f"{len(predictions)} predictions but {len(correct_flags)} correctness flags")
    if len(predictions) == 0:
        raise ValueError("maj@k of an empty list of predictions")
    winner = majority_vote(predictions)
    return 0.0 if winner is None else float(bool(correct_flags[winner]))


def aggregate_at_k(
    results: Mapping[Hashable, Sequence[tuple[Optional[Hashable], Score]]],
    ks: Sequence[int],
) -> dict[str, float]:
    """Mean pass@k, avg@k and maj@k over prompts.

    Args:
        results: prompt -> its n sampled responses as ``(prediction, acc)`` pairs, in sampling order.
        ks: the k values; each needs ``k <= n`` for every prompt.

    Returns:
        ``{"pass@k": ..., "avg@k": ..., "maj@k": ...}`` for each k, each the mean over prompts.
        With n samples and k < n: pass@k is the unbiased estimator over all n samples; avg@k is
        the mean accuracy over all n samples (the unbiased, lowest-variance estimate of the mean
        over k samples); maj@k votes among the FIRST k samples (samples are i.i.d., so the first k
        are an unbiased draw and the result is deterministic).

    Raises:
        ValueError: no prompts, an empty k list, or a prompt with fewer than k samples.
    """
    if not results:
        raise ValueError("no prompts to aggregate")
    if not ks:
        raise ValueError("no k values given")
    totals: dict[str, float] = {}
    for k in ks:
        for metric in ("pass", "avg", "maj"):
            totals[f"{metric}@{k}"] = 0.0
    for prompt, samples in results.items():
        preds = [pred for pred, _ in samples]
        accs = [acc for _, acc in samples]
        n, c = len(samples), sum(1 for acc in accs if acc)
        for k in ks:
            if k > n:
                raise ValueError(f"prompt {prompt!r} has {n} samples, fewer than k={k}")
            totals[f"pass@{k}"] += pass_at_k(n, c, k)
            totals[f"avg@{k}"] += avg_at_k(accs)
            totals[f"maj@{k}"] += maj_at_k(preds[:k], accs[:k])
    return {name: total / len(results) for name, total in totals.items()}
