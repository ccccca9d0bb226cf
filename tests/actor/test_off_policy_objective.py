"""The off-policy corrections in the micro-batch objective: with the masked IS off the objective is
the one before it existed, bit for bit (tests/actor/_objective_before.py); with it on, the loss is
the formula written out by hand in float64 (rejected sequences out of the numerator AND the
token-mean's denominator), micro-batches still add up to the mini-batch exactly, and the statistics
report the rejected share. Pure tensors: the log-probs stand in for the model output."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from megatron_dapo.actor.batch import PolicyBatch, build_micro_batch
from megatron_dapo.actor.objective import (
    STAT_NAMES,
    GlobalCounts,
    ObjectiveSettings,
    loss_mask,
    micro_batch_objective,
    summarise,
)
from megatron_dapo.algorithm.loss import LOSS_AGG_MODES, count_tokens_and_seqs
from tests.actor._objective_before import STAT_NAMES_BEFORE, micro_batch_objective_before

WIDTH = 8
N = 9
BAND = (0.995, 1.005)
OUT_HIGH, OUT_LOW = (2, 6), (5,)
"""Rows whose rollout log-probs are shifted out of the band: pi_old / pi_rollout = e^+0.01 and e^-0.01 a token."""
SPLITS = [[list(range(N))], [[0, 3], [1, 2, 6, 8], [4, 5, 7]], [[8], [], [0, 1, 2, 3, 4, 5, 6, 7]]]


def _batch(seed: int = 0, dtype=torch.float64) -> tuple[PolicyBatch, torch.Tensor, torch.Tensor]:
    """A batch whose rows OUT_HIGH / OUT_LOW are off-policy beyond BAND and the others inside it."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    prompts = [[1] * int(torch.randint(1, 4, (1,), generator=g)) for _ in range(N)]
    responses = [[2] * int(torch.randint(2, WIDTH + 1, (1,), generator=g)) for _ in range(N)]
    batch = PolicyBatch.from_token_lists(prompts, responses, response_width=WIDTH)
    valid = batch.response_valid_mask()
    current = torch.where(valid, -torch.rand(N, WIDTH, generator=g) * 3, 0.0).to(dtype)
    noise = lambda s: torch.where(valid, s * torch.randn(N, WIDTH, generator=g, dtype=torch.float64), 0.0)  # noqa: E731
    batch.old_log_probs = (current + noise(0.4)).to(dtype)
    batch.ref_log_probs = (current + noise(0.3)).to(dtype)
    rollout = batch.old_log_probs.double() + noise(1e-3)  # in the band: |mean| of a few 1e-3 draws << 0.005
    shift = torch.zeros(N, 1, dtype=torch.float64)
    shift[list(OUT_HIGH)] = -0.01
    shift[list(OUT_LOW)] = 0.01
    batch.rollout_log_probs = torch.where(valid, rollout + shift, 0.0).to(dtype)
    batch.advantages = torch.randn(N, generator=g, dtype=torch.float64).to(dtype)
    mask = valid.clone()
    mask[1] = False  # a response masked out of the loss (neither kept nor rejected by the MIS)
    mask[4, 0] = False  # and one token
    batch.response_mask = mask
    entropy = torch.where(valid, torch.rand(N, WIDTH, generator=g, dtype=torch.float64) * 4, 0.0).to(dtype)
    return batch, current, entropy


def _counts(batch: PolicyBatch, settings: ObjectiveSettings) -> GlobalCounts:
    tokens, seqs = count_tokens_and_seqs(loss_mask(batch, settings))  # what MegatronActor.global_counts counts
    return GlobalCounts(float(tokens), float(seqs), batch.response_width)


def _run(fn, batch, current, entropy, indices, settings, counts):
    mb = build_micro_batch(batch, indices)
    width = mb.response_valid.shape[1]
    return fn(current[indices, :width], entropy[indices, :width], mb, settings, counts)


def _without_mis_entries(sums: torch.Tensor) -> torch.Tensor:
    keep = [i for i, name in enumerate(STAT_NAMES) if not name.startswith("mis_")]
    return sums[keep]


