"""Policy loss, loss aggregation, KL estimators and entropy: pure per-token tensor math.

Conventions shared by every function here:
  * tensors are ``[B, T]`` (sequences x response tokens) unless stated;
  * ``mask`` is bool or 0/1 of the same shape; a nonzero entry marks a valid response token;
  * masked-out positions may hold garbage (NaN, inf, padding): it is selected away with
    ``torch.where`` *before* any arithmetic, so it reaches neither the value nor the gradient.

Exact combination across micro-batches and data-parallel ranks: `aggregate` takes the GLOBAL
token / sequence counts of the mini-batch, so the per-micro-batch losses simply add up to the
global mean; `PolicyLossStats` holds sums and a token count that add up the same way.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Optional, Union

import torch

from megatron_dapo.algorithm.defaults import CLIP_C, CLIP_HIGH, CLIP_LOW

__all__ = [
    "LOG_RATIO_CLAMP",
    "LOSS_AGG_MODES",
    "KL_KINDS",
    "PolicyLossStats",
    "policy_loss",
    "count_tokens_and_seqs",
    "aggregate",
    "kl_penalty",
    "entropy_from_logits",
]

LOG_RATIO_CLAMP = 20.0
"""Log-ratios are clamped to [-20, 20] before ``exp`` so that a stale or garbage token cannot
produce inf (e^20 ~ 4.9e8 is far past any clip boundary, so the clamp never changes the loss of a
token whose ratio is in a meaningful range)."""

LOSS_AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")
KL_KINDS = ("k1", "abs", "k2", "mse", "k3", "low_var_kl")
_K3_CLAMP = 10.0  # bound on the low-variance KL per token, as customary in verl

Count = Union[int, float, torch.Tensor]


def _check_same_shape(**tensors: torch.Tensor) -> None:
    shapes = {name: tuple(t.shape) for name, t in tensors.items()}
    if len(set(shapes.values())) != 1:
        raise ValueError(f"shape mismatch: {shapes}")


def _masked_log_ratio(log_probs: torch.Tensor, other_log_probs: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """``log_probs - other_log_probs`` on valid tokens, exactly 0 elsewhere, clamped to +-20.

    The ``where`` sits right after the subtraction, whose backward is the identity, so a NaN at a
    masked position gets a zero gradient rather than ``0 * NaN``.
    """
    diff = log_probs - other_log_probs
    diff = torch.where(valid, diff, torch.zeros_like(diff))
    return diff.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)


# ----------------------------------------------------------------------------------------------
# Policy loss
# ----------------------------------------------------------------------------------------------


@dataclass
class PolicyLossStats:
    """Diagnostics of one `policy_loss` call, as detached SUMS over valid tokens plus their count.

    Combining micro-batches / DP ranks exactly: add the stats of every micro-batch (``a + b``),
    all-reduce ``to_tensor()`` with SUM across DP ranks, rebuild with ``from_tensor``, then read
    the means (``clipfrac``, ``approx_kl``...), which divide by the total ``num_tokens``.
    Means of an object with ``num_tokens == 0`` are 0, never NaN.

    Fields (each a 0-dim float tensor):
      * ``clipfrac_sum``: tokens where the PPO clip is active (clipped surrogate > unclipped);
        equals ``clipfrac_high_sum + clipfrac_low_sum``.
      * ``clipfrac_high_sum``: tokens with A > 0 and ratio > 1 + clip_high.
      * ``clipfrac_low_sum``: tokens with A < 0 and ratio < 1 - clip_low.
      * ``dual_clipfrac_sum``: tokens with A < 0 whose loss is capped at ``-A * clip_c``.
      * ``approx_kl_sum``: sum of ``old_logp - logp`` (k1 estimate of KL(old || new)).
      * ``num_tokens``: number of valid tokens.
    """

    clipfrac_sum: torch.Tensor
    clipfrac_high_sum: torch.Tensor
    clipfrac_low_sum: torch.Tensor
    dual_clipfrac_sum: torch.Tensor
    approx_kl_sum: torch.Tensor
    num_tokens: torch.Tensor

    def __add__(self, other: "PolicyLossStats") -> "PolicyLossStats":
        return PolicyLossStats(*(getattr(self, f.name) + getattr(other, f.name) for f in fields(self)))

    def to_tensor(self) -> torch.Tensor:
        """All fields stacked into one 1-D float64 tensor (one all-reduce instead of six)."""
        return torch.stack([getattr(self, f.name).to(torch.float64) for f in fields(self)])

    @classmethod
    def from_tensor(cls, packed: torch.Tensor) -> "PolicyLossStats":
        """Inverse of `to_tensor`."""
        if packed.shape != (len(fields(cls)),):
            raise ValueError(f"expected a tensor of shape ({len(fields(cls))},), got {tuple(packed.shape)}")
        return cls(*packed.unbind(0))

    def _mean(self, total: torch.Tensor) -> torch.Tensor:
        return total / self.num_tokens.clamp_min(1)

    @property
    def clipfrac(self) -> torch.Tensor:
        return self._mean(self.clipfrac_sum)

    @property
    def clipfrac_high(self) -> torch.Tensor:
        return self._mean(self.clipfrac_high_sum)

    @property
    def clipfrac_low(self) -> torch.Tensor:
        return self._mean(self.clipfrac_low_sum)

    @property
    def dual_clipfrac(self) -> torch.Tensor:
        return self._mean(self.dual_clipfrac_sum)

    @property
    def approx_kl(self) -> torch.Tensor:
        return self._mean(self.approx_kl_sum)

    def means(self) -> dict[str, float]:
        """The mean statistics as Python floats, for logging."""
        names = ("clipfrac", "clipfrac_high", "clipfrac_low", "dual_clipfrac", "approx_kl")
        return {name: float(getattr(self, name)) for name in names}


def policy_loss(
    log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_low: float = CLIP_LOW,
    clip_high: float = CLIP_HIGH,
    clip_c: Optional[float] = CLIP_C,
) -> tuple[torch.Tensor, PolicyLossStats]:
    """Per-token clipped surrogate loss with decoupled clip range (DAPO clip-higher) and dual-clip.

    With ``r = exp(clamp(logp - old_logp, -20, 20))`` and ``A`` the token's advantage::

        pg1 = -A * r
        pg2 = -A * clamp(r, 1 - clip_low, 1 + clip_high)
        loss = max(pg1, pg2)                          # PPO clip, decoupled bounds
        loss = min(loss, -A * clip_c)   if A < 0      # dual-clip (off when clip_c is None)

    Args:
        log_probs: ``[B, T]`` log-probabilities of the sampled tokens under the current policy.
        old_log_probs: ``[B, T]`` the same under the behaviour (rollout-time) policy.
        advantages: ``[B, T]`` per token, or ``[B]`` per sequence (broadcast over tokens).
        mask: ``[B, T]`` valid response tokens.
        clip_low, clip_high: the ratio is clipped to ``[1 - clip_low, 1 + clip_high]``.
        clip_c: dual-clip constant, must be > 1; ``None`` disables dual-clip.

    Returns:
        ``(loss, stats)``: the per-token loss ``[B, T]`` (0 at masked positions, which also get
        zero gradient) to be reduced with `aggregate`, and detached `PolicyLossStats`.
    """
    if not 0 <= clip_low < 1:
        raise ValueError(f"clip_low must be in [0, 1), got {clip_low}")
    if clip_high < 0:
        raise ValueError(f"clip_high must be >= 0, got {clip_high}")
    if clip_c is not None and not clip_c > 1:
        raise ValueError(f"clip_c (dual-clip) must be > 1 or None to disable it, got {clip_c}")
    if log_probs.dim() != 2:
        raise ValueError(f"log_probs must be [B, T], got shape {tuple(log_probs.shape)}")
    if advantages.dim() == 1 and advantages.shape[0] == log_probs.shape[0]:
        advantages = advantages.unsqueeze(-1).expand(log_probs.shape)
    _check_same_shape(log_probs=log_probs, old_log_probs=old_log_probs, advantages=advantages, mask=mask)

    valid = mask.bool()
    log_ratio = _masked_log_ratio(log_probs, old_log_probs, valid)
    ratio = torch.exp(log_ratio)
    adv = torch.where(valid, advantages, torch.zeros_like(advantages)).to(ratio.dtype)

    pg_unclipped = -adv * ratio
    pg_clipped = -adv * ratio.clamp(1 - clip_low, 1 + clip_high)
    # `where` rather than `maximum`: on ties maximum splits the gradient between branches; here the
    # unclipped branch carries it, which is the textbook gradient of the PPO objective.
    clip_active = pg_clipped > pg_unclipped
    loss = torch.where(clip_active, pg_clipped, pg_unclipped)
    negative = adv < 0
    if clip_c is not None:
        pg_dual = -adv * clip_c
        dual_active = negative & (loss > pg_dual)
        loss = torch.where(dual_active, pg_dual, loss)
    else:
        dual_active = torch.zeros_like(valid)
    loss = torch.where(valid, loss, torch.zeros_like(loss))

    with torch.no_grad():
        acc_dtype = torch.float64 if ratio.dtype == torch.float64 else torch.float32
        stats = PolicyLossStats(
            clipfrac_sum=(clip_active & valid).sum().to(acc_dtype),
            clipfrac_high_sum=(valid & (adv > 0) & (ratio > 1 + clip_high)).sum().to(acc_dtype),
            clipfrac_low_sum=(valid & negative & (ratio < 1 - clip_low)).sum().to(acc_dtype),
            dual_clipfrac_sum=(dual_active & valid).sum().to(acc_dtype),
            approx_kl_sum=(-log_ratio).to(acc_dtype).sum(),  # log_ratio is 0 at masked positions
            num_tokens=valid.sum().to(acc_dtype),
        )
    return loss, stats


# ----------------------------------------------------------------------------------------------
# Aggregation
# ----------------------------------------------------------------------------------------------


def count_tokens_and_seqs(mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The counts `aggregate` normalises by: ``(valid tokens, sequences with >= 1 valid token)``.

    Sum these over every micro-batch of a mini-batch and all-reduce them over the DP ranks to get
    the global ``num_tokens`` / ``num_seqs`` to pass to `aggregate`. Rows without a valid token
    (fully masked, e.g. overlong-filtered or padding rows) are NOT counted as sequences.
    """
    valid = mask.bool()
    return valid.sum(), valid.any(dim=-1).sum()


