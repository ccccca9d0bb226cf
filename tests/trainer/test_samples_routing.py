"""Routed experts travel with the samples: pack/unpack (the tensor gather's payloads) round trip in
their compact type (`actor.routing.routing_dtype`), concat, and the policy batch's [n, T, L, k]
layout with the positions of `PolicyBatch.tokens_of`."""

from __future__ import annotations

import pytest
import torch

from megatron_dapo.trainer.samples import Samples, build_policy_batch, pack_samples, unpack_samples

LAYERS, TOPK = 3, 2


def _samples(seed: int, routed: bool = True, dtype: torch.dtype = torch.int32) -> Samples:
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(0, 99, (n,), generator=g) for n in (4, 1, 6)]
    prompt_ids, responses, routing = [], [], []
    for prompt in prompts:
        for length in (1, 5):  # two responses per prompt: the prompt travels once
            response = torch.randint(0, 99, (length,), generator=g)
            prompt_ids.append(prompt)
            responses.append(response)
            routing.append(torch.randint(0, 8, (prompt.numel() + length - 1, LAYERS, TOPK), generator=g, dtype=torch.int32).to(dtype))
    count = len(responses)
    return Samples(
        uid=[f"p{i // 2}" for i in range(count)], prompt_ids=prompt_ids, response_ids=responses,
        rollout_log_probs=[-torch.rand(r.numel(), generator=g) for r in responses], truncated=[False] * count,
        score=[1.0] * count, task_score=[1.0] * count, acc=[True] * count, pred=[None] * count,
        overlong_penalty=[0.0] * count, data_source=["math"] * count, reward_error=[None] * count,
        routed_experts=routing if routed else None,
    )  # fmt: skip


@pytest.mark.parametrize("dtype", [torch.int8, torch.int16, torch.int32])
def test_pack_unpack_keeps_the_routing_exactly_in_its_compact_type(dtype):
    samples = _samples(0, dtype=dtype)
    header, payload, routing = pack_samples(samples)
    entries = sum(r.numel() for r in samples.routed_experts)
    # The routing travels apart from the token payload (over the host-memory gather), one entry each.
    assert routing.dtype == dtype and routing.numel() == entries and payload.numel() < entries
    back = unpack_samples(header, payload, routing)
    assert back.routed_experts is not None and len(back.routed_experts) == len(samples)
    for got, want in zip(back.routed_experts, samples.routed_experts):
        assert got.dtype == dtype and torch.equal(got, want)
    assert all(torch.equal(a, b) for a, b in zip(back.response_ids, samples.response_ids))
    plain = unpack_samples(*pack_samples(_samples(0, routed=False)))
    with pytest.raises(ValueError, match="routing has None entries"):
        unpack_samples(header, payload)
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


def test_routing_dtype_is_the_smallest_that_holds_every_expert():
    from megatron_dapo.actor.routing import routing_dtype

    assert [routing_dtype(e) for e in (4, 128, 129, 256, 32768, 32769)] == [
        torch.int8, torch.int8, torch.int16, torch.int16, torch.int16, torch.int32
    ]
    assert torch.iinfo(torch.int8).max == 127  # expert ids 0..127, and -1 for positions without routing
    with pytest.raises(ValueError, match="mixture-of-experts"):
        routing_dtype(0)


def test_the_policy_batch_keeps_the_compact_type():
    samples = _samples(5, dtype=torch.int8)
    batch = build_policy_batch(samples, torch.zeros(len(samples)), pad_token_id=0, response_width=5)
    assert batch.rollout_routed_experts.dtype == torch.int8
    assert (batch.rollout_routed_experts[1, samples.routed_experts[1].shape[0]:] == -1).all()


def test_a_micro_batch_widens_only_its_own_positions(monkeypatch):
    """`micro_batch_routing` indexes the batch's compact routing first and widens the slice: the int64
    copy is the micro-batch's size, never the batch's (measured by the largest int64 tensor made)."""
    from megatron_dapo.actor import routing as routing_module

    batch = torch.randint(0, 8, (64, 100, LAYERS, TOPK), dtype=torch.int8)
    source = torch.tensor([[0, 1, 2, -1], [100, 101, -1, -1]])
    widened = []
    real_to = torch.Tensor.to

    def spy_to(self, *args, **kwargs):
        out = real_to(self, *args, **kwargs)
        if out.dtype == torch.long and self.dtype != torch.long:
            widened.append(out.numel())
        return out

    monkeypatch.setattr(torch.Tensor, "to", spy_to)
    routed = routing_module.micro_batch_routing(batch, source)
    monkeypatch.undo()
    assert routed.dtype == torch.long and routed.shape == (2, 4, LAYERS, TOPK)
    assert torch.equal(routed[1, 0], batch[1, 0].long()) and torch.equal(routed[0, 3], torch.arange(TOPK).expand(LAYERS, TOPK))
    assert max(widened) == source.numel() * LAYERS * TOPK  # the micro-batch's 8 positions, not 64 x 100
