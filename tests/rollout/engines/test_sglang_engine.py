"""The SGLang adapter against the REAL SGLang engine (0.5.23, its CPU engine, float32).

Two engines are started once for the module: `engine` on a tiny Qwen2 (weights A) and `fresh` on
the same architecture with other weights (B). References are independent of the adapter: a
separately loaded HF model (float32, eager attention) for log-probs and greedy tokens, and the
`fresh` engine for "what SGLang generates on weights B". Every test leaves `engine` on weights A.

Without SGLang these tests skip, except under CI (true / 1 / yes), where that is a failure
(`make install-sglang-cpu` installs it).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from megatron_dapo.rollout.base import SamplingParams

PROMPTS = [[17, 3, 250, 41, 99, 8, 120], [5], [200, 201, 202, 13, 77, 31, 64, 2, 9]]
SAMPLED = SamplingParams(n=2, temperature=1.0, max_new_tokens=8, seed=11)
# Comparisons between engines or weights use greedy decoding: SGLang honours `sampling_seed` only
# with enable_deterministic_inference, which needs a GPU attention backend (not torch_native).
GREEDY = SamplingParams(temperature=0, max_new_tokens=8)
LOG_PROB_TOLERANCE = 1e-4  # float32 engine (torch-native attention) vs float32 HF reference

pytestmark = pytest.mark.usefixtures("require_sglang")


def _weights(directory: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(directory / "model.safetensors"))


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory, require_sglang) -> dict[str, Path]:
    from tests.support.tiny_models import save_tiny_model

    root = tmp_path_factory.mktemp("sglang_models")
    return {"A": save_tiny_model("qwen2", root / "a", seed=0), "B": save_tiny_model("qwen2", root / "b", seed=1)}


def _start(model_dir: Path, **kwargs):
    from megatron_dapo.rollout.engines.sglang.engine import SGLangEngine

    # Small buckets: every push spans several update calls inside one session.
    return SGLangEngine(model_dir, dtype="float32", skip_tokenizer_init=True, weight_bucket_mb=0.05, **kwargs)


@pytest.fixture(scope="module")
def engine(model_dirs):
    with _start(model_dirs["A"]) as started:
        yield started


@pytest.fixture(scope="module")
def fresh(model_dirs):
    with _start(model_dirs["B"]) as started:
        yield started


@pytest.fixture(scope="module")
def on_a(engine):
    """What `engine` generates greedily on weights A (recorded before any push)."""
    return engine.generate(PROMPTS, GREEDY)


def _same(got, want) -> None:
    assert got.prompt_index == want.prompt_index and got.response_ids == want.response_ids
    for mine, theirs in zip(got.log_probs, want.log_probs):
        torch.testing.assert_close(mine, theirs, rtol=0, atol=1e-6)


def _reference_log_probs(model, prompt, response, temperature: float = 1.0) -> torch.Tensor:
    with torch.no_grad():
        logits = model(torch.tensor([prompt + response])).logits[0, len(prompt) - 1 : -1].float()
    return torch.log_softmax(logits / temperature, dim=-1).gather(-1, torch.tensor(response)[:, None]).squeeze(-1)


def test_log_probs_and_greedy_tokens_match_hf(engine, model_dirs, on_a):
    from tests.support.tiny_models import load_hf_model

    reference = load_hf_model(model_dirs["A"])
    sampled = engine.generate(PROMPTS, SAMPLED)
    assert sampled.prompt_index == [0, 0, 1, 1, 2, 2]
    worst = 0.0
    for row, (response, log_probs) in enumerate(zip(sampled.response_ids, sampled.log_probs)):
        prompt = PROMPTS[sampled.prompt_index[row]]
        assert len(response) == len(log_probs) > 0
        worst = max(worst, float((log_probs - _reference_log_probs(reference, prompt, response)).abs().max()))
    assert worst < LOG_PROB_TOLERANCE, worst
    # Greedy: HF's argmax path, and the log-probs of T = 1.
    for prompt, response, log_probs in zip(PROMPTS, on_a.response_ids, on_a.log_probs):
        tokens = list(prompt)
        with torch.no_grad():
            for _ in range(GREEDY.max_new_tokens):
                tokens.append(int(reference(torch.tensor([tokens])).logits[0, -1].argmax()))
        assert response == tokens[len(prompt) :]
        assert float((log_probs - _reference_log_probs(reference, prompt, response)).abs().max()) < LOG_PROB_TOLERANCE


def test_weight_push_in_both_formats_equals_a_fresh_engine(engine, fresh, model_dirs, on_a):
    weights_a, weights_b = _weights(model_dirs["A"]), _weights(model_dirs["B"])
    on_b = fresh.generate(PROMPTS, GREEDY)
    assert on_b.response_ids != on_a.response_ids  # the two weight sets are told apart

    for load_format in ("flattened_bucket", "tensors"):
        engine.weight_load_format = load_format
        try:
            # One update over two calls (as the weight sync sends it), committed by the next generate.
            names = sorted(weights_b)
            engine.load_weights((name, weights_b[name]) for name in names[::2])
            engine.load_weights((name, weights_b[name]) for name in names[1::2])
            _same(engine.generate(PROMPTS, GREEDY), on_b)
            engine.load_weights(weights_a.items())
            engine.commit_weights()  # what sync_weights calls at its end
            _same(engine.generate(PROMPTS, GREEDY), on_a)
        finally:
            engine.weight_load_format = "flattened_bucket"
            engine.load_weights(weights_a.items())
            engine.commit_weights()


def test_the_radix_cache_of_old_weights_is_flushed(engine, fresh, model_dirs, on_a):
    """The same prompts before and after a push: SGLang's radix cache holds their KV from weights A.
    The adapter flushes it; pushed through SGLang's own calls without a flush, the cached prefix
    makes generation differ from a fresh engine on weights B (the check above can fail)."""
    weights_a, weights_b = _weights(model_dirs["A"]), _weights(model_dirs["B"])
    on_b = fresh.generate(PROMPTS, GREEDY)
    try:
        _same(engine.generate(PROMPTS, GREEDY), on_a)  # cached now
        raw = engine._engine
        assert raw.begin_weight_update() == (True, "Success")
        assert raw.update_weights_from_tensor(named_tensors=list(weights_b.items()), flush_cache=False)[0] is True
        assert raw.end_weight_update()[0] is True
        stale = engine.generate(PROMPTS, GREEDY)
        assert stale.response_ids != on_b.response_ids or any(
            not torch.allclose(a, b, atol=1e-4) for a, b in zip(stale.log_probs, on_b.log_probs)
        )
        engine.load_weights(weights_b.items())
        _same(engine.generate(PROMPTS, GREEDY), on_b)
    finally:
        engine.load_weights(weights_a.items())
        engine.commit_weights()


def test_sleep_and_wake_in_the_trainer_order(engine, model_dirs, on_a):
    weights_a, weights_b = _weights(model_dirs["A"]), _weights(model_dirs["B"])
    engine.sleep(level=2)
    assert engine.is_sleeping and engine.sleeping_tags == {"weights", "kv_cache"}
    with pytest.raises(RuntimeError, match="asleep"):
        engine.generate(PROMPTS, GREEDY)
    with pytest.raises(RuntimeError, match="asleep"):
        engine.load_weights(weights_a.items())
    engine.wake_up(["weights"])  # SGLang: resume_memory_occupation(tags=["weights"])
    engine.load_weights(weights_a.items())
    engine.commit_weights()  # with the KV cache still asleep, as the weight sync does
    with pytest.raises(RuntimeError, match=r"asleep \(\['kv_cache'\]\)"):
        engine.generate(PROMPTS, GREEDY)
    engine.wake_up(["kv_cache"])  # SGLang: resume_memory_occupation(tags=["kv_cache", "cuda_graph"])
    assert not engine.is_sleeping
    _same(engine.generate(PROMPTS, GREEDY), on_a)

    # An update still open when the engine goes to sleep is committed first.
    engine.load_weights(weights_b.items())
    engine.sleep()
    engine.wake_up()
    assert engine.generate(PROMPTS, GREEDY).response_ids != on_a.response_ids
    engine.load_weights(weights_a.items())
    _same(engine.generate(PROMPTS, GREEDY), on_a)


def test_the_old_call_sequence_is_rejected_by_the_real_engine(engine, model_dirs):
    """Issue 20: SGLang 0.5.23 refuses a push outside a weight-update session; the adapter says so."""
    engine._sessions = False
    try:
        with pytest.raises(RuntimeError, match="must run between begin_weight_update"):
            engine.load_weights(_weights(model_dirs["A"]).items())
    finally:
        engine._sessions = True


def test_a_failed_push_closes_the_session(engine, model_dirs, on_a, monkeypatch):
    """An error after the session opened (here: serialising the first bucket) closes it on the engine."""

    def broken(bucket):
        raise ValueError("cannot serialise this bucket")

    monkeypatch.setattr(engine, "_serialize_flattened", broken)
    with pytest.raises(ValueError, match="cannot serialise"):
        engine.load_weights(_weights(model_dirs["B"]).items())
    monkeypatch.undo()
    ok, message = engine._engine.end_weight_update()  # SGLang's own view: no session is open
    assert ok is False and "no weight-update session is open" in message
    _same(engine.generate(PROMPTS, GREEDY), on_a)


def test_named_weights_are_the_loaded_weights(engine, model_dirs):
    weights_a = _weights(model_dirs["A"])
    exported = dict(engine.named_weights())
    assert sorted(exported) == sorted(weights_a)
    for name, tensor in weights_a.items():
        assert torch.equal(exported[name], tensor), name
