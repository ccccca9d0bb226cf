"""The embedded engine returns the experts its MoE layers routed every token to (rollout routing
replay, R3), checked against an independent reference: a full no-cache forward of prompt + response
through a separately loaded HF model, its routers' choices recorded (`model.hf_routing`)."""

from __future__ import annotations

import pytest
import torch

from megatron_dapo.model.hf_routing import RoutingRecorder, hf_moe_routers
from megatron_dapo.rollout.base import SamplingParams
from megatron_dapo.rollout.engines.embedded import EmbeddedEngine
from tests.support.tiny_models import MOE_ARCHS, load_hf_model, save_tiny_model

PROMPTS = [[17, 3, 250, 41, 99, 8, 120], [5], [200, 201, 202, 13, 77, 31, 64, 2, 9, 150, 11, 42], [66, 67, 68]]


@pytest.fixture(scope="module")
def moe_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe_routing")
    return {arch: save_tiny_model(arch, root / arch, seed=5 + i) for i, arch in enumerate(MOE_ARCHS)}


def _reference_routing(model, prompt, response) -> torch.Tensor:
    """[p + r - 1, L, k]: the routing of a full forward over the tokens the model reads."""
    tokens = torch.tensor(list(prompt) + list(response))[:-1]
    recorder = RoutingRecorder(model)
    with recorder, torch.no_grad():
        model(input_ids=tokens[None])
    return recorder.take(1, tokens.numel())[0]


@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_returned_routing_is_the_full_forwards_routing(moe_dirs, arch):
    reference_model = load_hf_model(moe_dirs[arch])
    params = SamplingParams(n=3, temperature=1.0, max_new_tokens=10, seed=4, return_routed_experts=True)
    # An EOS that the sampled responses contain, so rows finish early and leave the batch; small
    # sub-batches, so there are several prefills.
    free = EmbeddedEngine(moe_dirs[arch], eos_token_ids=[], max_batch_tokens=60).generate(PROMPTS, params)
    eos = free.response_ids[0][2]
    engine = EmbeddedEngine(moe_dirs[arch], eos_token_ids=[eos], max_batch_tokens=60)
    out = engine.generate(PROMPTS, params)
    assert out.routed_experts is not None and len(out.routed_experts) == len(out.response_ids)
    lengths = {len(r) for r in out.response_ids}
    assert len(lengths) > 1, "every response had the same length: the early-finish path was not exercised"
    layers, topk = len(hf_moe_routers(reference_model)), reference_model.config.num_experts_per_tok
    compared = equal = 0
    for index, (prompt_index, response) in enumerate(zip(out.prompt_index, out.response_ids)):
        got = out.routed_experts[index]
        prompt = PROMPTS[prompt_index]
        assert got.dtype == torch.int32 and tuple(got.shape) == (len(prompt) + len(response) - 1, layers, topk)
        want = _reference_routing(reference_model, prompt, response)
        same = (got.sort(dim=-1).values == want.sort(dim=-1).values).all(dim=-1)
        compared += same.numel()
        equal += int(same.sum())
    assert equal == compared, f"{compared - equal} of {compared} (token, layer) pairs routed differently"


def test_routing_is_not_returned_unless_asked_and_a_dense_model_refuses(moe_dirs, tiny_model_dirs):
    engine = EmbeddedEngine(moe_dirs["qwen3_moe"])
    assert engine.generate(PROMPTS[:1], SamplingParams(max_new_tokens=3, seed=0)).routed_experts is None
    dense = EmbeddedEngine(tiny_model_dirs["qwen2"])
    with pytest.raises(ValueError, match="no mixture-of-experts router"):
        dense.generate(PROMPTS[:1], SamplingParams(max_new_tokens=3, seed=0, return_routed_experts=True))
