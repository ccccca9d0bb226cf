"""The embedded HF engine against independent references: a naive no-cache, no-padding greedy
decode, and log-probs from a full forward of prompt + response with a separately loaded model."""

from __future__ import annotations

import math

import pytest
import torch

from megatron_dapo.rollout.base import SamplingParams
from megatron_dapo.rollout.engines.embedded import (
    EmbeddedEngine,
    filter_top_k_top_p,
    left_pad,
    plan_sub_batches,
    sample_next_tokens,
    sleep_moves_weights,
)
from tests.support.tiny_models import build_tiny_model, load_hf_model, save_tiny_model

# Lengths 1..12 in one batch: left padding, position ids and the cache all matter.
PROMPTS = [[17, 3, 250, 41, 99, 8, 120], [5], [200, 201, 202, 13, 77, 31, 64, 2, 9, 150, 11, 42], [66, 67, 68]]


@pytest.fixture(scope="module", autouse=True)
def one_cpu_thread():
    """Tiny matmuls gain nothing from threads, and on a busy 2-core machine OpenMP spin-waits made
    these tests ~10x slower; restored afterwards so other modules keep their setting."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="module")
def engine(tiny_model_dirs) -> EmbeddedEngine:
    return EmbeddedEngine(tiny_model_dirs["qwen2"])


@pytest.fixture(scope="module")
def reference(tiny_model_dirs) -> torch.nn.Module:
    """The same checkpoint loaded independently (eager attention), never touched by the engine."""
    return load_hf_model(tiny_model_dirs["qwen2"])


@torch.no_grad()
def naive_greedy(model, prompt, max_new_tokens, stop_ids=()) -> tuple[list[int], str]:
    """Greedy decode by full recomputation, one prompt, no padding, no cache."""
    ids = list(prompt)
    for _ in range(max_new_tokens):
        token = int(model(torch.tensor([ids])).logits[0, -1].argmax())
        ids.append(token)
        if token in stop_ids:
            return ids[len(prompt) :], "stop"
    return ids[len(prompt) :], "length"


@torch.no_grad()
def reference_log_probs(model, prompt, response, temperature) -> torch.Tensor:
    """log_softmax(logits / T) of each response token from one forward of prompt + response."""
    ids = torch.tensor([list(prompt) + list(response)])
    logits = model(ids).logits[0, len(prompt) - 1 : -1].float()
    return torch.log_softmax(logits / temperature, dim=-1).gather(-1, torch.tensor(response)[:, None]).squeeze(-1)


# ---------------------------------------------------------------------------------- greedy vs reference


@pytest.mark.parametrize("arch", ["qwen2", "qwen2_tied", "llama3", "qwen3"])
def test_greedy_batch_equals_naive_decode(tiny_model_dirs, arch):
    engine = EmbeddedEngine(tiny_model_dirs[arch])
    reference = load_hf_model(tiny_model_dirs[arch])
    out = engine.generate(PROMPTS, SamplingParams(temperature=0, max_new_tokens=10))
    for prompt, response, reason in zip(PROMPTS, out.response_ids, out.finish_reasons):
        expected, expected_reason = naive_greedy(reference, prompt, 10)
        assert response == expected
        assert reason == expected_reason == "length"
    assert out.truncated.tolist() == [True] * len(PROMPTS)


def test_left_pad_positions_count_real_tokens_only():
    # RoPE attention only sees position differences, so a constant shift would pass the decode
    # tests; positions must still start at 0 to match the actor's (and any absolute-position scheme).
    input_ids, attention_mask, position_ids = left_pad([[7, 8, 9], [5]], torch.device("cpu"))
    assert input_ids[:, -3:].tolist() == [[7, 8, 9], [0, 0, 5]]
    assert attention_mask.tolist() == [[1, 1, 1], [0, 0, 1]]
    assert position_ids[0].tolist() == [0, 1, 2] and position_ids[1, -1].item() == 0


def test_rows_that_stop_leave_the_others_unchanged(engine, reference):
    # Stop on a token that some rows emit early: they leave the batch (KV cache compaction) while the
    # others keep decoding; every row must still equal the one-prompt reference.
    free = engine.generate(PROMPTS, SamplingParams(temperature=0, max_new_tokens=14)).response_ids
    stop_ids = (free[0][2], free[2][5])
    out = engine.generate(PROMPTS, SamplingParams(temperature=0, max_new_tokens=14, stop_token_ids=stop_ids))
    reasons = []
    for prompt, response, reason in zip(PROMPTS, out.response_ids, out.finish_reasons):
        expected, expected_reason = naive_greedy(reference, prompt, 14, stop_ids)
        assert (response, reason) == (expected, expected_reason)
        reasons.append(reason)
    assert "stop" in reasons and "length" in reasons, "the test needs rows of both kinds"
    assert out.truncated.tolist() == [reason == "length" for reason in reasons]


def test_sub_batches_give_the_same_greedy_output(tiny_model_dirs, engine):
    params = SamplingParams(n=2, temperature=0, max_new_tokens=6)
    small = EmbeddedEngine(tiny_model_dirs["qwen2"], max_batch_tokens=20)
    assert small.generate(PROMPTS, params).response_ids == engine.generate(PROMPTS, params).response_ids


def test_plan_sub_batches_covers_every_row_within_the_budget():
    lengths = [7, 1, 12, 3, 30]
    n, max_new, budget = 3, 5, 60
    batches = plan_sub_batches(lengths, n, max_new, budget)
    seen = []
    for groups in batches:
        rows = sum(group.count for group in groups)
        width = max(lengths[group.prompt_index] for group in groups) + max_new
        assert rows * width <= budget or rows == 1
        seen += [(group.prompt_index, group.first_sample + k) for group in groups for k in range(group.count)]
    assert sorted(seen) == [(p, s) for p in range(len(lengths)) for s in range(n)]
    assert len(batches) > 1
    (unbounded,) = plan_sub_batches(lengths, n, max_new, None)
    assert [(g.prompt_index, g.first_sample, g.count) for g in unbounded] == [(p, 0, n) for p in range(len(lengths))]


# ---------------------------------------------------------------------------------- log-probs


@pytest.mark.parametrize("temperature, top_k, top_p", [(0.7, 50, 0.9), (1.0, -1, 1.0), (1.3, 5, 1.0)])
def test_sampled_log_probs_equal_full_forward(engine, reference, temperature, top_k, top_p):
    # Many stop tokens make rows end at different steps (cache compaction under sampling).
    params = SamplingParams(
        n=2, temperature=temperature, top_k=top_k, top_p=top_p, max_new_tokens=12, seed=3,
        stop_token_ids=tuple(range(0, 300, 10)),
    )
    out = engine.generate(PROMPTS, params)
    assert len({len(r) for r in out.response_ids}) > 1
    for index, response, log_probs in zip(out.prompt_index, out.response_ids, out.log_probs):
        assert log_probs.dtype == torch.float32 and log_probs.shape == (len(response),)
        expected = reference_log_probs(reference, PROMPTS[index], response, temperature)
        torch.testing.assert_close(log_probs, expected, atol=1e-5, rtol=0)
        if top_k != -1:  # every sampled token is within the reference's top-k at its step
            with torch.no_grad():
                logits = reference(torch.tensor([PROMPTS[index] + response])).logits[0, len(PROMPTS[index]) - 1 : -1]
            ranks = (logits > logits.gather(-1, torch.tensor(response)[:, None])).sum(-1)
            assert int(ranks.max()) < top_k


def test_greedy_log_probs_are_at_temperature_one(engine, reference):
    out = engine.generate(PROMPTS[:2], SamplingParams(temperature=0, max_new_tokens=5))
    for prompt, response, log_probs in zip(PROMPTS, out.response_ids, out.log_probs):
        torch.testing.assert_close(log_probs, reference_log_probs(reference, prompt, response, 1.0), atol=1e-5, rtol=0)


def test_logprobs_off(engine):
    out = engine.generate(PROMPTS[:1], SamplingParams(max_new_tokens=3, seed=0, logprobs=False))
    assert out.log_probs is None and len(out.response_ids[0]) == 3


# ---------------------------------------------------------------------------------- seeds, top-k, top-p


def test_seed_reproducible_and_seeds_differ(engine):
    def sample(seed):
        return engine.generate(PROMPTS, SamplingParams(n=2, temperature=1.0, max_new_tokens=8, seed=seed))

    first, again, other = sample(7), sample(7), sample(8)
    assert first.response_ids == again.response_ids
    assert all(torch.equal(a, b) for a, b in zip(first.log_probs, again.log_probs))
    assert first.response_ids != other.response_ids
    assert sample(None).response_ids != sample(None).response_ids


def test_top_k_one_and_tiny_top_p_are_greedy(engine):
    greedy = engine.generate(PROMPTS, SamplingParams(temperature=0, max_new_tokens=8)).response_ids
    top_k = engine.generate(PROMPTS, SamplingParams(temperature=1.5, top_k=1, max_new_tokens=8, seed=1))
    top_p = engine.generate(PROMPTS, SamplingParams(temperature=1.5, top_p=1e-6, max_new_tokens=8, seed=2))
    assert top_k.response_ids == greedy
    assert top_p.response_ids == greedy


def test_filter_top_k_top_p_on_known_distribution():
    logits = torch.log(torch.tensor([[0.05, 0.5, 0.15, 0.3]]))
    kept = lambda filtered: torch.isfinite(filtered[0]).tolist()  # noqa: E731
    assert kept(filter_top_k_top_p(logits, top_k=2, top_p=1.0)) == [False, True, False, True]
    assert kept(filter_top_k_top_p(logits, top_k=-1, top_p=0.75)) == [False, True, False, True]
    assert kept(filter_top_k_top_p(logits, top_k=-1, top_p=0.85)) == [False, True, True, True]
    assert kept(filter_top_k_top_p(logits, top_k=-1, top_p=0.4)) == [False, True, False, False]
    # top-p acts on the distribution renormalised after top-k: {0.5, 0.3, 0.15} -> 0.526, 0.316, 0.158.
    assert kept(filter_top_k_top_p(logits, top_k=3, top_p=0.8)) == [False, True, False, True]
    assert kept(filter_top_k_top_p(logits, top_k=3, top_p=0.85)) == [False, True, True, True]


def test_sampling_frequencies_follow_the_filtered_distribution():
    # top-k 3 of {0.05, 0.5, 0.15, 0.3} at T = 1 renormalises to {0, 0.526, 0.158, 0.316}.
    logits = torch.log(torch.tensor([0.05, 0.5, 0.15, 0.3])).expand(20000, 4)
    params = SamplingParams(temperature=1.0, top_k=3, seed=0)
    tokens, log_probs = sample_next_tokens(logits, params, torch.Generator().manual_seed(0))
    frequencies = torch.bincount(tokens, minlength=4).float() / tokens.numel()
    torch.testing.assert_close(frequencies, torch.tensor([0.0, 0.5, 0.15, 0.3]) / 0.95, atol=0.015, rtol=0)
    # The reported log-prob is the unfiltered one: log 0.5 for token 1, not log 0.526.
    torch.testing.assert_close(log_probs[tokens == 1], torch.full_like(log_probs[tokens == 1], math.log(0.5)))


# ---------------------------------------------------------------------------------- EOS and truncation


def test_eos_and_length_finish_reasons(tiny_model_dirs, engine):
    free = engine.generate(PROMPTS, SamplingParams(temperature=0, max_new_tokens=12)).response_ids
    eos = free[0][4]
    first_eos = free[0].index(eos)  # 4 unless the token also came earlier
    eos_engine = EmbeddedEngine(tiny_model_dirs["qwen2"], eos_token_ids=[eos])

    ended = eos_engine.generate(PROMPTS[:1], SamplingParams(temperature=0, max_new_tokens=12))
    assert ended.response_ids[0] == free[0][: first_eos + 1]  # EOS kept in the response
    assert ended.finish_reasons == ["stop"] and ended.truncated.tolist() == [False]

    # EOS exactly at the limit is a normal end, not a truncation.
    at_limit = eos_engine.generate(PROMPTS[:1], SamplingParams(temperature=0, max_new_tokens=first_eos + 1))
    assert at_limit.response_ids[0][-1] == eos
    assert at_limit.finish_reasons == ["stop"] and at_limit.truncated.tolist() == [False]

    # One token earlier: cut by length.
    cut = eos_engine.generate(PROMPTS[:1], SamplingParams(temperature=0, max_new_tokens=first_eos))
    assert cut.response_ids[0] == free[0][:first_eos]
    assert cut.finish_reasons == ["length"] and cut.truncated.tolist() == [True]
    assert cut.response_lengths.tolist() == [first_eos]


def test_default_eos_comes_from_generation_config_and_config():
    model = build_tiny_model("qwen2", seed=3)
    model.generation_config.eos_token_id = [11, 12]
    model.config.eos_token_id = 12
    assert EmbeddedEngine(model).eos_token_ids == (11, 12)


def test_eos_forced_through_the_weights_ends_every_sample(tiny_model_dirs):
    # lm_head rows all zero but 42 = +c e_0 and 43 = -c e_0: whatever the sign of the normed hidden
    # unit 0, one of the two EOS tokens gets a logit of ~c |h_0| against 0 for all others.
    engine = EmbeddedEngine(tiny_model_dirs["qwen2"], eos_token_ids=[42, 43])
    lm_head = torch.zeros_like(dict(engine.named_weights())["lm_head.weight"])
    lm_head[42, 0], lm_head[43, 0] = 1e5, -1e5
    engine.load_weights([("lm_head.weight", lm_head)])
    for max_new_tokens in (5, 1):  # 1: EOS exactly at the limit is still not a truncation
        out = engine.generate(PROMPTS, SamplingParams(n=3, temperature=1.0, max_new_tokens=max_new_tokens, seed=0))
        assert all(response in ([42], [43]) for response in out.response_ids)
        assert out.finish_reasons == ["stop"] * 12 and not out.truncated.any()
        assert {response[0] for response in out.response_ids} == {42, 43}


# ---------------------------------------------------------------------------------- n > 1 ordering


def test_n_samples_are_prompt_major(engine):
    greedy = engine.generate(PROMPTS, SamplingParams(temperature=0, max_new_tokens=5)).response_ids
    out = engine.generate(PROMPTS, SamplingParams(n=3, temperature=0, max_new_tokens=5))
    assert out.prompt_index == [0, 0, 0, 1, 1, 1, 2, 2, 2, 3, 3, 3]
    assert out.response_ids == [response for response in greedy for _ in range(3)]
    sampled = engine.generate(PROMPTS, SamplingParams(n=3, temperature=1.0, max_new_tokens=5, seed=0))
    assert len(sampled) == 12 and len(sampled.finish_reasons) == 12 and sampled.truncated.shape == (12,)
    assert len({tuple(r) for r in sampled.response_ids[:3]}) > 1, "samples of one prompt should differ"


# ---------------------------------------------------------------------------------- weights


def other_engine(tmp_path, arch: str, seed: int) -> EmbeddedEngine:
    """An engine on differently drawn weights, loaded the same way as the fixture's (same attention)."""
    return EmbeddedEngine(save_tiny_model(arch, tmp_path / f"{arch}_{seed}", seed=seed))


