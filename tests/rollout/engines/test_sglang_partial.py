"""Partial rollouts in the SGLang adapter against the REAL engine (0.5.23, its CPU engine, float32):
weight pushes landing between decode steps while SGLang generates (`SGLangEngine.generate(...,
pushes=)`).

One engine for the whole file (a start costs about half a minute of CI time), on a tiny Qwen2 A;
the push brings B (the same architecture, another seed). The references are independent of
SGLang: HF transformers' log-probs of prompt + response by one full forward, with A's weights for
the tokens sampled before a push and B's for those after. They match only if the adapter counted
each response's tokens at the push exactly AND SGLang recomputed the KV of the requests in flight
with B (a token after the push reading KV of A would not match B's log-prob).

Greedy decoding: SGLang's CPU engine ignores sampling seeds (see test_sglang_engine.py), and only
greedy rows are the same in every run, so one stop token (chosen from A's greedy responses) ends
one row at once while the others run on past the push. The push is due a fixed fraction of a
plain run's duration after the batch starts (SGLang decodes in its own process, so only time says
how far it got). A run whose push came due only after the batch ended (a machine that sped up
between the plain run and the pushed one: another test's processes finishing) lands nothing and
changes nothing; it is rerun, due a fraction of its own duration (`push_mid_generation`).
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

from megatron_dapo.rollout.base import SamplingParams
from tests.support.pushes import BrokenPushes, ScriptedPushes, TwoCheckpoints, errors_around_the_push

PROMPTS = [[17, 3, 250, 41, 99, 8, 120], [5], [200, 201, 202, 13, 77, 31, 64, 2, 9], [66, 67, 68]]
LONG = SamplingParams(temperature=0, max_new_tokens=96)
SHORT = SamplingParams(temperature=0, max_new_tokens=8)
TOLERANCE = 1e-4  # float32 engine (torch-native attention) vs float32 HF reference, as test_sglang_engine.py
PUSH_AT = 0.4  # of a plain run's duration
PUSH_TRIES = 4  # pushed runs until one lands mid-generation

pytestmark = pytest.mark.usefixtures("require_sglang")


class Models(TwoCheckpoints):
    """TwoCheckpoints with the references' log-probs."""

    def __init__(self, engine, a: Path, b: Path) -> None:
        from safetensors.torch import load_file

        from tests.support.tiny_models import load_hf_model

        weights = {"A": load_file(str(a / "model.safetensors")), "B": load_file(str(b / "model.safetensors"))}
        super().__init__(engine, weights, {"A": load_hf_model(a), "B": load_hf_model(b)})

    def log_probs(self, name: str, prompt: list[int], response: list[int]) -> torch.Tensor:
        with torch.no_grad():
            logits = self.reference[name](torch.tensor([prompt + response])).logits[0, len(prompt) - 1 : -1].float()
        return torch.log_softmax(logits, dim=-1).gather(-1, torch.tensor(response)[:, None]).squeeze(-1)


@pytest.fixture(scope="module")
def models(tmp_path_factory, require_sglang):
    from megatron_dapo.rollout.engines.sglang.engine import SGLangEngine
    from tests.support.tiny_models import save_tiny_model

    root = tmp_path_factory.mktemp("sglang_partial")
    a, b = save_tiny_model("qwen2", root / "a", seed=0), save_tiny_model("qwen2", root / "b", seed=1)
    # Small buckets: a push spans several update calls inside one session.
    with SGLangEngine(a, dtype="float32", skip_tokenizer_init=True, weight_bucket_mb=0.05) as engine:
        yield Models(engine, a, b)


def assert_engine_clean(engine) -> None:
    """No request left in SGLang, its scheduler not paused, no weight-update session open."""
    manager = engine._engine.tokenizer_manager
    assert not manager.rid_to_state, f"requests left in SGLang: {list(manager.rid_to_state)}"
    assert manager.is_pause is False, "SGLang's generation was left paused"
    assert not engine._update_open
    ok, message = engine._engine.end_weight_update()  # SGLang's own view
    assert ok is False and "no weight-update session is open" in message


def assert_log_probs_match(models: Models, out, name: str) -> None:
    for index, response, log_probs in zip(out.prompt_index, out.response_ids, out.log_probs):
        assert (log_probs - models.log_probs(name, PROMPTS[index], response)).abs().max().item() < TOLERANCE


class PushAfter(ScriptedPushes):
    """One scripted push, due `delay` seconds after the first `pending()` (the batch's start)."""

    def __init__(self, weights, delay: float, start_version: int = 0) -> None:
        super().__init__([(1, weights)], start_version=start_version)
        self._delay, self._first = delay, None

    def pending(self) -> bool:
        now = time.perf_counter()
        self._first = now if self._first is None else self._first
        return super().pending() and now - self._first >= self._delay


def stop_token_ending_one_row(responses: list[list[int]]) -> tuple[int, int]:
    """(row, token): a token among the first three of one row's greedy response that no other row
    samples (a stop token that ends that row at once and leaves the others running)."""
    for row, response in enumerate(responses):
        for token in response[:3]:
            if all(token not in other for index, other in enumerate(responses) if index != row):
                return row, token
    raise AssertionError(f"no token ends one greedy row alone: {responses}")