# ------------------------------------------------------------------- off: exactly today's objective


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
@pytest.mark.parametrize("tis_cap", [None, 1.5])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_without_the_masked_is_the_objective_is_the_one_before_bit_for_bit(mode, tis_cap, dtype):
    batch, current, entropy = _batch(seed=1, dtype=dtype)
    terms = dict(loss_agg_mode=mode, horizon=WIDTH, tis_cap=tis_cap, entropy_coeff=0.01, use_kl_loss=True, kl_coef=0.05)
    settings = ObjectiveSettings(**terms)
    everything = ObjectiveSettings(**terms, mis=(1e-6, 1e6))  # on, with a band no sequence leaves
    counts = _counts(batch, settings)
    assert _counts(batch, everything) == counts
    assert list(STAT_NAMES_BEFORE) == [name for name in STAT_NAMES if not name.startswith("mis_")]
    for indices in SPLITS[1]:
        before_in = current.clone().requires_grad_(True)
        loss_before, sums_before = _run(micro_batch_objective_before, batch, before_in, entropy, indices, settings, counts)
        loss_before.backward()
        for now_settings in (settings, everything):
            now_in = current.clone().requires_grad_(True)
            loss, sums = _run(micro_batch_objective, batch, now_in, entropy, indices, now_settings, counts)
            loss.backward()
            assert loss.dtype == loss_before.dtype and torch.equal(loss.detach(), loss_before.detach())
            assert torch.equal(now_in.grad, before_in.grad)
            assert torch.equal(_without_mis_entries(sums), sums_before)
        # Off: the masked-IS statistics are zero (and the actor drops them from its metrics).
        _, sums = _run(micro_batch_objective, batch, current, entropy, indices, settings, counts)
        assert not sums[[i for i, name in enumerate(STAT_NAMES) if name.startswith("mis_")]].any()


# -------------------------------------------------------------------------- on: the formula by hand


@pytest.mark.parametrize("tis_cap", [None, 1.5])
def test_token_mean_with_the_masked_is_matches_the_formula_by_hand(tis_cap):
    batch, current, entropy = _batch(seed=2)
    settings = ObjectiveSettings(clip_low=0.2, clip_high=0.28, clip_c=3.0, entropy_coeff=0.01, use_kl_loss=True,
                                 kl_coef=0.05, tis_cap=tis_cap, mis=BAND)  # fmt: skip
    loss, sums = _run(micro_batch_objective, batch, current, entropy, list(range(N)), settings, _counts(batch, settings))

    # By hand, in float64 Python floats where the decision is taken.
    old, rollout, lp, ref = batch.old_log_probs, batch.rollout_log_probs, current, batch.ref_log_probs
    m = batch.loss_mask()
    rho, kept = [], []
    for i in range(N):
        d = [float(old[i, t]) - float(rollout[i, t]) for t in range(WIDTH) if m[i, t]]
        rho.append(math.exp(math.fsum(d) / len(d)) if d else None)
        kept.append(bool(d) and BAND[0] <= rho[-1] <= BAND[1])
    assert [i for i in range(N) if rho[i] is not None and not kept[i]] == sorted(OUT_HIGH + OUT_LOW)  # the batch's design
    keep = torch.tensor(kept)[:, None] & m
    adv = batch.advantages[:, None].expand_as(lp)
    ratio = torch.exp(lp - old)
    pg = torch.maximum(-adv * ratio, -adv * ratio.clamp(0.8, 1.28))
    pg = torch.where(adv < 0, torch.minimum(pg, -3.0 * adv), pg)
    weight = torch.exp(old - rollout).clamp(max=tis_cap) if tis_cap else torch.ones_like(pg)
    kl = torch.exp(ref - lp) - (ref - lp) - 1
    k = keep.double()
    n_kept = k.sum()
    expected = ((pg * weight - 0.01 * entropy + 0.05 * kl) * k).sum() / n_kept
    assert math.isclose(float(loss), float(expected), rel_tol=1e-12)

    stats = summarise(sums)
    with_tokens = [i for i in range(N) if rho[i] is not None]
    rejected = [i for i in with_tokens if not kept[i]]
    assert stats["tokens"] == float(n_kept) < float(m.sum())
    assert stats["mis_masked_frac"] == pytest.approx(len(rejected) / len(with_tokens))
    assert stats["mis_masked_token_frac"] == pytest.approx(float(m[rejected].sum()) / float(m.sum()))
    assert stats["mis_ratio_mean"] == pytest.approx(sum(rho[i] for i in with_tokens) / len(with_tokens), rel=1e-9)
    assert math.isclose(stats["entropy"], float((entropy * k).sum() / n_kept), rel_tol=1e-12)
    assert math.isclose(stats["approx_kl"], float(((old - lp) * k).sum() / n_kept), rel_tol=1e-9)
    if tis_cap:
        assert math.isclose(stats["tis_weight_mean"], float((weight * k).sum() / n_kept), rel_tol=1e-12)


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_rejected_sequences_are_as_if_masked_out_of_the_batch(mode):
    """The masked IS equals clearing the rejected rows' loss mask by hand (as overlong_filter does)
    with no correction: numerator, denominator (tokens and sequences), gradient, statistics."""
    batch, current, entropy = _batch(seed=3)
    on = ObjectiveSettings(loss_agg_mode=mode, horizon=WIDTH, tis_cap=2.0, mis=BAND)
    cleared = batch.loss_mask().clone()
    cleared[list(OUT_HIGH + OUT_LOW)] = False
    by_hand = dataclasses.replace(batch, response_mask=cleared)
    off = ObjectiveSettings(loss_agg_mode=mode, horizon=WIDTH, tis_cap=2.0)
    counts_on, counts_off = _counts(batch, on), _counts(by_hand, off)
    assert counts_on == counts_off
    assert counts_on.num_seqs == count_tokens_and_seqs(batch.loss_mask())[1] - len(OUT_HIGH + OUT_LOW)
    a_in, b_in = current.clone().requires_grad_(True), current.clone().requires_grad_(True)
    loss_on, sums_on = _run(micro_batch_objective, batch, a_in, entropy, list(range(N)), on, counts_on)
    loss_off, sums_off = _run(micro_batch_objective, by_hand, b_in, entropy, list(range(N)), off, counts_off)
    (loss_on + loss_off).backward()
    assert torch.equal(loss_on.detach(), loss_off.detach())
    assert torch.equal(a_in.grad, b_in.grad)
    assert torch.equal(_without_mis_entries(sums_on), _without_mis_entries(sums_off))


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
@pytest.mark.parametrize("split", SPLITS)
def test_micro_batches_add_up_to_the_mini_batch_with_the_masked_is(mode, split):
    batch, current, entropy = _batch(seed=4)
    settings = ObjectiveSettings(loss_agg_mode=mode, horizon=WIDTH, entropy_coeff=0.01, use_kl_loss=True, tis_cap=1.5, mis=BAND)
    counts = _counts(batch, settings)
    whole_in = current.clone().requires_grad_(True)
    whole_loss, whole_sums = _run(micro_batch_objective, batch, whole_in, entropy, list(range(N)), settings, counts)
    whole_loss.backward()
    parts_in = current.clone().requires_grad_(True)
    total, sums = 0.0, torch.zeros(len(STAT_NAMES), dtype=torch.float64)
    for indices in split:
        loss, part_sums = _run(micro_batch_objective, batch, parts_in, entropy, indices, settings, counts)
        loss.backward()
        total += float(loss.detach())
        sums += part_sums
    assert math.isclose(total, float(whole_loss.detach()), rel_tol=1e-12, abs_tol=1e-15)
    assert torch.allclose(parts_in.grad, whole_in.grad, rtol=1e-12, atol=1e-15)
    assert torch.allclose(sums, whole_sums, rtol=1e-12, atol=1e-12)
    # The loss's decisions, pooled over micro-batches, are the counts' decision on the whole batch.
    stats = dict(zip(STAT_NAMES, sums.tolist()))
    assert stats["mis_seqs"] - stats["mis_masked_seqs"] == counts.num_seqs
    assert stats["mis_tokens"] - stats["mis_masked_tokens"] == counts.num_tokens == stats["num_tokens"]
    assert stats["mis_masked_seqs"] == len(OUT_HIGH + OUT_LOW)
    # The rejected rows get no gradient at all.
    assert not whole_in.grad[list(OUT_HIGH + OUT_LOW)].any() and whole_in.grad[0].any()


