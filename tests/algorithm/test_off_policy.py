"""Sequence-level masked importance sampling (`algorithm.off_policy`) against the formula computed
by hand in float64: rho_i = exp(mean over the loss tokens of log pi_old - log pi_rollout), kept iff
low <= rho_i <= high; and the config rule that asynchronous training needs a correction."""

from __future__ import annotations

import math

import pytest
import torch

from megatron_dapo.algorithm.off_policy import (
    MIS_STAT_NAMES,
    masked_is_stats,
    off_policy_loss_mask,
    sequence_mask,
)
from megatron_dapo.config import ConfigError, load_config

UNIT = 2.0**-32  # the fixed-point step of the per-token log-ratio


def _by_hand(old_rows, rollout_rows, mask_rows, low, high):
    """Per sequence (ratio, kept, tokens) from Python floats: the paper's formula, nothing shared."""
    out = []
    for old, rollout, mask in zip(old_rows, rollout_rows, mask_rows):
        d = [o - r for o, r, m in zip(old, rollout, mask) if m]
        if not d:
            out.append((1.0, False, 0))
            continue
        ratio = math.exp(math.fsum(d) / len(d))
        out.append((ratio, low <= ratio <= high, len(d)))
    return out


def _hand_made_batch():
    """Six sequences of width 6 (old, rollout, loss mask) chosen to land on either side of the band."""
    nan, inf = float("nan"), float("inf")
    old = [
        [-1.0, -2.0, -0.5, -1.5, 0.0, 0.0],  # 0: rollout a hair off at every token: kept
        [-1.0, -1.0, -1.0, -1.0, -1.0, -1.0],  # 1: pi_old 1% likelier at every token: masked (high)
        [-0.3, -0.3, -0.3, nan, inf, 7.0],  # 2: pi_old 0.8% less likely; garbage past the loss tokens: masked (low)
        [-2.0, -2.0, -2.0, -2.0, -2.0, -2.0],  # 3: one token far off, the others balance it: kept
        [-1.0, -1.0, 0.0, 0.0, 0.0, 0.0],  # 4: no loss token: neither kept nor masked
        [-0.7, -0.7, -0.7, -0.7, -0.7, -0.7],  # 5: the response's first token is out of the loss (overlong-style)
    ]
    rollout = [
        [-1.0002, -2.0001, -0.4999, -1.5003, 0.0, 0.0],
        [-1.01, -1.01, -1.01, -1.01, -1.01, -1.01],
        [-0.292, -0.292, -0.292, 0.0, 0.0, 0.0],
        [-2.03, -1.99, -1.99, -1.99, -2.0, -2.0],
        [-1.5, -1.5, 0.0, 0.0, 0.0, 0.0],
        [-9.0, -0.7003, -0.6998, -0.7, -0.7001, -0.7],
    ]
    mask = [
        [True, True, True, True, False, False],
        [True] * 6,
        [True, True, True, False, False, False],
        [True, True, True, True, False, False],
        [False] * 6,
        [False, True, True, True, True, True],
    ]
    return old, rollout, mask


def test_the_mask_on_a_hand_made_batch():
    old, rollout, mask = _hand_made_batch()
    low, high = 0.995, 1.005
    result = sequence_mask(
        torch.tensor(old, dtype=torch.float64), torch.tensor(rollout, dtype=torch.float64), torch.tensor(mask), low, high
    )
    expected = _by_hand(old, rollout, mask, low, high)
    assert [kept for _, kept, _ in expected] == [True, False, False, True, False, True]  # the batch is what it says
    assert result.keep.tolist() == [kept for _, kept, _ in expected]
    assert result.has_tokens.tolist() == [n > 0 for _, _, n in expected]
    assert result.tokens.tolist() == [n for _, _, n in expected]
    for got, (ratio, _, _) in zip(result.ratio.tolist(), expected):
        assert got == pytest.approx(ratio, rel=1e-9, abs=0)  # the fixed point resolves 2**-32 in log space
    # The loss mask keeps the kept sequences' own loss tokens, nothing else.
    for row, (_, kept, _) in enumerate(expected):
        assert result.loss_mask[row].tolist() == [m and kept for m in mask[row]]
    # Statistics: sums that the means are read from.
    seqs = sum(1 for _, _, n in expected if n)
    masked = [(n, r) for r, kept, n in expected if n and not kept]
    sums = dict(zip(MIS_STAT_NAMES, result.sums().tolist()))
    assert sums["seqs"] == seqs == 5
    assert sums["masked_seqs"] == len(masked) == 2
    assert sums["tokens"] == sum(n for _, _, n in expected)
    assert sums["masked_tokens"] == sum(n for n, _ in masked) == 9
    assert sums["ratio_sum"] == pytest.approx(sum(r for r, _, n in expected if n), rel=1e-9)
    stats = masked_is_stats(result.sums())
    assert stats["mis/masked_frac"] == pytest.approx(2 / 5)
    assert stats["mis/masked_token_frac"] == pytest.approx(9 / sums["tokens"])
    assert stats["mis/ratio_mean"] == pytest.approx(sum(r for r, _, n in expected if n) / 5, rel=1e-9)


