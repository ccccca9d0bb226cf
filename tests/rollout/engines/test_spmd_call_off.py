"""SIGTERM calls off an spmd engine's generation batch within a few engine steps (issue 26, item 4).

In the spmd placement the ranks of a rollout-TP group step their vLLM shards together (TP
collectives in every step), so none can leave a batch alone: `VLLMEngine.generate` steps vLLM's
engine itself and asks a `call_off` vote every `CALL_OFF_CHECK_STEPS` steps; the group agrees on
it (all-reduce over vLLM's gloo TP group), aborts the batch and raises `GenerationCalledOff` on
every rank at the same step. The trainer's vote is its SIGTERM flag or the world's gather meeting
called off by another rank (`liveness.called_off`), and it turns the call-off into the gather
meeting's (`SigtermFlag.calling_off_generation`).

One torchrun launch of 2 ranks with a TP=2 spmd engine on the real vLLM CPU build
(_spmd_call_off_worker.py), a tiny random Qwen2 without an EOS token (every response runs to
max_new_tokens, so the batch's length is known): the stepped loop gives `LLM.generate`'s outputs
exactly; SIGTERM to both ranks, to one rank (the other learns it from the vote: that it leaves at
all is the proof of agreement, a rank that stepped on alone would hang in the step's collectives),
or the gather meeting called off elsewhere, ends the batch on both ranks within a small part of its
time; the engine is clean afterwards. The pure parts: tests/distributed/test_liveness_called_off.py,
tests/trainer/test_call_off_vote.py.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.support.tiny_models import build_random_model
from tests.support.torchrun_utils import run_torchrun_function

WORKER = Path(__file__).with_name("_spmd_call_off_worker.py")
LONG_TOKENS = 3000
DELAY_S = 2.0


NEVER_SAMPLED = range(4)
"""Token ids the test model cannot emit: whatever EOS vLLM finds for a directory without a tokenizer
(transformers builds a one-token Qwen2 tokenizer from the config: EOS 0) is among them."""


def _save_model(out_dir: Path) -> Path:
    """A tiny random Qwen2 (head_dim 32 for vLLM's CPU attention, 2 KV heads: one per TP rank) whose
    responses never end early: hidden dimension 0 of the residual stream is a positive constant
    (every embedding has it, no layer reads or writes it) and the output rows of `NEVER_SAMPLED`
    read it with a large negative weight, so those logits are far below every other."""
    import torch
    from transformers import Qwen2Config

    config = Qwen2Config(
        hidden_size=128, num_attention_heads=4, num_key_value_heads=2, intermediate_size=256, num_hidden_layers=2,
        vocab_size=300, max_position_embeddings=LONG_TOKENS + 64, rms_norm_eps=1e-6, rope_theta=10000.0,
        tie_word_embeddings=False, eos_token_id=None, bos_token_id=None,
    )  # fmt: skip
    config.architectures = ["Qwen2ForCausalLM"]
    model = build_random_model(config, seed=3)
    with torch.no_grad():
        model.model.embed_tokens.weight[:, 0] = 8.0
        for layer in model.model.layers:
            layer.input_layernorm.weight[0] = layer.post_attention_layernorm.weight[0] = 0.0
            layer.self_attn.o_proj.weight[0] = layer.mlp.down_proj.weight[0] = 0.0
        model.model.norm.weight[0] = 1.0
        for token in NEVER_SAMPLED:
            model.lm_head.weight[token] = 0.0
            model.lm_head.weight[token, 0] = -20.0
    model.save_pretrained(out_dir)
    return out_dir


@pytest.fixture(scope="module")
def call_off_results(require_vllm, tmp_path_factory):
    from tests.support.ci import skip_or_fail

    if len(os.sched_getaffinity(0)) < 2:
        skip_or_fail("the spmd call-off test runs two ranks with one vLLM shard each and needs 2 CPUs")
    model_dir = _save_model(tmp_path_factory.mktemp("spmd_call_off") / "qwen2_no_eos")
    result = run_torchrun_function(
        WORKER, "main", nproc=2, timeout=600, kwargs={"model_dir": str(model_dir), "long_tokens": LONG_TOKENS, "delay_s": DELAY_S}
    )
    result.check()
    assert all(r is not None and "error" not in r for r in result.rank_results), result.tail()
    ranks = result.rank_results
    full = ranks[0]["control"]["batch_s"]
    print(f"\n[spmd call-off] engine start {ranks[0]['engine_start_s']:.1f} s; uncalled batch of {LONG_TOKENS} steps {full:.1f} s "
          f"({1000 * full / LONG_TOKENS:.1f} ms a step), {ranks[0]['control']['asked']} checks of {ranks[0]['check_ms']:.2f} ms")  # fmt: skip
    for name in ranks[0]["scenarios"]:
        seconds = ", ".join(f"rank {r['rank']} {r['scenarios'][name]['after_sigterm_s']:.2f} s" for r in ranks)
        print(f"[spmd call-off] {name}: signal to exit {seconds} (stopped at check {ranks[0]['scenarios'][name]['asked']})")
    return ranks


def test_stepping_the_engine_gives_llm_generate_outputs(call_off_results):
    for r in call_off_results:
        short = r["short"]
        assert short["reference"]["responses"] and short["reference"]["finish_reasons"] == ["length"] * 8
        assert short["stepped"] == short["reference"], r["rank"]
        assert short["checked"] == short["reference"], r["rank"]
        assert short["per_prompt_checked"] == short["per_prompt_reference"], r["rank"]
        assert short["per_prompt_reference"]["responses"] != short["reference"]["responses"]  # another seed path
        # 3 x CALL_OFF_CHECK_STEPS new tokens: asked at step 0 and every CALL_OFF_CHECK_STEPS steps after
        assert short["asked"] >= 3, short["asked"]
    assert call_off_results[0]["short"]["reference"] == call_off_results[1]["short"]["reference"]


def test_the_control_batch_runs_to_its_end_and_asks_every_few_steps(call_off_results):
    first = call_off_results[0]
    control = first["control"]
    assert control["lengths"] == [LONG_TOKENS] * 8 and control["finish_reasons"] == ["length"]
    assert not control["received"]
    for r in call_off_results:
        # about one check per CALL_OFF_CHECK_STEPS steps of the batch (~LONG_TOKENS steps), on every rank alike
        assert LONG_TOKENS / r["check_steps"] - 2 <= r["control"]["asked"] <= LONG_TOKENS / r["check_steps"] + 3, r["control"]
    assert call_off_results[0]["control"]["asked"] == call_off_results[1]["control"]["asked"]
    # long enough that a call-off ~DELAY_S in cuts it short by far
    assert control["batch_s"] > 2 * DELAY_S, control


@pytest.mark.parametrize(
    "name, raised",
    [
        ("engine_both", "GenerationCalledOff"),
        ("engine_one", "GenerationCalledOff"),
        ("trainer_replica", "MeetingCalledOff"),
        ("trainer_one", "MeetingCalledOff"),
    ],
)
def test_a_call_off_ends_the_batch_on_every_rank_within_a_few_steps(call_off_results, name, raised):
    full = call_off_results[0]["control"]["batch_s"]
    targets = {"engine_both": {0, 1}, "engine_one": {1}, "trainer_replica": set(), "trainer_one": {0}}[name]
    checks = {r["scenarios"][name]["asked"] for r in call_off_results}
    assert len(checks) == 1, [r["scenarios"][name] for r in call_off_results]  # both ranks stopped at the same step
    for r in call_off_results:
        s = r["scenarios"][name]
        assert s["outcome"] == raised, (r["rank"], s)
        assert s["received"] == (r["rank"] in targets), (r["rank"], s)
        # SIGTERM (or the call-off) to leaving: a few engine steps, not what was left of the batch
        assert 0 <= s["after_sigterm_s"] < min(0.3 * full, 10.0), (r["rank"], s, full)
        assert s["asked"] * r["check_steps"] < 0.8 * LONG_TOKENS, (r["rank"], s)  # stopped well before its end
        assert not s["engine_unfinished"], (r["rank"], s)  # the batch's requests were aborted
        if name.startswith("trainer"):
            assert s["gather"] == "called off", (r["rank"], s)  # the waiting ranks take the same way out
            assert s["next_called_off"] is False, (r["rank"], s)  # only that meeting


def test_the_engine_is_clean_after_the_call_offs(call_off_results):
    for r in call_off_results:
        assert r["short_after"] == r["short"]["reference"], r["rank"]