def test_named_weights_round_trip_into_a_different_model(engine, tmp_path):
    other = other_engine(tmp_path, "qwen2", seed=5)
    params = SamplingParams(n=2, temperature=1.0, max_new_tokens=8, seed=4)
    before = other.generate(PROMPTS, params)
    expected = engine.generate(PROMPTS, params)
    assert before.response_ids != expected.response_ids

    names = [name for name, _ in engine.named_weights()]
    assert "lm_head.weight" in names and len(names) == len(set(names))
    other.reset_load_tracking()
    other.load_weights(engine.named_weights())
    assert other.missing_after_load() == []
    after = other.generate(PROMPTS, params)
    assert after.response_ids == expected.response_ids
    assert all(torch.equal(a, b) for a, b in zip(after.log_probs, expected.log_probs))


def test_partial_load_is_reported_missing():
    engine = EmbeddedEngine(build_tiny_model("qwen2", seed=6))
    weights = dict(engine.named_weights())
    engine.load_weights(reversed([(name, weights[name].clone()) for name in list(weights)[:3]]))
    assert engine.missing_after_load() == list(weights)[3:]


def test_tied_embeddings_stay_one_parameter(tiny_model_dirs, tmp_path):
    engine = EmbeddedEngine(tiny_model_dirs["qwen2_tied"])
    model = engine.model
    assert model.lm_head.weight is model.model.embed_tokens.weight
    names = [name for name, _ in engine.named_weights()]
    assert "lm_head.weight" not in names and "model.embed_tokens.weight" in names

    params = SamplingParams(temperature=0, max_new_tokens=6)
    before = engine.generate(PROMPTS, params).response_ids
    new_embedding = torch.randn(model.lm_head.weight.shape, generator=torch.Generator().manual_seed(0)) / 8
    engine.load_weights([("model.embed_tokens.weight", new_embedding)])
    assert torch.equal(model.lm_head.weight, new_embedding)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert engine.generate(PROMPTS, params).response_ids != before

    engine.load_weights([("lm_head.weight", 2 * new_embedding)])
    assert torch.equal(model.model.embed_tokens.weight, 2 * new_embedding)

    # A full tied push without lm_head.weight leaves nothing missing.
    fresh = other_engine(tmp_path, "qwen2_tied", seed=9)
    fresh.load_weights(engine.named_weights())
    assert fresh.missing_after_load() == []
    assert fresh.generate(PROMPTS, params).response_ids == engine.generate(PROMPTS, params).response_ids


