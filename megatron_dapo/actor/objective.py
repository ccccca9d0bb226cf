"""The RL objective of one micro-batch, normalised by GLOBAL counts so that micro-batches add up exactly.

    loss, sums = micro_batch_objective(log_probs, entropy, micro_batch, settings, counts)

``counts`` holds the number of loss tokens and sequences of the whole mini-batch (every micro-batch
on every data-parallel rank). Each micro-batch's loss is then its share of the global mean, so the
sum over micro-batches and ranks - which is what Megatron's schedule and DDP compute when they are
told not to rescale (see `actor.optim`) - is exactly the loss of the whole mini-batch, whatever
the split. The same holds for the statistics: ``sums`` is a float64 vector of per-micro-batch sums
(`STAT_NAMES`) that adds up across micro-batches and ranks and is turned into means once at the end
(`summarise`).

Objective, per token with mask ``m`` (``aggregate`` reduces with ``algorithm.loss_agg_mode``)::

    m     = m & keep(sequence)                          # masked IS (algorithm.mis), when enabled
    pg    = policy_loss(logp, old_logp, A)              # clip-higher + dual-clip (algorithm/loss.py)
    pg    = pg * min(exp(old_logp - rollout_logp), tis_cap)    # truncated IS, when enabled
    loss  = agg(pg) - entropy_coeff * agg(H) + kl_coef * agg(kl(logp, ref_logp))

``old_logp`` is the proximal policy (the actor at the weights the update starts from) and
``rollout_logp`` the behaviour policy (the engine that sampled): decoupled PPO, docs/ASYNC.md
"Off-policy correction". ``keep`` rejects whole sequences whose geometric-mean ratio
``pi_old / pi_rollout`` leaves ``[mis.low, mis.high]`` (`algorithm.off_policy`); their tokens leave
the loss and the global counts alike (`loss_mask` is what the actor counts from). With neither
correction enabled the objective is the plain (coupled) one, unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Optional

import torch

from megatron_dapo.actor.batch import MicroBatch, PolicyBatch
from megatron_dapo.algorithm.defaults import CLIP_C, CLIP_HIGH, CLIP_LOW
from megatron_dapo.algorithm.loss import PolicyLossStats, aggregate, kl_penalty, policy_loss
from megatron_dapo.algorithm.mismatch import truncated_is_weights
from megatron_dapo.algorithm.off_policy import MIS_STAT_NAMES, masked_is_stats, off_policy_loss_mask, sequence_mask

__all__ = ["GlobalCounts", "ObjectiveSettings", "STAT_NAMES", "loss_mask", "micro_batch_objective", "summarise"]

_POLICY_FIELDS = tuple(f.name for f in fields(PolicyLossStats))
STAT_NAMES = (
    "loss",
    "pg_loss",
    "entropy_loss",
    "kl_loss",
    "entropy_sum",
    "kl_sum",
    "tis_weight_sum",
    "tis_capped_sum",
    *(f"mis_{name}" for name in MIS_STAT_NAMES),
    *_POLICY_FIELDS,
)
"""Entries of the statistics vector. The ``*_loss`` entries are already globally normalised (their
sum is the mini-batch value); ``*_sum`` entries and the policy-loss statistics are token sums."""


@dataclass(frozen=True)
class ObjectiveSettings:
    """The loss terms and their constants (from `config.AlgorithmConfig`)."""

    clip_low: float = CLIP_LOW
    clip_high: float = CLIP_HIGH
    clip_c: Optional[float] = CLIP_C
    loss_agg_mode: str = "token-mean"
    entropy_coeff: float = 0.0
    use_kl_loss: bool = False
    kl_coef: float = 0.001
    kl_type: str = "low_var_kl"
    tis_cap: Optional[float] = None
    mis: Optional[tuple[float, float]] = None
    """``(low, high)`` of the sequence-level masked IS (``algorithm.mis``); None disables it."""
    sft: bool = False
    """Supervised fine-tuning: the loss is the cross-entropy of the response tokens (``-log p``),
    aggregated like the policy loss; advantages and old log-probs are not needed (`megatron-dapo sft`)."""
    horizon: Optional[int] = None
    """Constant horizon of ``seq-mean-token-sum-norm`` (the max response length); None: the batch's
    response width. Micro-batches are trimmed to their own longest response, so it is always passed."""

    @classmethod
    def from_config(cls, algorithm, horizon: Optional[int] = None) -> "ObjectiveSettings":
        """From a `config.AlgorithmConfig`."""
        return cls(
            clip_low=algorithm.clip_low,
            clip_high=algorithm.clip_high,
            clip_c=algorithm.clip_c,
            loss_agg_mode=algorithm.loss_agg_mode,
            entropy_coeff=algorithm.entropy_coeff,
            use_kl_loss=algorithm.kl.use_kl_loss,
            kl_coef=algorithm.kl.coef,
            kl_type=algorithm.kl.type,
            tis_cap=algorithm.tis_cap,
            mis=(algorithm.mis.low, algorithm.mis.high) if algorithm.mis.enable else None,
            horizon=horizon,
        )


@dataclass(frozen=True)
class GlobalCounts:
    """Loss tokens and sequences (with at least one loss token) of the whole mini-batch, all ranks."""

    num_tokens: float
    num_seqs: float
    response_width: int
    """``R`` of the mini-batch: the default horizon of ``seq-mean-token-sum-norm``."""


def loss_mask(batch: PolicyBatch, settings: ObjectiveSettings) -> torch.Tensor:
    """``[n, R]`` bool: the tokens of ``batch`` that enter the loss under ``settings``.

    The batch's loss mask less the sequences the masked IS rejects (``settings.mis``), decided
    exactly as `micro_batch_objective` decides them: count the global loss tokens and sequences
    from it. On the device of ``batch.old_log_probs`` when the mask applies."""
    if settings.sft:
        return batch.loss_mask()
    return off_policy_loss_mask(batch.loss_mask(), batch.old_log_probs, batch.rollout_log_probs, settings.mis)


def micro_batch_objective(
    log_probs: torch.Tensor,
    entropy: Optional[torch.Tensor],
    micro_batch: MicroBatch,
    settings: ObjectiveSettings,
    counts: GlobalCounts,
) -> tuple[torch.Tensor, torch.Tensor]:
    """This micro-batch's share of the mini-batch loss, and its statistics vector (`STAT_NAMES`).

    Args:
        log_probs: ``[k, W]`` current log-probs of the response tokens (differentiable).
        entropy: ``[k, W]`` entropy of the current policy at those positions, or None.
        micro_batch: supplies the loss mask, old / reference / rollout log-probs and advantages.
    """
    mb = micro_batch
    if not settings.sft and (mb.old_log_probs is None or mb.advantages is None):
        raise ValueError("the update needs old_log_probs and advantages in the PolicyBatch")
    mask = mb.loss_mask
    mis_sums = torch.zeros(len(MIS_STAT_NAMES), dtype=torch.float64, device=log_probs.device)
    if settings.mis is not None:
        if mb.rollout_log_probs is None or mb.old_log_probs is None:
            raise ValueError("algorithm.mis is set but the PolicyBatch carries no rollout_log_probs / old_log_probs")
        # The batch's own log-probs (not cast to the model's dtype): the same decision as `loss_mask`.
        rejection = sequence_mask(mb.old_log_probs, mb.rollout_log_probs, mask, *settings.mis)
        mask, mis_sums = rejection.loss_mask, rejection.sums()
    agg = dict(
        mode=settings.loss_agg_mode,
        num_tokens=counts.num_tokens,
        num_seqs=counts.num_seqs,
        horizon=settings.horizon or counts.response_width,
    )
    if settings.sft:
        # Cross-entropy; the policy statistics of a ratio of 1 only count the tokens (no clipping).
        detached = log_probs.detach()
        _, policy_stats = policy_loss(detached, detached, torch.zeros_like(detached), mask)
        pg, old = -log_probs, detached
    else:
        old = mb.old_log_probs.to(log_probs.dtype)
        advantages = mb.advantages.to(log_probs.dtype)
        pg, policy_stats = policy_loss(
            log_probs, old, advantages, mask, clip_low=settings.clip_low, clip_high=settings.clip_high, clip_c=settings.clip_c
        )
    zero = log_probs.new_zeros(())
    tis_weight_sum, tis_capped_sum = zero, zero
    if settings.tis_cap is not None:
        if mb.rollout_log_probs is None:
            raise ValueError("algorithm.tis_cap is set but the PolicyBatch carries no rollout_log_probs")
        # The same weights (and "capped" = at the cap) as the logged `truncated_is_stats`; 0 on masked tokens.
        weight = truncated_is_weights(old, mb.rollout_log_probs.to(old.dtype), settings.tis_cap, mask)
        pg = pg * weight  # the weight is data (no gradient), as in the IS estimator
        tis_weight_sum = weight.sum()
        tis_capped_sum = (mask & (weight >= torch.tensor(settings.tis_cap, dtype=weight.dtype))).sum().to(log_probs.dtype)
    pg_loss = aggregate(pg, mask, **agg)
    loss = pg_loss

    entropy_loss, entropy_sum = zero, zero
    if entropy is not None:
        entropy_loss = aggregate(entropy, mask, **agg)
        entropy_sum = torch.where(mask, entropy, 0.0).sum()
        if settings.entropy_coeff:
            loss = loss - settings.entropy_coeff * entropy_loss

    kl_loss, kl_sum = zero, zero
    if settings.use_kl_loss:
        if mb.ref_log_probs is None:
            raise ValueError("algorithm.kl.use_kl_loss is set but the PolicyBatch carries no ref_log_probs")
        kl = kl_penalty(log_probs, mb.ref_log_probs.to(log_probs.dtype), settings.kl_type, mask)
        kl_loss = aggregate(kl, mask, **agg)
        kl_sum = kl.sum()  # kl_penalty is 0 on masked tokens
        loss = loss + settings.kl_coef * kl_loss

    with torch.no_grad():
        sums = torch.stack(
            [
                loss.detach().double(),
                pg_loss.detach().double(),
                entropy_loss.detach().double(),
                kl_loss.detach().double(),
                entropy_sum.detach().double(),
                kl_sum.detach().double(),
                tis_weight_sum.double(),
                tis_capped_sum.double(),
            ]
        )
        sums = torch.cat([sums, mis_sums.to(sums.device), policy_stats.to_tensor().to(sums.device)])
    return loss, sums


def summarise(sums: torch.Tensor) -> dict[str, float]:
    """Means of a statistics vector summed over micro-batches and ranks (Python floats for logging).

    Keys: ``loss``, ``pg_loss``, ``entropy_loss``, ``kl_loss`` (the mini-batch objective terms under the
    aggregation mode), ``entropy`` and ``kl`` (token means), ``tis_weight_mean``, ``tis_capped_frac``,
    ``mis_masked_frac``, ``mis_masked_token_frac``, ``mis_ratio_mean`` (`off_policy.masked_is_stats`),
    ``clipfrac``, ``clipfrac_high``, ``clipfrac_low``, ``dual_clipfrac``, ``approx_kl``, ``tokens``.
    Means over tokens are over the tokens in the loss (after the masked IS).
    """
    if sums.shape != (len(STAT_NAMES),):
        raise ValueError(f"expected a statistics vector of {len(STAT_NAMES)} entries, got {tuple(sums.shape)}")
    named = dict(zip(STAT_NAMES, sums.double().cpu()))
    policy = PolicyLossStats.from_tensor(sums[len(STAT_NAMES) - len(_POLICY_FIELDS):].double().cpu())
    tokens = float(policy.num_tokens)
    per_token = max(tokens, 1.0)
    out = {name: float(named[name]) for name in ("loss", "pg_loss", "entropy_loss", "kl_loss")}
    out.update(
        entropy=float(named["entropy_sum"]) / per_token,
        kl=float(named["kl_sum"]) / per_token,
        tis_weight_mean=float(named["tis_weight_sum"]) / per_token,
        tis_capped_frac=float(named["tis_capped_sum"]) / per_token,
        tokens=tokens,
    )
    mis = torch.stack([named[f"mis_{name}"] for name in MIS_STAT_NAMES])
    out.update(masked_is_stats(mis, prefix="mis_"))
    out.update(policy.means())
    return out
