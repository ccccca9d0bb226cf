"""Rollout samples travel between ranks as one flat tensor per contributor (issue: results as tensors)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from megatron_dapo.trainer.samples import Samples, pack_samples, unpack_samples
from tests.support.torchrun_utils import run_torchrun_function

from tests.support.samples import as_plain, make_samples

WORKER = Path(__file__).parent / "_gather_worker.py"


def test_pack_unpack_round_trip_is_exact_and_sends_each_prompt_once():
    samples = make_samples(seed=3, num_prompts=4, n=3)
    header, payload, routing = pack_samples(samples)
    assert payload.dtype == torch.int32 and payload.dim() == 1 and routing is None
    prompt_tokens = sum(p.numel() for p in samples.prompt_ids[::3])
    response_tokens = sum(r.numel() for r in samples.response_ids)
    assert payload.numel() == prompt_tokens + 2 * response_tokens  # each prompt once, ids + log-prob bits
    assert header["prompt_runs"] == [3, 3, 3, 3]
    restored = unpack_samples(header, payload)
    assert as_plain(restored) == as_plain(samples)
    assert all(t.dtype == torch.long for t in restored.response_ids + restored.prompt_ids)
    assert all(t.dtype == torch.float32 for t in restored.rollout_log_probs)


def test_equal_prompts_of_different_groups_are_not_merged_across_a_changed_prompt():
    samples = make_samples(seed=5, num_prompts=2, n=2)
    # Same tokens as the first prompt, but a distinct tensor after a different one: a run of its own.
    samples.prompt_ids.append(samples.prompt_ids[0].clone())
    for name in ("uid", "truncated", "score", "task_score", "acc", "pred", "overlong_penalty", "data_source"):
        getattr(samples, name).append(getattr(samples, name)[0])
    samples.response_ids.append(torch.tensor([7, 8]))
    samples.rollout_log_probs.append(torch.tensor([-0.5, -1.5]))
    header, payload, _ = pack_samples(samples)
    assert header["prompt_runs"] == [2, 2, 1]
    assert as_plain(unpack_samples(header, payload)) == as_plain(samples)


def test_empty_samples_round_trip():
    header, payload, _ = pack_samples(Samples.concat([]))
    assert payload.numel() == 0
    assert len(unpack_samples(header, payload)) == 0


def test_mismatched_log_probs_are_refused():
    samples = make_samples(seed=1, num_prompts=1, n=1)
    samples.rollout_log_probs[0] = torch.zeros(samples.response_ids[0].numel() + 1)
    with pytest.raises(ValueError, match="rollout log-probs"):
        pack_samples(samples)


def test_a_truncated_payload_is_refused():
    header, payload, _ = pack_samples(make_samples(seed=2, num_prompts=2, n=2))
    with pytest.raises(ValueError, match="payload has"):
        unpack_samples(header, payload[:-1])


def test_gather_over_three_ranks_equals_the_pickled_gather():
    """Ranks 0 and 2 contribute (rank 1 does not), ordered by their key: every rank gets the same
    samples, bit for bit, as an all_gather_object of the same samples."""
    result = run_torchrun_function(WORKER, "main", nproc=3, kwargs={"contributors": [0, 2]}, timeout=240)
    result.check()
    assert [r["equal"] for r in result.rank_results] == [True, True, True]
    assert {r["count"] for r in result.rank_results} == {(3 * 2) + (5 * 2)}
    assert result.rank_results[0]["dtypes"] == ["torch.int64"]