def _as_denominator(count: Count, like: torch.Tensor) -> torch.Tensor:
    # clamp at 1: a count of 0 means there is nothing to average and the numerator is 0 too.
    return torch.as_tensor(count, dtype=like.dtype, device=like.device).clamp_min(1)


def aggregate(
    loss: torch.Tensor,
    mask: torch.Tensor,
    mode: str,
    num_tokens: Optional[Count] = None,
    num_seqs: Optional[Count] = None,
    horizon: Optional[Count] = None,
) -> torch.Tensor:
    """Reduce a per-token loss ``[B, T]`` to a scalar.

    Notation: ``m`` the mask, ``l`` the loss, ``N_tok``/``N_seq`` the token/sequence counts.

    * ``token-mean``: ``sum(l * m) / N_tok`` (DAPO's token-level loss).
    * ``seq-mean-token-sum``: ``sum_b (sum_t l[b,t] m[b,t]) / N_seq``.
    * ``seq-mean-token-mean``: ``sum_b (sum_t l[b,t] m[b,t] / sum_t m[b,t]) / N_seq``
      (the per-sequence mean over that sequence's own valid tokens; the GRPO paper's loss).
    * ``seq-mean-token-sum-norm``: ``sum(l * m) / (N_seq * horizon)`` (Dr. GRPO: a constant
      horizon instead of each sequence's length). ``horizon`` defaults to ``mask.shape[-1]``;
      pass the max response length when micro-batches are padded to different lengths, or the
      result depends on the padding.

    Counts: ``num_tokens`` / ``num_seqs`` are the GLOBAL counts of the whole mini-batch (every
    micro-batch on every DP rank, as from `count_tokens_and_seqs`); then the values returned for
    all micro-batches on all ranks SUM to the global mean, and so do their gradients. ``None``
    uses the local counts of this call (single-process behaviour). A sequence is a row with at
    least one valid token: fully masked rows contribute 0 and are not counted. A count of 0
    (nothing valid anywhere) gives a loss of 0, not NaN.

    Raises:
        ValueError: for an unknown ``mode`` (the message lists the valid ones) or shape mismatch.
    """
    if mode not in LOSS_AGG_MODES:
        raise ValueError(f"unknown loss aggregation mode {mode!r}; valid modes: {', '.join(LOSS_AGG_MODES)}")
    _check_same_shape(loss=loss, mask=mask)
    if loss.dim() != 2:
        raise ValueError(f"loss must be [B, T], got shape {tuple(loss.shape)}")
    valid = mask.bool()
    masked = torch.where(valid, loss, torch.zeros_like(loss))
    local_tokens, local_seqs = count_tokens_and_seqs(valid)
    num_tokens = local_tokens if num_tokens is None else num_tokens
    num_seqs = local_seqs if num_seqs is None else num_seqs

    if mode == "token-mean":
        return masked.sum() / _as_denominator(num_tokens, loss)
    if mode == "seq-mean-token-sum":
        return masked.sum() / _as_denominator(num_seqs, loss)
    if mode == "seq-mean-token-mean":
        tokens_per_seq = valid.sum(dim=-1).to(loss.dtype).clamp_min(1)
        return (masked.sum(dim=-1) / tokens_per_seq).sum() / _as_denominator(num_seqs, loss)
    # seq-mean-token-sum-norm
    if horizon is None:
        horizon = loss.shape[-1]  # 0 for zero-length responses: then the numerator is 0 too
    elif isinstance(horizon, (int, float)) and not horizon > 0:
        raise ValueError(f"horizon must be > 0, got {horizon}")
    return masked.sum() / (_as_denominator(num_seqs, loss) * _as_denominator(horizon, loss))