def test_load_weights_errors_name_the_tensor(engine):
    with pytest.raises(KeyError, match="model.layers.0.mlp.not_a_weight"):
        engine.load_weights([("model.layers.0.mlp.not_a_weight", torch.zeros(1))])
    with pytest.raises(ValueError, match="model.norm.weight"):
        engine.load_weights([("model.norm.weight", torch.zeros(3))])


# ---------------------------------------------------------------------------------- stop strings, lifecycle


def test_stop_strings_end_the_response(tiny_model_dirs):
    from megatron_dapo.data.arithmetic import build_tokenizer

    tokenizer = build_tokenizer()
    engine = EmbeddedEngine(tiny_model_dirs["qwen2"], tokenizer=tokenizer)
    free = engine.generate(PROMPTS[:1], SamplingParams(temperature=0, max_new_tokens=12)).response_ids[0]
    text = tokenizer.decode(free, skip_special_tokens=False)
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    # Reference: the shortest prefix whose full decoded text contains the stop string.
    decoded = [tokenizer.decode(free[:n], skip_special_tokens=False) for n in range(1, len(free) + 1)]
    expected_length = next(n for n, prefix_text in enumerate(decoded, start=1) if stop in prefix_text)
    out = engine.generate(PROMPTS[:1], SamplingParams(temperature=0, max_new_tokens=12, stop=(stop,)))
    assert out.response_ids[0] == free[:expected_length]
    assert out.finish_reasons == ["stop"] and not out.truncated[0]
    with pytest.raises(ValueError, match="tokenizer"):
        EmbeddedEngine(tiny_model_dirs["qwen2"]).generate(PROMPTS[:1], SamplingParams(stop=("x",)))


