"""The micro-batch objective: global normalisation makes micro-batch losses, gradients and statistics
add up to the whole mini-batch's, for every aggregation mode; the objective matches the formulas
written out by hand. Pure tensors: the log-probs stand in for the model output."""

from __future__ import annotations

import math

import pytest
import torch

from megatron_dapo.actor.batch import PolicyBatch, build_micro_batch
from megatron_dapo.actor.objective import STAT_NAMES, GlobalCounts, ObjectiveSettings, micro_batch_objective, summarise
from megatron_dapo.algorithm.loss import LOSS_AGG_MODES, count_tokens_and_seqs

WIDTH = 8
ALL_TERMS = dict(entropy_coeff=0.01, use_kl_loss=True, kl_coef=0.05, kl_type="low_var_kl", tis_cap=1.5)


def _batch(seed: int = 0, n: int = 7) -> tuple[PolicyBatch, torch.Tensor, torch.Tensor]:
    g = torch.Generator(device="cpu").manual_seed(seed)
    prompts = [[1] * int(torch.randint(1, 4, (1,), generator=g)) for _ in range(n)]
    responses = [[2] * int(torch.randint(1, WIDTH + 1, (1,), generator=g)) for _ in range(n)]
    batch = PolicyBatch.from_token_lists(prompts, responses, response_width=WIDTH)
    valid = batch.response_valid_mask()
    current = torch.where(valid, -torch.rand(n, WIDTH, generator=g) * 3, 0.0).double()
    noise = lambda s: torch.where(valid, s * torch.randn(n, WIDTH, generator=g, dtype=torch.float64), 0.0)  # noqa: E731
    batch.old_log_probs = current + noise(0.4)
    batch.ref_log_probs = current + noise(0.3)
    batch.rollout_log_probs = batch.old_log_probs + noise(0.5)
    batch.advantages = torch.randn(n, generator=g, dtype=torch.float64)
    mask = valid.clone()
    mask[1] = False  # a response masked out of the loss
    mask[4, 0] = False  # and one token
    batch.response_mask = mask
    entropy = torch.where(valid, torch.rand(n, WIDTH, generator=g, dtype=torch.float64) * 4, 0.0)
    return batch, current, entropy


def _counts(batch: PolicyBatch) -> GlobalCounts:
    tokens, seqs = count_tokens_and_seqs(batch.loss_mask())
    return GlobalCounts(float(tokens), float(seqs), batch.response_width)


def _objective(batch, current, entropy, indices, settings, counts):
    mb = build_micro_batch(batch, indices)
    width = mb.response_valid.shape[1]
    log_probs = current[indices, :width]
    return micro_batch_objective(log_probs, entropy[indices, :width], mb, settings, counts)


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
@pytest.mark.parametrize("split", [[[0, 1, 2, 3, 4, 5, 6]], [[0, 3], [1, 2, 6], [4, 5]], [[6], [], [0, 1, 2, 3, 4, 5]]])
def test_micro_batches_add_up_to_the_mini_batch(mode, split):
    batch, current, entropy = _batch(seed=1)
    settings = ObjectiveSettings(loss_agg_mode=mode, horizon=WIDTH, **ALL_TERMS)
    counts = _counts(batch)
    whole_current = current.clone().requires_grad_(True)
    whole_loss, whole_sums = _objective(batch, whole_current, entropy, list(range(7)), settings, counts)
    whole_loss.backward()

    parts_current = current.clone().requires_grad_(True)
    total, sums = 0.0, torch.zeros(len(STAT_NAMES), dtype=torch.float64)
    for indices in split:
        loss, part_sums = _objective(batch, parts_current, entropy, indices, settings, counts)
        loss.backward()
        total += float(loss.detach())
        sums += part_sums
    assert math.isclose(total, float(whole_loss.detach()), rel_tol=1e-12, abs_tol=1e-15)
    assert torch.allclose(parts_current.grad, whole_current.grad, rtol=1e-12, atol=1e-15)
    assert torch.allclose(sums, whole_sums, rtol=1e-12, atol=1e-12)


def test_token_mean_objective_matches_the_formulas():
    batch, current, entropy = _batch(seed=2)
    settings = ObjectiveSettings(clip_low=0.2, clip_high=0.28, clip_c=3.0, **ALL_TERMS)
    loss, sums = _objective(batch, current, entropy, list(range(7)), settings, _counts(batch))
    m = batch.loss_mask().double()
    lp, old, ref, rollout = current, batch.old_log_probs, batch.ref_log_probs, batch.rollout_log_probs
    adv = batch.advantages[:, None].expand_as(lp)
    ratio = torch.exp(lp - old)
    pg = torch.maximum(-adv * ratio, -adv * ratio.clamp(0.8, 1.28))
    pg = torch.where(adv < 0, torch.minimum(pg, -3.0 * adv), pg) * torch.exp(old - rollout).clamp(max=1.5)
    kl = torch.exp(ref - lp) - (ref - lp) - 1
    n = m.sum()
    expected = ((pg - 0.01 * entropy + 0.05 * kl) * m).sum() / n
    assert math.isclose(float(loss), float(expected), rel_tol=1e-12)
    stats = summarise(sums)
    assert stats["tokens"] == float(n)
    assert math.isclose(stats["entropy"], float((entropy * m).sum() / n), rel_tol=1e-12)
    assert math.isclose(stats["kl"], float((kl * m).sum() / n), rel_tol=1e-12)
    weight = torch.exp(old - rollout)
    assert math.isclose(stats["tis_capped_frac"], float(((weight >= 1.5) & m.bool()).sum() / n), rel_tol=1e-12)
    assert math.isclose(stats["approx_kl"], float(((old - lp) * m).sum() / n), rel_tol=1e-9)
    assert 0 < stats["clipfrac"] < 1


def test_disabled_terms_and_missing_inputs():
    batch, current, entropy = _batch(seed=3)
    counts = _counts(batch)
    settings = ObjectiveSettings()  # entropy_coeff 0, no KL, no truncated IS
    with_entropy, _ = _objective(batch, current, entropy, list(range(7)), settings, counts)
    mb = build_micro_batch(batch, list(range(7)))
    width = mb.response_valid.shape[1]
    without_entropy, sums = micro_batch_objective(current[:, :width], None, mb, settings, counts)
    assert float(with_entropy) == float(without_entropy)  # with coefficient 0 the entropy is only logged
    assert summarise(sums)["entropy"] == 0.0
    batch.rollout_log_probs = None
    with pytest.raises(ValueError, match="rollout_log_probs"):
        _objective(batch, current, entropy, [0], ObjectiveSettings(tis_cap=2.0), counts)
    batch.ref_log_probs = None
    with pytest.raises(ValueError, match="ref_log_probs"):
        _objective(batch, current, entropy, [0], ObjectiveSettings(use_kl_loss=True), counts)


def test_settings_from_config():
    from megatron_dapo.config import Config

    cfg = Config()
    cfg.algorithm.kl.use_kl_loss = True
    cfg.algorithm.tis_cap = 2.0
    settings = ObjectiveSettings.from_config(cfg.algorithm, horizon=100)
    assert (settings.clip_high, settings.use_kl_loss, settings.tis_cap, settings.horizon) == (0.28, True, 2.0, 100)
