"""Routed experts travel with the samples: pack/unpack (the tensor gather's payload) round trip,
concat, and the policy batch's [n, T, L, k] layout with the positions of `PolicyBatch.tokens_of`."""

from __future__ import annotations

import pytest
import torch

from megatron_dapo.trainer.samples import Samples, build_policy_batch, pack_samples, unpack_samples

LAYERS, TOPK = 3, 2


def _samples(seed: int, routed: bool = True) -> Samples:
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(0, 99, (n,), generator=g) for n in (4, 1, 6)]
    prompt_ids, responses, routing = [], [], []
    for prompt in prompts:
        for length in (1, 5):  # two responses per prompt: the prompt travels once
            response = torch.randint(0, 99, (length,), generator=g)
            prompt_ids.append(prompt)
            responses.append(response)
            routing.append(torch.randint(0, 8, (prompt.numel() + length - 1, LAYERS, TOPK), generator=g, dtype=torch.int32))
    count = len(responses)
    return Samples(
        uid=[f"p{i // 2}" for i in range(count)], prompt_ids=prompt_ids, response_ids=responses,
        rollout_log_probs=[-torch.rand(r.numel(), generator=g) for r in responses], truncated=[False] * count,
        score=[1.0] * count, task_score=[1.0] * count, acc=[True] * count, pred=[None] * count,
        overlong_penalty=[0.0] * count, data_source=["math"] * count, reward_error=[None] * count,
        routed_experts=routing if routed else None,
    )  # fmt: skip


def test_pack_unpack_keeps_the_routing_exactly():
    samples = _samples(0)
    back = unpack_samples(*pack_samples(samples))
    assert back.routed_experts is not None and len(back.routed_experts) == len(samples)
    for got, want in zip(back.routed_experts, samples.routed_experts):
        assert got.dtype == torch.int32 and torch.equal(got, want)
    assert all(torch.equal(a, b) for a, b in zip(back.response_ids, samples.response_ids))
    plain = unpack_samples(*pack_samples(_samples(0, routed=False)))
    assert plain.routed_experts is None and "routed_experts" not in plain.as_fields()


def test_a_routing_that_does_not_cover_the_read_tokens_is_refused():
    samples = _samples(1)
    samples.routed_experts[2] = samples.routed_experts[2][:-1]
    with pytest.raises(ValueError, match="the model reads"):
        pack_samples(samples)


def test_concat_and_fields_keep_the_routing_per_sample():
    first, second = _samples(2), _samples(3)
    merged = Samples.concat([first, second])
    assert len(merged.routed_experts) == len(first) + len(second)
    assert torch.equal(merged.routed_experts[len(first)], second.routed_experts[0])
    again = Samples.from_fields(merged.as_fields())
    assert all(torch.equal(a, b) for a, b in zip(again.routed_experts, merged.routed_experts))
    with pytest.raises(ValueError, match="some generation batches carry routed experts"):
        Samples.concat([first, _samples(4, routed=False)])


def test_policy_batch_lays_the_routing_out_by_sequence_position():
    samples = _samples(5)
    batch = build_policy_batch(samples, torch.zeros(len(samples)), pad_token_id=0, response_width=5)
    routed = batch.rollout_routed_experts
    assert routed.shape == (len(samples), batch.sequence_width, LAYERS, TOPK)
    read = batch.read_mask()
    for i, routing in enumerate(samples.routed_experts):
        assert torch.equal(routed[i, : routing.shape[0]], routing)
        assert int(read[i].sum()) == routing.shape[0]
        assert bool((routed[i, routing.shape[0]:] == -1).all())  # positions the model does not read
