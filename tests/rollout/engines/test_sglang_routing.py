"""SGLang returns the routed experts of a mixture-of-experts model (rollout routing replay, R3), with
the REAL SGLang engine (0.5.23, its CPU engine, float32; `cpu_compat` lets its routed-experts capturer
allocate its host buffer without CUDA).

One engine on a tiny Qwen3-MoE (weights A). The reference is independent of the adapter: a
separately loaded HF model's routers recorded over a full forward of prompt + response
(`model.hf_routing`). After an in-place push of other weights (B: the per-expert HF names of a
whole MoE model into SGLang's fused experts), the routing is B's: the expert weights and routers
were replaced, not only the dense ones.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from megatron_dapo.model.hf_routing import RoutingRecorder
from megatron_dapo.rollout.base import SamplingParams
from tests.support.tiny_models import load_hf_model, save_tiny_model

pytestmark = [pytest.mark.usefixtures("require_sglang"), pytest.mark.launch]

PROMPTS = [[17, 3, 250, 41, 99, 8, 120], [5], [200, 201, 202, 13, 77, 31, 64, 2, 9]]
PARAMS = SamplingParams(n=2, temperature=1.0, max_new_tokens=8, seed=3, return_routed_experts=True)


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory, require_sglang) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("sglang_moe")
    return {"A": save_tiny_model("qwen3_moe", root / "a", seed=0), "B": save_tiny_model("qwen3_moe", root / "b", seed=1)}


@pytest.fixture(scope="module")
def engine(model_dirs):
    from megatron_dapo.rollout.engines.sglang.engine import SGLangEngine

    with SGLangEngine(model_dirs["A"], dtype="float32", skip_tokenizer_init=True, return_routed_experts=True) as started:
        yield started


def _routing_equals_hf(out, model_dir: Path) -> tuple[int, int]:
    """(equal, compared) (token, layer) pairs of the returned routing against HF's full forward."""
    model = load_hf_model(model_dir)
    recorder = RoutingRecorder(model)
    equal = compared = 0
    for index, (prompt_index, response) in enumerate(zip(out.prompt_index, out.response_ids)):
        tokens = torch.tensor(PROMPTS[prompt_index] + list(response))[:-1]
        with recorder, torch.no_grad():
            model(input_ids=tokens[None])
        want = recorder.take(1, tokens.numel())[0]
        got = out.routed_experts[index]
        assert got.dtype == torch.int32 and got.shape == want.shape, (tuple(got.shape), tuple(want.shape))
        same = (got.sort(dim=-1).values == want.sort(dim=-1).values).all(dim=-1)
        equal, compared = equal + int(same.sum()), compared + same.numel()
    return equal, compared


def test_returned_routing_is_hfs_and_follows_a_weight_push(engine, model_dirs):
    from safetensors.torch import load_file

    out = engine.generate(PROMPTS, PARAMS)
    assert len(out.routed_experts) == len(PROMPTS) * PARAMS.n
    equal, compared = _routing_equals_hf(out, model_dirs["A"])
    assert equal == compared, f"weights A: {compared - equal} of {compared} (token, layer) pairs differ"

    engine.load_weights(load_file(str(model_dirs["B"] / "model.safetensors")).items())
    engine.commit_weights()
    pushed = engine.generate(PROMPTS, PARAMS)
    equal, compared = _routing_equals_hf(pushed, model_dirs["B"])
    assert equal == compared, f"after the push of B: {compared - equal} of {compared} (token, layer) pairs differ"
    unchanged, _ = _routing_equals_hf(pushed, model_dirs["A"])
    assert unchanged < compared  # A and B route differently: the comparison above could fail


def test_routing_is_refused_unless_the_engine_was_started_for_it(model_dirs):
    from megatron_dapo.rollout.engines.sglang.engine import collect_sglang_outputs

    with pytest.raises(RuntimeError, match="no routed experts"):
        collect_sglang_outputs([{"output_ids": [1], "meta_info": {"finish_reason": {"type": "length"}}}], 1,
                               SamplingParams(logprobs=False, return_routed_experts=True), [3], (2, 2))  # fmt: skip