def test_settings_inputs_and_the_supervised_path():
    from megatron_dapo.config import Config

    cfg = Config()
    assert ObjectiveSettings.from_config(cfg.algorithm).mis is None
    cfg.algorithm.mis.enable, cfg.algorithm.mis.low, cfg.algorithm.mis.high = True, 0.98, 1.03
    cfg.algorithm.tis_cap = 2.0
    settings = ObjectiveSettings.from_config(cfg.algorithm)
    assert (settings.mis, settings.tis_cap) == ((0.98, 1.03), 2.0)

    batch, current, entropy = _batch(seed=5)
    # The counts' mask leaves the rejected rows out only when the masked IS is on, and never for SFT.
    assert torch.equal(loss_mask(batch, ObjectiveSettings()), batch.loss_mask())
    assert not loss_mask(batch, ObjectiveSettings(mis=BAND))[list(OUT_HIGH + OUT_LOW)].any()
    assert torch.equal(loss_mask(batch, ObjectiveSettings(sft=True, mis=BAND)), batch.loss_mask())
    batch.rollout_log_probs = None
    counts = GlobalCounts(10.0, 3.0, WIDTH)
    with pytest.raises(ValueError, match="rollout_log_probs"):
        _run(micro_batch_objective, batch, current, entropy, [0], ObjectiveSettings(mis=BAND), counts)
    with pytest.raises(ValueError, match="rollout_log_probs"):
        loss_mask(batch, ObjectiveSettings(mis=BAND))