def test_geometric_mean_is_length_invariant_where_the_product_is_not():
    """A long and a short response with the same per-token gap get the same decision; the product of
    the long one's ratios (e^4) would be far outside any band that keeps the short one."""
    width = 4000
    gap = 0.001  # pi_old / pi_rollout = e^0.001 per token
    old = torch.full((2, width), -1.0, dtype=torch.float64)
    rollout = old - gap
    mask = torch.zeros((2, width), dtype=torch.bool)
    mask[0, :] = True
    mask[1, :5] = True
    result = sequence_mask(old, rollout, mask, 0.998, 1.002)
    assert result.keep.tolist() == [True, True]
    assert result.ratio.tolist() == pytest.approx([math.exp(gap)] * 2, rel=1e-9)
    assert math.exp(gap * width) > 50  # the product the docstring argues against
    assert sequence_mask(old, rollout, mask, 0.99, 1.0005).keep.tolist() == [False, False]


@pytest.mark.parametrize("bound", ["low", "high"])
def test_band_edges_are_inclusive_to_the_last_unit(bound):
    low, high = 0.99, 1.01
    edge = round(math.log(low if bound == "low" else high) * 2**32)  # the bound in fixed-point units
    outward = -1 if bound == "low" else 1
    # Three tokens whose log-ratios (exact multiples of 2**-32) average exactly to the bound, and the
    # same one unit further out in total.
    on = [edge - 5, edge + 2, edge + 3]
    off = [edge - 5, edge + 2, edge + 3 + outward]
    rollout = torch.full((2, 3), -1.0, dtype=torch.float64)
    old = rollout + torch.tensor([on, off], dtype=torch.float64) * UNIT
    assert ((old - rollout) / UNIT).tolist() == [on, off]  # exact in float64
    result = sequence_mask(old, rollout, torch.ones((2, 3), dtype=torch.bool), low, high)
    assert result.keep.tolist() == [True, False]


def test_the_decision_does_not_depend_on_token_order_or_width():
    """The counts take the decision on the whole mini-batch, the loss on each micro-batch (trimmed to
    its longest response, maybe on another device): the fixed-point sum makes them agree exactly."""
    g = torch.Generator().manual_seed(7)
    n, width = 64, 300
    lengths = torch.randint(1, width + 1, (n,), generator=g)
    valid = torch.arange(width)[None, :] < lengths[:, None]
    old = -torch.rand(n, width, generator=g, dtype=torch.float64) * 4
    rollout = old - 1e-3 * torch.randn(n, width, generator=g, dtype=torch.float64) - 2e-4 * torch.randn(n, 1, generator=g, dtype=torch.float64)
    band = (0.9999, 1.0001)
    whole = sequence_mask(old, rollout, valid, *band)
    assert 0 < int(whole.keep.sum()) < n  # both outcomes occur
    # Columns permuted (mask alike), and wider with garbage where the mask is False.
    perm = torch.randperm(width, generator=g)
    permuted = sequence_mask(old[:, perm], rollout[:, perm], valid[:, perm], *band)
    pad = torch.full((n, 50), float("nan"), dtype=torch.float64)
    wider = sequence_mask(torch.cat([old, pad], 1), torch.cat([rollout, -pad], 1), torch.cat([valid, torch.zeros((n, 50), dtype=torch.bool)], 1), *band)
    # Rows in micro-batches trimmed to their own longest response.
    rows = [list(range(0, n, 3)), list(range(1, n, 3)), list(range(2, n, 3))]
    for result in (permuted, wider):
        assert torch.equal(result.keep, whole.keep) and torch.equal(result.sums(), whole.sums())
    for part in rows:
        w = int(lengths[part].max())
        trimmed = sequence_mask(old[part, :w], rollout[part, :w], valid[part, :w], *band)
        assert torch.equal(trimmed.keep, whole.keep[part])