def push_mid_generation(models: Models, params: SamplingParams, new: str, pace: float):
    """(output, pushes, seconds) of the first of `PUSH_TRIES` pushed runs whose push landed.

    A run whose push came due after its batch ended is a plain run with the old weights (asserted:
    nothing loaded, no version moved, every row the old version's): the next try is due `PUSH_AT`
    of that run's own duration."""
    for _ in range(PUSH_TRIES):
        pushes = PushAfter(models.push_of(new), delay=PUSH_AT * pace, start_version=4)
        started = time.perf_counter()
        out = models.engine.generate(PROMPTS, params, pushes=pushes)
        pace = time.perf_counter() - started
        if pushes.landed:
            return out, pushes, pace
        assert pushes.loaded_buckets == 0 and pushes.version == 4
        assert out.weight_versions == [((0, 4),)] * len(PROMPTS)
        assert_engine_clean(models.engine)
    raise AssertionError(f"no push landed mid-generation in {PUSH_TRIES} runs (the last took {pace:.2f}s)")


def test_a_push_between_decode_steps_continues_the_rows_with_the_new_weights(models):
    engine = models.engine
    assert engine.takes_pushes_while_generating
    old, new = models.holds, models.other()
    engine.generate(PROMPTS, SHORT)  # warm: the first call's one-off costs are not the pace
    started = time.perf_counter()
    plain = engine.generate(PROMPTS, LONG)  # also the pace of this machine
    took_plain = time.perf_counter() - started
    assert plain.weight_versions is None
    assert all(len(response) == LONG.max_new_tokens for response in plain.response_ids)
    stopping, stop = stop_token_ending_one_row(plain.response_ids)
    params = SamplingParams(temperature=0, max_new_tokens=LONG.max_new_tokens, stop_token_ids=(stop,))

    out, pushes, took = push_mid_generation(models, params, new, took_plain)
    models.holds = new
    assert pushes.exhausted and pushes.loaded_buckets == 2 and pushes.version == 5
    assert_engine_clean(engine)

    # The stopped row was done before the push: all of it the old version, as without pushes.
    assert out.weight_versions[stopping] == ((0, 4),)
    assert out.response_ids[stopping] == plain.response_ids[stopping][: plain.response_ids[stopping].index(stop) + 1]
    assert out.finish_reasons[stopping] == "stop"
    splits = []
    for row, (response, spans) in enumerate(zip(out.response_ids, out.weight_versions)):
        if row == stopping:
            continue
        assert len(spans) == 2 and spans[0] == (0, 4) and spans[1][1] == 5, spans
        split = spans[1][0]
        assert 0 < split < len(response), spans
        assert response[:split] == plain.response_ids[row][:split]  # A's greedy tokens up to the push
        splits.append(split)

    # Log-probs: the old weights' before the push, the new weights' after it, token by token.
    worst_before, worst_after, differs = errors_around_the_push(out, PROMPTS, models.log_probs, old, new)
    print(
        f"\n[sglang] push landed at tokens {sorted(set(splits))} of {len(splits)} rows (1 done before) in {took:.2f}s "
        f"(plain run {took_plain:.2f}s); |SGLang - HF| before {worst_before:.1e}, after {worst_after:.1e}"
    )
    assert worst_before < TOLERANCE and worst_after < TOLERANCE
    assert min(differs) > 1e-2  # the two models tell the tokens apart

    # A later call without pushes: the new weights (no prefix of A reused), nothing left behind.
    later = engine.generate(PROMPTS, SHORT)
    assert later.weight_versions is None
    assert_log_probs_match(models, later, new)
    assert_engine_clean(engine)


def test_a_push_between_calls_and_calls_where_none_lands(models):
    """The owner's path between calls: a push received while no request runs, with the engine's own
    load and commit; the next call starts at its version, and nothing pending lands nothing."""
    engine = models.engine
    new = models.other()
    pushes = ScriptedPushes([(1, models.push_of(new))], start_version=7)
    assert pushes.pending()
    assert pushes.receive(engine.load_weights, engine.commit_weights) == 8
    models.holds = new
    out = engine.generate(PROMPTS, SHORT, pushes=pushes)
    assert out.weight_versions == [((0, 8),)] * len(PROMPTS)
    assert_log_probs_match(models, out, new)
    assert out.response_ids == engine.generate(PROMPTS, SHORT).response_ids
    assert engine.generate([], SHORT, pushes=pushes).weight_versions == []
    with pytest.raises(ValueError, match="routed experts"):
        engine.generate(PROMPTS, SamplingParams(return_routed_experts=True), pushes=pushes)
    assert_engine_clean(engine)


def test_a_broken_push_leaves_the_engine_clean(models):
    engine = models.engine
    with pytest.raises(ConnectionError, match="went away"):
        engine.generate(PROMPTS, LONG, pushes=BrokenPushes(models.push_of(models.other()), 3, raises=True))
    assert_engine_clean(engine)
    # Its session was closed (half of one model, half of the other): a complete push makes it whole.
    engine.load_weights(models.push_of(models.holds))
    assert_log_probs_match(models, engine.generate(PROMPTS, SHORT), models.holds)

    # A push that never commits is refused before anything runs on it; the engine closes its session.
    with pytest.raises(RuntimeError, match="commit"):
        engine.generate(PROMPTS, LONG, pushes=BrokenPushes(models.push_of(models.other()), 3, raises=False))
    assert_engine_clean(engine)
    models.holds = models.other()  # every tensor of it was loaded
    assert_log_probs_match(models, engine.generate(PROMPTS, SHORT), models.holds)
    assert_engine_clean(engine)