# ----------------------------------------------------------------------------------------------
# KL estimators and entropy
# ----------------------------------------------------------------------------------------------


def kl_penalty(
    log_probs: torch.Tensor,
    ref_log_probs: torch.Tensor,
    kind: str,
    mask: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Per-token estimate of KL(pi || pi_ref) from the log-probs of tokens sampled from pi.

    With ``d = logp - ref_logp``:

    * ``k1``: ``d`` (unbiased, high variance, can be negative);
    * ``abs``: ``|d|``;
    * ``k2`` / ``mse``: ``0.5 * d^2``;
    * ``k3`` / ``low_var_kl``: ``exp(-d) - (-d) - 1`` (Schulman's unbiased, non-negative,
      low-variance estimator), with ``-d`` clamped to [-20, 20] before ``exp`` and the result
      clamped to [-10, 10] as is customary (verl).

    Args:
        mask: optional ``[B, T]``; when given, masked positions return 0 with zero gradient even
            if their inputs are garbage. Without it the estimate is computed everywhere.
    """
    if kind not in KL_KINDS:
        raise ValueError(f"unknown KL estimator {kind!r}; valid kinds: {', '.join(KL_KINDS)}")
    _check_same_shape(log_probs=log_probs, ref_log_probs=ref_log_probs)
    if mask is not None:
        _check_same_shape(log_probs=log_probs, mask=mask)
        diff = log_probs - ref_log_probs
        diff = torch.where(mask.bool(), diff, torch.zeros_like(diff))
    else:
        diff = log_probs - ref_log_probs

    if kind == "k1":
        return diff
    if kind == "abs":
        return diff.abs()
    if kind in ("k2", "mse"):
        return 0.5 * diff.square()
    # k3 / low_var_kl
    log_ratio = (-diff).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)  # log(pi_ref / pi)
    return (torch.exp(log_ratio) - log_ratio - 1).clamp(-_K3_CLAMP, _K3_CLAMP)


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of ``softmax(logits)`` over the last dim: ``logsumexp(z) - sum(softmax(z) * z)``.

    Numerically stable for large logits (no ``log(softmax)`` of tiny probabilities), and logits of
    ``-inf`` (e.g. masked vocabulary padding) contribute 0 instead of ``0 * -inf = NaN``.
    Half-precision inputs are computed and returned in float32.
    """
    dtype = torch.promote_types(logits.dtype, torch.float32)
    z = logits.to(dtype)
    probs = torch.softmax(z, dim=-1)
    # Replace -inf by 0 before the product; its probability is 0 so the value is unchanged, and
    # the backward of the product no longer multiplies by -inf.
    finite_z = torch.where(torch.isneginf(z), torch.zeros_like(z), z)
    return torch.logsumexp(z, dim=-1) - (probs * finite_z).sum(dim=-1)

