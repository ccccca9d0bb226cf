"""Sequence-level masked importance sampling (MIS): which sequences an off-policy batch may train on.

Three policies meet in an update (decoupled PPO, Hilton et al. 2021; AReaL's decoupled objective):

* the behaviour policy ``mu``: the engine that sampled the response; its log-probs are the batch's
  ``rollout_log_probs``. Under asynchronous training (``trainer.max_staleness > 0``) it may be
  weights several updates old, and always differs a little from the trainer's kernels;
* the proximal policy ``pi_old``: the actor at the weights the update starts from; its log-probs
  are the ``old_log_probs`` the trainer recomputes. The PPO clip term is taken against it;
* the current policy ``pi_theta``, being optimised.

The clip term handles ``pi_old -> pi_theta``; the gap ``mu -> pi_old`` needs its own correction:
the token-level truncated IS weight ``min(pi_old / mu, tis_cap)`` (`mismatch.truncated_is_weights`,
``algorithm.tis_cap``) or this module's sequence mask (``algorithm.mis``), or both.

    sm = sequence_mask(old_log_probs, rollout_log_probs, loss_mask, low=0.999, high=1.001)
    loss_mask = sm.loss_mask                     # rejected sequences: out of the loss and its counts
    metrics.update(masked_is_stats(sm.sums()))   # mis/{masked_frac,masked_token_frac,ratio_mean}

Per sequence ``i`` with loss tokens ``T_i`` and ``d_t = log pi_old(y_t) - log mu(y_t)``::

    rho_i = exp( (1 / |T_i|) * sum_{t in T_i} d_t )       # the GEOMETRIC MEAN of the token ratios
    keep_i = low <= rho_i <= high                          # both bounds inclusive
    loss mask of sequence i  <-  its loss mask AND keep_i   (kept sequences are NOT reweighted)

Why the geometric mean and not the product ``prod_t pi_old / mu`` (the exact sequence likelihood
ratio): the log of the product is a sum over the response, ``~ -|T| * KL(mu || pi_old) +-
sqrt(|T|) * sigma``, so a fixed band on it keeps nearly every short response and rejects nearly
every long one, whatever the per-token gap. DAPO's responses run to tens of thousands of tokens and
stale weights widen the gap at every token, so a band on the product would be a length filter on
exactly the long reasoning samples DAPO trains on (the "length trap" of Liu, Li et al. 2025, "When
speed kills stability", part 3). The geometric mean is the per-token average deviation: one band
means the same for a 50-token and a 20,000-token response. This is verl's geometric rejection
(``rollout_rs=seq_mean_k1``, presets ``[0.999, 1.001]``).

Why kept sequences are not weighted: the geometric mean is not an importance weight (reweighting by
it estimates nothing), and weighting by the product would bring back the exponential variance the
mask avoids. Inside the band the behaviour policy is within a bounded per-token distance of the
proximal one; for a per-token IS weight on the kept tokens as well, set ``algorithm.tis_cap`` too
(verl's ``decoupled_geo_rs_token_tis``).

Why rejected tokens leave the token-mean's denominator: a rejected sequence is treated like one the
batch never had, the same as ``algorithm.overlong_filter`` and dynamic sampling: DAPO's token-mean
is over the tokens that train, each weighing ``1 / N`` with ``N`` the kept loss tokens of the
mini-batch. Keeping them in ``N`` would scale the update down by the rejected share, coupling the
step size to the staleness (verl and slime exclude them; slime's PR 657 fixed exactly that).

Exactness. The keep decision is taken twice, once on the whole mini-batch for the global counts
and once per micro-batch inside the loss, on different widths and possibly different devices; it
must agree bit for bit or the counts and the loss disagree about a sequence on the boundary. So the
sum over tokens is done in fixed point: each ``d_t`` (float64, clamped to +-``LOG_RATIO_CLAMP``) is
rounded to an integer multiple of ``2**-32`` and summed in int64, which is exact and independent of
order, width and device; the band is compared as ``|T_i| * round(log(low) * 2**32) <= sum <=
|T_i| * round(log(high) * 2**32)``. A NaN log-prob makes its token count as ``+LOG_RATIO_CLAMP``,
which rejects the sequence for any sensible band.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch

from megatron_dapo.algorithm.loss import LOG_RATIO_CLAMP

__all__ = ["MIS_STAT_NAMES", "SequenceMask", "check_band", "masked_is_stats", "off_policy_loss_mask", "sequence_mask"]

_SCALE_BITS = 32
"""Fixed-point resolution of the per-token log-ratio: 2**-32 ~ 2.3e-10. With |d| <= 20 a sum stays
inside int64 for responses of up to ~10**8 tokens."""
_SCALE = float(2**_SCALE_BITS)

MIS_STAT_NAMES = ("seqs", "masked_seqs", "tokens", "masked_tokens", "ratio_sum")
"""Entries of `SequenceMask.sums`: sequences with a loss token, those rejected, their loss tokens,
the rejected ones' tokens, and the sum over sequences of ``rho_i``. Sums, so that micro-batches and
data-parallel ranks add up exactly."""


def check_band(low: float, high: float) -> None:
    """The band must hold the on-policy ratio 1 strictly inside: ``0 < low < 1 < high``."""
    if not (0 < low < 1 < high) or not math.isfinite(high):
        raise ValueError(f"the masked-IS band must satisfy 0 < low < 1 < high (finite), got low={low}, high={high}")


def _fixed(value: float) -> int:
    return int(round(value * _SCALE))


@dataclass(frozen=True)
class SequenceMask:
    """The keep decision of a batch of sequences (all tensors on the inputs' device)."""

    keep: torch.Tensor
    """``[n]`` bool: sequences with at least one loss token and ``low <= rho <= high``."""
    has_tokens: torch.Tensor
    """``[n]`` bool: sequences with at least one loss token (the others are neither kept nor masked)."""
    ratio: torch.Tensor
    """``[n]`` float64: ``rho``, the geometric mean of ``pi_old / mu`` over the loss tokens (1 without tokens)."""
    tokens: torch.Tensor
    """``[n]`` int64: loss tokens of each sequence (before the mask)."""
    loss_mask: torch.Tensor
    """``[n, W]`` bool: the input mask with the rejected sequences' rows cleared."""

    def sums(self) -> torch.Tensor:
        """float64 ``[len(MIS_STAT_NAMES)]``: the statistics as sums (`MIS_STAT_NAMES`)."""
        masked = self.has_tokens & ~self.keep
        return torch.stack(
            [
                self.has_tokens.sum(),
                masked.sum(),
                self.tokens.sum(),
                torch.where(masked, self.tokens, 0).sum(),
                torch.where(self.has_tokens, self.ratio, 0.0).sum(),
            ]
        ).to(torch.float64)


def sequence_mask(
    trainer_old_log_probs: torch.Tensor,
    rollout_log_probs: torch.Tensor,
    mask: torch.Tensor,
    low: float,
    high: float,
) -> SequenceMask:
    """Reject the sequences whose geometric-mean ratio ``pi_old / mu`` lies outside ``[low, high]``.

    Args:
        trainer_old_log_probs: ``[n, W]`` the proximal policy's log-probs (the actor's ``old_log_probs``).
        rollout_log_probs: ``[n, W]`` the behaviour policy's (the engine's) log-probs of the same tokens.
        mask: ``[n, W]`` bool, the loss tokens; other positions may hold anything.
        low, high: the band (`check_band`), e.g. ``algorithm.mis.low`` / ``high``.

    No gradient flows (the log-probs are data); the result is on the device of
    ``trainer_old_log_probs``. See the module docstring for the formula, the choice of the
    geometric mean and the fixed-point sum that makes the decision exact.
    """
    check_band(low, high)
    shapes = {tuple(trainer_old_log_probs.shape), tuple(rollout_log_probs.shape), tuple(mask.shape)}
    if len(shapes) != 1 or trainer_old_log_probs.dim() != 2:
        raise ValueError(
            "trainer_old_log_probs, rollout_log_probs and mask must be [n, W] of one shape, got "
            f"{tuple(trainer_old_log_probs.shape)}, {tuple(rollout_log_probs.shape)} and {tuple(mask.shape)}"
        )
    device = trainer_old_log_probs.device
    valid = mask.to(device).bool()
    with torch.no_grad():
        d = trainer_old_log_probs.detach().double() - rollout_log_probs.detach().to(device).double()
        d = torch.nan_to_num(d, nan=LOG_RATIO_CLAMP).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
        units = torch.round(torch.where(valid, d, 0.0) * _SCALE).to(torch.int64)
        total = units.sum(dim=-1)
        tokens = valid.sum(dim=-1)
        has_tokens = tokens > 0
        # Bounds past the clamp bind no sequence; clamping them keeps tokens * bound inside int64.
        lower = _fixed(max(math.log(low), -LOG_RATIO_CLAMP))
        upper = _fixed(min(math.log(high), LOG_RATIO_CLAMP))
        keep = has_tokens & (total >= tokens * lower) & (total <= tokens * upper)
        mean = total.double() / (tokens.clamp_min(1).double() * _SCALE)
        ratio = torch.where(has_tokens, torch.exp(mean), 1.0)
    return SequenceMask(keep=keep, has_tokens=has_tokens, ratio=ratio, tokens=tokens, loss_mask=valid & keep[:, None])


def masked_is_stats(sums: torch.Tensor, prefix: str = "mis/") -> dict[str, float]:
    """Loggable means of `SequenceMask.sums` (summed over micro-batches and ranks first).

    ``{prefix}masked_frac``: rejected sequences / sequences with a loss token;
    ``{prefix}masked_token_frac``: their loss tokens / all loss tokens (before the mask);
    ``{prefix}ratio_mean``: mean of ``rho`` over the sequences with a loss token. 0 without sequences.
    """
    if tuple(sums.shape) != (len(MIS_STAT_NAMES),):
        raise ValueError(f"expected {len(MIS_STAT_NAMES)} sums, got shape {tuple(sums.shape)}")
    seqs, masked_seqs, tokens, masked_tokens, ratio_sum = (float(v) for v in sums.double().cpu())
    return {
        f"{prefix}masked_frac": masked_seqs / seqs if seqs else 0.0,
        f"{prefix}masked_token_frac": masked_tokens / tokens if tokens else 0.0,
        f"{prefix}ratio_mean": ratio_sum / seqs if seqs else 0.0,
    }


def off_policy_loss_mask(
    mask: torch.Tensor,
    trainer_old_log_probs: Optional[torch.Tensor],
    rollout_log_probs: Optional[torch.Tensor],
    band: Optional[tuple[float, float]],
) -> torch.Tensor:
    """The loss mask after the sequence mask (``band`` None: ``mask`` itself, as bool).

    What the actor counts the mini-batch's global loss tokens and sequences from, so that the
    token-mean's denominator leaves out the rejected sequences exactly as the loss does."""
    if band is None:
        return mask.bool()
    if trainer_old_log_probs is None or rollout_log_probs is None:
        raise ValueError("algorithm.mis needs the batch's old_log_probs and rollout_log_probs")
    return sequence_mask(trainer_old_log_probs, rollout_log_probs, mask, *band).loss_mask