def test_sleep_wake_and_shutdown(tiny_model_dirs):
    engine = EmbeddedEngine(tiny_model_dirs["qwen2"])
    params = SamplingParams(temperature=0, max_new_tokens=4)
    before = engine.generate(PROMPTS, params).response_ids
    engine.sleep()
    engine.wake_up()
    assert engine.generate(PROMPTS, params).response_ids == before
    engine.sleep(level=2)  # the trainer's order: weights, push, KV cache (CPU: nothing moves)
    engine.wake_up(["weights"])
    engine.wake_up(["kv_cache"])
    assert engine.generate(PROMPTS, params).response_ids == before
    with pytest.raises(ValueError, match="1 or 2"):
        engine.sleep(level=0)
    with pytest.raises(ValueError, match="unknown memory tags"):
        engine.wake_up(["scheduling"])
    with engine:
        pass
    with pytest.raises(RuntimeError, match="shut down"):
        engine.generate(PROMPTS, params)


def test_only_cuda_weights_leave_their_device_to_sleep():
    assert sleep_moves_weights(torch.device("cuda")) and sleep_moves_weights("cuda:1")
    assert not sleep_moves_weights(torch.device("cpu")) and not sleep_moves_weights("cpu")


# The CPU always; CUDA too where the machine has it (there the weights really move).
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("device", DEVICES)
def test_asleep_until_the_weights_wake(tiny_model_dirs, device):
    """sleep -> (no generate) -> wake KV cache (still asleep) -> wake weights: the trainer's order,
    enforced on every device; the weights sit in host memory in between, tied LM head kept."""
    engine = EmbeddedEngine(tiny_model_dirs["qwen2_tied"], device=device)
    params = SamplingParams(temperature=0, max_new_tokens=4)
    before = engine.generate(PROMPTS, params).response_ids
    engine.sleep()
    assert all(p.device.type == "cpu" for p in engine.model.parameters())
    with pytest.raises(RuntimeError, match="asleep"):
        engine.generate(PROMPTS, params)
    engine.wake_up(["kv_cache"])  # the KV cache alone brings back nothing
    assert all(p.device.type == "cpu" for p in engine.model.parameters())
    with pytest.raises(RuntimeError, match="asleep"):
        engine.generate(PROMPTS, params)
    engine.wake_up(["weights"])
    assert all(p.device.type == torch.device(device).type for p in engine.model.parameters())
    assert engine.model.lm_head.weight is engine.model.model.embed_tokens.weight
    assert engine.generate(PROMPTS, params).response_ids == before


