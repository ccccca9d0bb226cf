"""Rollout-vs-trainer log-prob mismatch: the metrics to log every step and the truncated IS weights.

The rollout engine samples response tokens and reports their log-probs; the trainer recomputes the
same tokens' log-probs with its own kernels, precision and parallel layout. Even with identical
weights the two differ a little (bf16 kernels, fused attention, sampling-side temperature handling);
a bad weight sync or a version change makes them differ a lot. These pure functions measure it:

    stats = log_prob_mismatch(rollout_log_probs, old_log_probs, mask)      # per rank / micro-batch
    stats = stats.merge(other_stats)                                         # pool exactly
    metrics.update(stats.as_metrics())          # rollout_mismatch/{mean_abs,max_abs,k3_kl,tokens}

    w = truncated_is_weights(old_log_probs, rollout_log_probs, mask, cap=algorithm.tis_cap)

With ``d = trainer - rollout`` per valid token (the response tokens were sampled by the rollout
policy, so ``exp(d)`` is the ratio pi_trainer / pi_rollout at a sample of pi_rollout):

* ``mean_abs`` / ``max_abs``: mean and max of ``|d|`` over valid tokens;
* ``k3_kl``: Schulman's k3 estimator ``exp(d) - 1 - d`` averaged over valid tokens, an unbiased,
  non-negative estimate of KL(pi_rollout || pi_trainer);
* truncated importance sampling (Yao et al., "Your efficient RL framework secretly brings you
  off-policy RL training", 2025): the token weight ``min(exp(trainer_old - rollout), cap)`` that
  corrects the policy gradient for sampling from the rollout engine instead of the trainer.

Everything is computed in float64 (the differences of interest are ~1e-6 on float32 engines).
``d`` is clamped to +-``LOG_RATIO_CLAMP`` before ``exp`` so that a token the trainer finds
impossible (a sync bug) gives a huge but finite k3 instead of inf; ``|d|`` is never clamped.
Statistics keep sums (not means) so that micro-batches and ranks combine exactly: sum the
``sum_*`` / ``num_tokens`` fields and take the max of ``max_abs_diff`` (`MismatchStats.merge`,
or all-reduce ``to_tensor()[:3]`` with SUM and ``[3]`` with MAX).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from megatron_dapo.algorithm.loss import LOG_RATIO_CLAMP

__all__ = ["MismatchStats", "log_prob_mismatch", "truncated_is_weights", "truncated_is_stats"]


def _valid_mask(reference: torch.Tensor, mask: Optional[torch.Tensor]) -> torch.Tensor:
    if mask is None:
        return torch.ones_like(reference, dtype=torch.bool)
    if tuple(mask.shape) != tuple(reference.shape):
        raise ValueError(f"mask has shape {tuple(mask.shape)}, log-probs have {tuple(reference.shape)}")
    return mask.bool()


def _check_pair(a: torch.Tensor, b: torch.Tensor, names: str) -> None:
    if tuple(a.shape) != tuple(b.shape):
        raise ValueError(f"{names} must have the same shape, got {tuple(a.shape)} and {tuple(b.shape)}")


@dataclass(frozen=True)
class MismatchStats:
    """Sums over valid tokens of |trainer - rollout| and of k3, their count, and the max |diff|."""

    sum_abs_diff: float
    sum_k3: float
    num_tokens: float
    max_abs_diff: float

    @property
    def mean_abs_diff(self) -> float:
        """Mean |trainer - rollout| over valid tokens (0 without tokens)."""
        return self.sum_abs_diff / self.num_tokens if self.num_tokens else 0.0

    @property
    def k3_kl(self) -> float:
        """Mean k3 estimate of KL(pi_rollout || pi_trainer) over valid tokens (0 without tokens)."""
        return self.sum_k3 / self.num_tokens if self.num_tokens else 0.0

    def merge(self, other: "MismatchStats") -> "MismatchStats":
        """The statistics of both token sets together (exact: sums add, maxima take the max)."""
        return MismatchStats(
            sum_abs_diff=self.sum_abs_diff + other.sum_abs_diff,
            sum_k3=self.sum_k3 + other.sum_k3,
            num_tokens=self.num_tokens + other.num_tokens,
            max_abs_diff=max(self.max_abs_diff, other.max_abs_diff),
        )

    def to_tensor(self) -> torch.Tensor:
        """float64 [sum_abs_diff, sum_k3, num_tokens, max_abs_diff] for an all-reduce (SUM first 3, MAX last)."""
        return torch.tensor([self.sum_abs_diff, self.sum_k3, self.num_tokens, self.max_abs_diff], dtype=torch.float64)

    @classmethod
    def from_tensor(cls, values: torch.Tensor) -> "MismatchStats":
        """Inverse of `to_tensor`."""
        if tuple(values.shape) != (4,):
            raise ValueError(f"expected 4 values, got shape {tuple(values.shape)}")
        a, k, n, m = (float(v) for v in values.double().cpu())
        return cls(sum_abs_diff=a, sum_k3=k, num_tokens=n, max_abs_diff=m)

    def as_metrics(self, prefix: str = "rollout_mismatch/") -> dict[str, float]:
        """Loggable means: ``{prefix}mean_abs``, ``max_abs``, ``k3_kl``, ``tokens``."""
        return {
            f"{prefix}mean_abs": self.mean_abs_diff,
            f"{prefix}max_abs": self.max_abs_diff,
            f"{prefix}k3_kl": self.k3_kl,
            f"{prefix}tokens": self.num_tokens,
        }


def log_prob_mismatch(
    rollout_log_probs: torch.Tensor, trainer_log_probs: torch.Tensor, mask: Optional[torch.Tensor] = None
) -> MismatchStats:
    """Mismatch statistics of the valid tokens (``mask`` True; all tokens when None).

    Args:
        rollout_log_probs: the engine's log-prob of each sampled token, any shape (e.g. ``[n, R]``).
        trainer_log_probs: the trainer's log-prob of the same tokens (e.g. the actor's old log-probs).
        mask: bool, same shape; padding and masked-out tokens are ignored whatever their values.
    """
    _check_pair(rollout_log_probs, trainer_log_probs, "rollout_log_probs and trainer_log_probs")
    valid = _valid_mask(rollout_log_probs, mask)
    d = (trainer_log_probs.double() - rollout_log_probs.double())[valid]
    if d.numel() == 0:
        return MismatchStats(0.0, 0.0, 0.0, 0.0)
    clamped = d.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    k3 = torch.expm1(clamped) - clamped  # exp(d) - 1 - d, without cancellation for tiny d
    abs_diff = d.abs()
    return MismatchStats(
        sum_abs_diff=float(abs_diff.sum()),
        sum_k3=float(k3.sum()),
        num_tokens=float(d.numel()),
        max_abs_diff=float(abs_diff.max()),
    )


def truncated_is_weights(
    trainer_old_log_probs: torch.Tensor,
    rollout_log_probs: torch.Tensor,
    cap: float,
    mask: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Token-level truncated IS weights ``min(exp(trainer_old - rollout), cap)``; 0 on masked tokens.

    The weights are data, not part of the graph (no gradient flows through them), in the dtype of
    ``trainer_old_log_probs``. ``cap`` is ``algorithm.tis_cap`` (> 0).
    """
    if not cap > 0:
        raise ValueError(f"the truncated IS cap must be > 0, got {cap}")
    _check_pair(trainer_old_log_probs, rollout_log_probs, "trainer_old_log_probs and rollout_log_probs")
    valid = _valid_mask(trainer_old_log_probs, mask)
    with torch.no_grad():
        log_ratio = trainer_old_log_probs.double() - rollout_log_probs.double()
        log_ratio = torch.where(valid, log_ratio, torch.zeros_like(log_ratio))
        weights = torch.exp(log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)).clamp(max=cap)
        weights = torch.where(valid, weights, torch.zeros_like(weights))
    return weights.to(trainer_old_log_probs.dtype)


def truncated_is_stats(weights: torch.Tensor, cap: float, mask: Optional[torch.Tensor] = None) -> dict[str, float]:
    """Mean weight and fraction of valid tokens at the cap, for logging (``tis/weight_mean``, ``tis/capped_frac``)."""
    valid = _valid_mask(weights, mask)
    count = int(valid.sum())
    if count == 0:
        return {"tis/weight_mean": 0.0, "tis/capped_frac": 0.0}
    w = weights.double()[valid]
    at_cap = float(torch.tensor(cap, dtype=weights.dtype))  # the cap as stored in the weights' dtype
    return {"tis/weight_mean": float(w.mean()), "tis/capped_frac": float((w >= at_cap).double().mean())}
