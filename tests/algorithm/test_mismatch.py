"""Rollout-vs-trainer mismatch metrics and truncated IS weights against the formulas, token by token.

The references are written with Python floats and `math` over explicit lists of valid tokens, not
with the tensor code under test.
"""

from __future__ import annotations

import math

import pytest
import torch

from megatron_dapo.algorithm.mismatch import MismatchStats, log_prob_mismatch, truncated_is_stats, truncated_is_weights


def _example(seed: int = 0, shape=(5, 7)):
    g = torch.Generator().manual_seed(seed)
    rollout = -3.0 * torch.rand(shape, generator=g)
    trainer = rollout + 0.3 * torch.randn(shape, generator=g)
    lengths = [7, 0, 3, 5, 1][: shape[0]]
    mask = torch.zeros(shape, dtype=torch.bool)
    for i, n in enumerate(lengths):
        mask[i, :n] = True
    # Garbage where the mask is off: must not leak into any statistic.
    rollout = torch.where(mask, rollout, torch.full(shape, -1e30))
    trainer = torch.where(mask, trainer, torch.full(shape, float("nan")))
    return rollout, trainer, mask


def _valid_pairs(rollout, trainer, mask) -> list[tuple[float, float]]:
    return [(float(r), float(t)) for r, t, m in zip(rollout.flatten(), trainer.flatten(), mask.flatten()) if m]


def test_mismatch_matches_direct_formulas():
    rollout, trainer, mask = _example()
    pairs = _valid_pairs(rollout, trainer, mask)
    diffs = [t - r for r, t in pairs]
    stats = log_prob_mismatch(rollout, trainer, mask)
    assert stats.num_tokens == len(pairs) == 16
    assert stats.mean_abs_diff == pytest.approx(sum(abs(d) for d in diffs) / len(diffs), rel=1e-12)
    assert stats.max_abs_diff == pytest.approx(max(abs(d) for d in diffs), rel=1e-12)
    k3 = [math.exp(d) - 1 - d for d in diffs]
    assert stats.k3_kl == pytest.approx(sum(k3) / len(k3), rel=1e-10)
    metrics = stats.as_metrics()
    assert metrics == {
        "rollout_mismatch/mean_abs": stats.mean_abs_diff,
        "rollout_mismatch/max_abs": stats.max_abs_diff,
        "rollout_mismatch/k3_kl": stats.k3_kl,
        "rollout_mismatch/tokens": 16.0,
    }


def test_k3_is_the_kl_of_rollout_from_trainer_in_expectation():
    """Sampling tokens from a rollout distribution, mean k3 -> KL(rollout || trainer) (exact formula)."""
    g = torch.Generator().manual_seed(1)
    rollout_logits, trainer_logits = torch.randn(6, generator=g), torch.randn(6, generator=g) * 0.5
    p_r, p_t = rollout_logits.double().log_softmax(-1), trainer_logits.double().log_softmax(-1)
    tokens = torch.multinomial(p_r.exp(), 400_000, replacement=True, generator=g)
    stats = log_prob_mismatch(p_r[tokens], p_t[tokens])
    exact_kl = float((p_r.exp() * (p_r - p_t)).sum())
    assert stats.k3_kl == pytest.approx(exact_kl, rel=0.02)
    assert stats.k3_kl >= 0


def test_identical_log_probs_give_zero_and_tiny_differences_keep_precision():
    rollout, _, mask = _example()
    same = log_prob_mismatch(rollout, rollout.clone(), mask)
    assert (same.mean_abs_diff, same.max_abs_diff, same.k3_kl) == (0.0, 0.0, 0.0)
    # float32 trainers differ by ~1e-7: k3 ~ d^2 / 2 must not cancel to 0 or go negative.
    tiny = torch.full((1, 3), 1e-6, dtype=torch.float64)
    stats = log_prob_mismatch(torch.zeros(1, 3, dtype=torch.float64), tiny)
    assert stats.k3_kl == pytest.approx(0.5e-12, rel=1e-5)


def test_empty_mask_and_merge_and_tensor_round_trip():
    rollout, trainer, mask = _example()
    empty = log_prob_mismatch(rollout, trainer, torch.zeros_like(mask))
    assert (empty.num_tokens, empty.mean_abs_diff, empty.k3_kl, empty.max_abs_diff) == (0.0, 0.0, 0.0, 0.0)
    # Splitting the rows over two "ranks" and merging equals the statistics of the whole batch.
    whole = log_prob_mismatch(rollout, trainer, mask)
    left = log_prob_mismatch(rollout[:2], trainer[:2], mask[:2])
    right = log_prob_mismatch(rollout[2:], trainer[2:], mask[2:])
    merged = left.merge(right).merge(empty)
    assert merged.num_tokens == whole.num_tokens
    assert merged.mean_abs_diff == pytest.approx(whole.mean_abs_diff, rel=1e-12)
    assert merged.k3_kl == pytest.approx(whole.k3_kl, rel=1e-12)
    assert merged.max_abs_diff == whole.max_abs_diff
    assert MismatchStats.from_tensor(whole.to_tensor()) == whole


def test_huge_mismatch_stays_finite():
    """A token the trainer finds impossible (e.g. a wrong weight) gives a finite, huge k3."""
    stats = log_prob_mismatch(torch.tensor([-0.1]), torch.tensor([-80.0]))
    assert stats.max_abs_diff == pytest.approx(79.9)
    assert math.isfinite(stats.k3_kl) and stats.k3_kl > 10
    stats = log_prob_mismatch(torch.tensor([-80.0]), torch.tensor([-0.1]))
    assert math.isfinite(stats.k3_kl) and stats.k3_kl > 1e6


@pytest.mark.parametrize("cap", [1.0, 1.5, 2.0, 10.0])
def test_truncated_is_weights_match_the_formula(cap):
    rollout, trainer, mask = _example(seed=2)
    weights = truncated_is_weights(trainer, rollout, cap, mask)
    assert weights.dtype == trainer.dtype and weights.shape == trainer.shape
    for w, r, t, m in zip(weights.flatten(), rollout.flatten(), trainer.flatten(), mask.flatten()):
        expected = min(math.exp(float(t) - float(r)), cap) if m else 0.0
        assert float(w) == pytest.approx(expected, rel=1e-6)
    valid = [min(math.exp(t - r), cap) for r, t in _valid_pairs(rollout, trainer, mask)]
    stats = truncated_is_stats(weights, cap, mask)
    assert stats["tis/weight_mean"] == pytest.approx(sum(valid) / len(valid), rel=1e-6)
    capped = sum(1 for r, t in _valid_pairs(rollout, trainer, mask) if math.exp(t - r) >= cap)
    assert stats["tis/capped_frac"] == pytest.approx(capped / len(valid))


def test_truncated_is_weights_are_data_and_validate_inputs():
    rollout = torch.tensor([[-1.0, -2.0]])
    trainer = torch.tensor([[-0.5, -2.5]], requires_grad=True)
    weights = truncated_is_weights(trainer, rollout, cap=1.2)
    assert not weights.requires_grad
    assert weights.tolist()[0] == pytest.approx([1.2, math.exp(-0.5)])
    with pytest.raises(ValueError, match="cap must be > 0"):
        truncated_is_weights(trainer, rollout, cap=0.0)
    with pytest.raises(ValueError, match="same shape"):
        truncated_is_weights(trainer, rollout[:, :1], cap=2.0)
    with pytest.raises(ValueError, match="mask has shape"):
        log_prob_mismatch(rollout, trainer.detach(), torch.ones(3, dtype=torch.bool))
