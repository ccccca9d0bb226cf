"""The experience helpers the trainer uses: the dynamic-sampling metric and the overlong filter."""

from __future__ import annotations

import pytest
import torch

from megatron_dapo.trainer.samples import build_policy_batch, filter_metric

from tests.support.samples import make_samples


def test_filter_metric_names_the_field_it_compares():
    samples = make_samples(seed=4, num_prompts=2, n=3)
    assert filter_metric(samples, "acc").tolist() == [float(a) for a in samples.acc]
    assert filter_metric(samples, "score").tolist() == samples.task_score
    assert filter_metric(samples, "seq_reward").tolist() == samples.score
    with pytest.raises(ValueError, match="acc, score, seq_reward"):
        filter_metric(samples, "reward")


def test_overlong_filter_masks_exactly_the_truncated_responses():
    samples = make_samples(seed=6, num_prompts=3, n=2)
    width = max(len(r) for r in samples.response_ids)
    advantages = torch.linspace(-1, 1, len(samples))
    kept = build_policy_batch(samples, advantages, pad_token_id=0, response_width=width)
    filtered = build_policy_batch(samples, advantages, pad_token_id=0, response_width=width, mask_truncated=True)
    valid = kept.response_valid_mask()
    truncated = torch.tensor(samples.truncated)
    assert truncated.any() and (~truncated).any()
    assert torch.equal(filtered.loss_mask()[truncated], torch.zeros_like(valid[truncated]))
    assert torch.equal(filtered.loss_mask()[~truncated], valid[~truncated])
    # The tokens and log-probs themselves are untouched: only the loss mask changes.
    assert torch.equal(filtered.response_ids, kept.response_ids)
    assert torch.equal(filtered.rollout_log_probs, kept.rollout_log_probs)
