"""The micro-batch objective as it was before the off-policy corrections were made selectable
(`megatron_dapo/actor/objective.py` at commit f3f9c19), frozen verbatim for
tests/actor/test_off_policy_objective.py: with the masked IS off the objective must give this
function's loss, gradient and statistics bit for bit. Not collected by pytest (no test_ prefix);
do not edit the body."""

from __future__ import annotations

from typing import Optional

import torch

from megatron_dapo.algorithm.loss import aggregate, kl_penalty, policy_loss
from megatron_dapo.algorithm.mismatch import truncated_is_weights

STAT_NAMES_BEFORE = (
    "loss",
    "pg_loss",
    "entropy_loss",
    "kl_loss",
    "entropy_sum",
    "kl_sum",
    "tis_weight_sum",
    "tis_capped_sum",
    "clipfrac_sum",
    "clipfrac_high_sum",
    "clipfrac_low_sum",
    "dual_clipfrac_sum",
    "approx_kl_sum",
    "num_tokens",
)
"""The statistics vector's layout then (the policy-loss fields spelt out)."""


def micro_batch_objective_before(
    log_probs: torch.Tensor,
    entropy: Optional[torch.Tensor],
    micro_batch,
    settings,
    counts,
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
        sums = torch.cat([sums, policy_stats.to_tensor().to(sums.device)])
    return loss, sums