def test_loss_mask_helper_and_input_checks():
    old, rollout, mask = (torch.tensor(x, dtype=torch.float64) if i < 2 else torch.tensor(x) for i, x in enumerate(_hand_made_batch()))
    assert torch.equal(off_policy_loss_mask(mask, old, rollout, None), mask)
    assert torch.equal(off_policy_loss_mask(mask, old, rollout, (0.995, 1.005)), sequence_mask(old, rollout, mask, 0.995, 1.005).loss_mask)
    with pytest.raises(ValueError, match="rollout_log_probs"):
        off_policy_loss_mask(mask, old, None, (0.995, 1.005))
    for low, high in [(0.0, 2.0), (1.0, 2.0), (0.5, 1.0), (0.5, float("inf")), (1.5, 0.5)]:
        with pytest.raises(ValueError, match="0 < low < 1 < high"):
            sequence_mask(old, rollout, mask, low, high)
    with pytest.raises(ValueError, match="one shape"):
        sequence_mask(old, rollout[:, :3], mask, 0.5, 2.0)
    # The log-probs are data: no graph, whatever their requires_grad.
    result = sequence_mask(old.clone().requires_grad_(True), rollout, mask, 0.995, 1.005)
    assert not result.ratio.requires_grad
    # Nothing to count: zeros, never NaN.
    empty = sequence_mask(old, rollout, torch.zeros_like(mask), 0.995, 1.005)
    assert masked_is_stats(empty.sums()) == {"mis/masked_frac": 0.0, "mis/masked_token_frac": 0.0, "mis/ratio_mean": 0.0}
    with pytest.raises(ValueError, match="sums"):
        masked_is_stats(torch.zeros(3))


def test_a_nan_log_prob_in_the_loss_rejects_its_sequence():
    old = torch.tensor([[-1.0, float("nan")], [-1.0, -1.0]], dtype=torch.float64)
    rollout = torch.full((2, 2), -1.0, dtype=torch.float64)
    assert sequence_mask(old, rollout, torch.ones((2, 2), dtype=torch.bool), 0.5, 2.0).keep.tolist() == [False, True]


# ------------------------------------------------------------------------------------- config

ASYNC = ["trainer.max_staleness=1", "rollout.placement=separate", "rollout.num_gpus=1"]


def test_asynchronous_training_needs_an_off_policy_correction():
    with pytest.raises(ConfigError, match=r"algorithm\.tis_cap .*and/or algorithm\.mis\.enable=true"):
        load_config(None, ASYNC)
    assert load_config(None, [*ASYNC, "algorithm.tis_cap=2.0"]).algorithm.tis_cap == 2.0
    cfg = load_config(None, [*ASYNC, "algorithm.mis.enable=true", "algorithm.mis.low=0.99", "algorithm.mis.high=1.02"])
    assert (cfg.algorithm.mis.enable, cfg.algorithm.mis.low, cfg.algorithm.mis.high) == (True, 0.99, 1.02)
    both = load_config(None, [*ASYNC, "algorithm.tis_cap=2.0", "algorithm.mis.enable=true"])
    assert both.algorithm.tis_cap == 2.0 and both.algorithm.mis.enable
    # Synchronous training needs none; the defaults are off.
    default = load_config(None, [])
    assert default.algorithm.tis_cap is None and not default.algorithm.mis.enable


@pytest.mark.parametrize("band", [("1.0", "1.001"), ("0.999", "1.0"), ("0", "2"), ("0.5", "0.9")])
def test_masked_is_band_is_checked_when_enabled(band):
    low, high = band
    overrides = [f"algorithm.mis.low={low}", f"algorithm.mis.high={high}"]
    with pytest.raises(ConfigError, match=r"'algorithm\.mis' needs 0 < low < 1 < high"):
        load_config(None, ["algorithm.mis.enable=true", *overrides])
    assert load_config(None, overrides).algorithm.mis.low == float(low)  # disabled: not checked