# ---------------------------------------------------------------------------------- pushes between decode steps


def test_a_push_between_decode_steps_continues_the_rows_with_the_new_weights(tiny_model_dirs, reference):
    """A push lands after a few decode steps (partial rollouts): rows still running carry on with the
    new weights, from a KV cache recomputed with them. Every token's engine log-prob equals a full
    forward of prompt + response so far with the weights it was sampled with, the spans say which."""
    from tests.support.pushes import ScriptedPushes

    engine = EmbeddedEngine(tiny_model_dirs["qwen2"])
    new_model = build_tiny_model("qwen2", seed=11)  # other weights, same shapes
    pushes = ScriptedPushes([(4, list(new_model.state_dict().items()))], start_version=3)
    params = SamplingParams(n=2, temperature=1.0, max_new_tokens=12, seed=5)
    out = engine.generate(PROMPTS, params, pushes=pushes)

    assert pushes.exhausted and pushes.loaded_buckets == 2
    # Asked once before the sub-batch, then before each decode step: the 4th ask is after token 3.
    landed_at = 3
    assert len(out.weight_versions) == len(out)
    for response, log_probs, spans, index in zip(out.response_ids, out.log_probs, out.weight_versions, out.prompt_index):
        prompt = PROMPTS[index]
        if len(response) <= landed_at:
            assert spans == ((0, 3),)
        else:
            assert spans == ((0, 3), (landed_at, 4))
        torch.testing.assert_close(log_probs[:landed_at], reference_log_probs(reference, prompt, response, 1.0)[:landed_at], atol=1e-4, rtol=0)
        if len(response) > landed_at:
            after = reference_log_probs(new_model.eval(), prompt, response, 1.0)[landed_at:]
            torch.testing.assert_close(log_probs[landed_at:], after, atol=1e-4, rtol=0)
    # The engine holds the new weights afterwards; a call without pushes reports no versions.
    plain = engine.generate(PROMPTS[:1], SamplingParams(n=1, temperature=0.0, max_new_tokens=4))
    assert plain.weight_versions is None
    assert plain.response_ids[0] == naive_greedy(new_model, PROMPTS[0], 4)[0]


def test_a_push_between_sub_batches_and_the_versions_of_each(tiny_model_dirs, reference):
    """Rows of a later sub-batch start with the weights pushed before it, from token 0."""
    from tests.support.pushes import ScriptedPushes

    engine = EmbeddedEngine(tiny_model_dirs["qwen2"], max_batch_tokens=10)  # one prompt a sub-batch
    new_model = build_tiny_model("qwen2", seed=12)
    # Asks: before sub-batch 1, before its 2 decode steps, then before sub-batch 2 (the 4th).
    pushes = ScriptedPushes([(4, list(new_model.state_dict().items()))])
    out = engine.generate(PROMPTS[:2], SamplingParams(n=1, temperature=0.0, max_new_tokens=3), pushes=pushes)
    assert out.weight_versions == [((0, 0),), ((0, 1),)]
    assert out.response_ids[0] == naive_greedy(reference, PROMPTS[0], 3)[0]
    assert out.response_ids[1] == naive_greedy(new_model, PROMPTS[1], 3)[0]


def test_pushes_and_routed_experts_are_refused_together(engine):
    from tests.support.pushes import ScriptedPushes

    with pytest.raises(ValueError, match="routed experts"):
        engine.generate(PROMPTS[:1], SamplingParams(return_routed_experts=True), pushes=ScriptedPushes([]))
