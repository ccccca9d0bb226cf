"""Contract tests of the SGLang adapter's GPU-only calls, which the CPU test machine cannot run.

Everything else (generation, the weight-update session, both push formats, sleep / wake with
SGLang's memory tags, the cache flush, reading weights back, TP = 2) runs against the real SGLang
0.5.23 CPU engine in test_sglang_engine.py and the check-sync tests. What is left here is what
only a GPU engine does: the engine's construction on CUDA (memory saver on, GPU placement), the
CUDA IPC path of the flattened buckets (SGLang's reduction fix applied once, one serialised
payload per TP rank), the memory saver's sleep / wake calls (with the saver off on a GPU, none),
and a push landing mid-generation on CUDA (partial rollouts: its calls in order). A fake `sglang.Engine` (tests/support/fake_sglang.py, installed by the `fake` fixture)
records these calls; `test_the_fake_has_the_tested_release_signatures` checks every call it
records against the installed SGLang 0.5.23 (its source is the contract).
"""

from __future__ import annotations

import inspect
import sys

import pytest
import torch

from megatron_dapo.rollout.engines.sglang import engine as sglang_engine
from megatron_dapo.rollout.base import SamplingParams
from megatron_dapo.rollout.engines.sglang.engine import SGLangEngine, collect_sglang_outputs, sglang_sampling_params


def gpu_engine(tmp_path, **kwargs) -> SGLangEngine:
    """The adapter on its CUDA path; no GPU here, so pushed buckets stay on the CPU (the calls are the GPU path's)."""
    engine = SGLangEngine(tmp_path / "model", device="cuda", **kwargs)
    engine._device = torch.device("cpu")
    return engine


# --------------------------------------------------------------------------------------------------


def test_engine_is_built_on_cuda_with_exact_arguments(fake, tmp_path):
    gpu_engine(tmp_path, tensor_parallel_size=2, dtype="bfloat16", mem_fraction_static=0.5, max_model_len=4096, seed=7,
               base_gpu_id=2, gpu_id_step=1, attention_backend="fa3")  # fmt: skip
    assert fake.calls == [
        (
            "Engine",
            dict(
                model_path=str(tmp_path / "model"),
                tp_size=2,
                dtype="bfloat16",
                mem_fraction_static=0.5,
                random_seed=7,
                enable_memory_saver=True,  # CUDA default (SGLang's memory saver is CUDA-only)
                base_gpu_id=2,
                gpu_id_step=1,
                context_length=4096,
                log_level="error",
                attention_backend="fa3",
            ),
        )
    ]


def test_engine_gets_the_ports_of_its_node_slot(fake, tmp_path, monkeypatch):
    """Engines of one node (one per replica leader, started at once) get disjoint port / nccl_port."""
    monkeypatch.setattr(sglang_engine, "port_is_free", lambda port: port != 20006)  # slot 3's first pair is taken
    monkeypatch.setenv("LOCAL_RANK", "3")
    assert gpu_engine(tmp_path).ports == (20006 + 2 * 64, 20007 + 2 * 64)
    monkeypatch.setenv("LOCAL_RANK", "2")
    gpu_engine(tmp_path, base_port=30000)
    gpu_engine(tmp_path, port_slot=5)
    gpu_engine(tmp_path, port=31000, nccl_port=31001)  # the caller's own win
    engines = [kwargs for name, kwargs in fake.calls if name == "Engine"]
    assert [(e["port"], e["nccl_port"]) for e in engines] == [(20134, 20135), (30004, 30005), (20010, 20011), (31000, 31001)]
    monkeypatch.delenv("LOCAL_RANK")
    monkeypatch.setenv("SLURM_LOCALID", "1")  # srun without init_distributed's LOCAL_RANK
    assert gpu_engine(tmp_path).ports == (20002, 20003)


def test_buckets_are_handed_over_on_the_gpu_on_cuda(fake, tmp_path):
    """The CUDA path never moves a bucket to the host: it stays on this process's GPU (CUDA IPC handles)."""
    assert SGLangEngine(tmp_path / "model", device="cuda")._device.type == "cuda"  # gpu_engine() overrides it for this machine


def test_cuda_buckets_carry_one_payload_per_tp_rank_after_sglangs_ipc_fix(fake, tmp_path):
    engine = gpu_engine(tmp_path, tensor_parallel_size=2, weight_bucket_mb=600 / 2**20)  # 600-byte buckets
    fake.clear()
    g = torch.Generator().manual_seed(0)
    weights = [
        ("model.embed_tokens.weight", torch.randn(16, 8, generator=g)),  # 512 bytes: a bucket alone
        ("model.layers.0.self_attn.q_proj.weight", torch.randn(8, 8, generator=g)),
        ("model.layers.0.input_layernorm.weight", torch.randn(8, generator=g).to(torch.bfloat16)),
    ]
    engine.load_weights(iter(weights))
    engine.commit_weights()
    assert fake.names() == [
        "begin_weight_update",
        "monkey_patch_torch_reductions",  # SGLang's fix for IPC handles across device numberings, once
        "serialize",
        "serialize",
        "update_weights_from_tensor",
        "serialize",
        "serialize",
        "update_weights_from_tensor",
        "end_weight_update",
        "flush_cache",
    ]
    updates = [kwargs for name, kwargs in fake.calls if name == "update_weights_from_tensor"]
    assert all(set(u) == {"named_tensors", "load_format", "flush_cache"} for u in updates)
    assert all(u["load_format"] == "flattened_bucket" and u["flush_cache"] is False for u in updates)
    received = []
    for update in updates:
        payloads = update["named_tensors"]
        assert len(payloads) == 2 and len(set(payloads)) == 2  # rank r deserialises payload r only
        data = fake.serialized[payloads[0]]
        received += fake.bucket_class(flattened_tensor=data["flattened_tensor"], metadata=data["metadata"]).reconstruct_tensors()
    assert [n for n, _ in received] == [n for n, _ in weights]
    assert all(got.dtype == sent.dtype and torch.equal(got, sent) for (_, got), (_, sent) in zip(received, weights))


def test_a_push_between_decode_steps_on_cuda(fake, tmp_path):
    """Partial rollouts on the GPU path: the push goes in as flattened buckets while SGLang is paused
    (retract), and the resume empties CUDA's allocator cache (the CPU engine skips that). The real
    engine runs the rest on CPU (test_sglang_partial.py)."""
    from tests.support.pushes import ScriptedPushes

    engine = gpu_engine(tmp_path)
    fake.clear()
    weights = [("model.norm.weight", torch.ones(8)), ("lm_head.weight", torch.zeros(4, 8))]
    pushes = ScriptedPushes([(1, weights)], start_version=2)
    out = engine.generate([[1, 2]], SamplingParams(max_new_tokens=2), pushes=pushes)
    assert pushes.exhausted and out.weight_versions == [((0, 2), (1, 3))]
    assert fake.names() == [
        "update_weight_version",  # the label of the version the batch starts with
        "async_generate",
        "pause_generation",
        "begin_weight_update",
        "monkey_patch_torch_reductions",
        "serialize",
        "update_weights_from_tensor",
        "serialize",
        "update_weights_from_tensor",  # ScriptedPushes sends two buckets
        "end_weight_update",
        "flush_cache",
        "update_weight_version",  # the pushed version, still paused
        "continue_generation",
    ]
    calls = dict(fake.calls)  # the last call of each name
    assert [kwargs for name, kwargs in fake.calls if name == "update_weight_version"] == [
        {"new_version": "2", "abort_all_requests": False},
        {"new_version": "3", "abort_all_requests": False},
    ]
    assert calls["pause_generation"] == {"mode": "retract"}
    assert calls["continue_generation"] == {"torch_empty_cache": True}
    generate = calls["async_generate"]
    assert set(generate) == {"input_ids", "sampling_params", "return_logprob", "rid"} and generate["input_ids"] == [[1, 2]]
    updates = [kwargs for name, kwargs in fake.calls if name == "update_weights_from_tensor"]
    assert len(updates) == 2 and all(u["load_format"] == "flattened_bucket" and u["flush_cache"] is False for u in updates)


def test_memory_saver_calls_and_tags(fake, tmp_path):
    """The trainer's order with the memory saver: sleep -> wake weights -> push -> wake KV cache (+ CUDA graphs)."""
    engine = gpu_engine(tmp_path)
    fake.clear()
    engine.sleep(level=2)
    engine.sleep(level=2)  # asleep already: nothing more
    engine.wake_up(["weights"])
    engine.wake_up(["kv_cache"])
    engine.sleep(level=1)
    engine.wake_up()
    memory = [call for call in fake.calls if call[0].endswith("memory_occupation")]
    assert memory == [
        ("release_memory_occupation", {}),  # every tag: weights, KV cache, CUDA graphs
        ("resume_memory_occupation", {"tags": ["weights"]}),
        ("resume_memory_occupation", {"tags": ["kv_cache", "cuda_graph"]}),
        ("release_memory_occupation", {}),
        ("resume_memory_occupation", {}),
    ]
    without_saver = gpu_engine(tmp_path, enable_memory_saver=False)
    fake.clear()
    without_saver.sleep()
    assert without_saver.is_sleeping  # tracked: a wrong call order still fails on GPU
    with pytest.raises(RuntimeError, match="asleep"):
        without_saver.generate([[1]], SamplingParams())
    without_saver.wake_up()
    assert fake.calls == []  # SGLang frees nothing without the saver: no calls on a GPU


def test_the_fake_has_the_tested_release_signatures(require_sglang):
    """Every call recorded above exists in the installed SGLang (0.5.23) with these keyword arguments."""
    from megatron_dapo.rollout.engines.sglang.engine import prepare_import

    prepare_import()
    import sglang
    from sglang.srt.constants import GPU_MEMORY_ALL_TYPES, GPU_MEMORY_TYPE_CUDA_GRAPH
    from sglang.srt.entrypoints.engine import Engine
    from sglang.srt.server_args import ServerArgs
    from sglang.srt.utils import MultiprocessingSerializer
    from sglang.srt.utils.patch_torch import monkey_patch_torch_reductions  # noqa: F401
    from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket

    assert sglang.__version__ == "0.5.23"

    def accepts(function, *names):
        parameters = inspect.signature(function).parameters
        return all(name in parameters for name in names)

    server_args = inspect.signature(ServerArgs).parameters
    for name in ("model_path", "tp_size", "dtype", "mem_fraction_static", "random_seed", "enable_memory_saver",
                 "base_gpu_id", "gpu_id_step", "port", "nccl_port", "context_length", "log_level", "attention_backend",
                 "enable_weights_cpu_backup", "device", "disable_cuda_graph", "skip_server_warmup", "max_total_tokens", "sleep_on_idle"):  # fmt: skip
        assert name in server_args, name
    assert accepts(Engine.generate, "input_ids", "sampling_params", "return_logprob")
    assert accepts(Engine.begin_weight_update, "selector") and accepts(Engine.end_weight_update)
    assert accepts(Engine.update_weights_from_tensor, "named_tensors", "load_format", "flush_cache")
    assert accepts(Engine.release_memory_occupation, "tags") and accepts(Engine.resume_memory_occupation, "tags")
    assert accepts(MultiprocessingSerializer.serialize, "obj", "output_str")
    assert accepts(FlattenedTensorBucket.__init__, "named_tensors", "flattened_tensor", "metadata")
    assert FlattenedTensorBucket.supports_multi_dtypes is True
    # Partial rollouts: the batch's task, and the tokenizer manager's coroutines with their requests.
    from sglang.srt.managers.io_struct import ContinueGenerationReqInput, PauseGenerationReqInput, UpdateWeightVersionReqInput
    from sglang.srt.managers.tokenizer_manager import TokenizerManager

    assert accepts(Engine.async_generate, "input_ids", "sampling_params", "return_logprob", "rid")
    for name in ("pause_generation", "continue_generation", "update_weight_version"):
        assert inspect.iscoroutinefunction(getattr(TokenizerManager, name)) and accepts(getattr(TokenizerManager, name), "obj"), name
    assert accepts(TokenizerManager.abort_request, "rid") and not inspect.iscoroutinefunction(TokenizerManager.abort_request)
    assert PauseGenerationReqInput(mode="retract").mode == "retract"
    assert ContinueGenerationReqInput(torch_empty_cache=True).torch_empty_cache is True
    label = UpdateWeightVersionReqInput(new_version="3", abort_all_requests=False)
    assert (label.new_version, label.abort_all_requests) == ("3", False)
    assert set(GPU_MEMORY_ALL_TYPES) == {"weights", "kv_cache", GPU_MEMORY_TYPE_CUDA_GRAPH} and GPU_MEMORY_TYPE_CUDA_GRAPH == "cuda_graph"


# ---- pure helpers ---------------------------------------------------------------------------------


def test_sampling_params_helper():
    params = SamplingParams(n=2, temperature=0.8, top_p=0.9, max_new_tokens=3, stop_token_ids=(9,), stop=("\n\n",))
    assert sglang_sampling_params(params, seed=100) == dict(
        max_new_tokens=3, temperature=0.8, top_p=0.9, top_k=-1, stop_token_ids=[9], stop=["\n\n"],
        no_stop_trim=True, skip_special_tokens=False, sampling_seed=100,
    )  # fmt: skip
    greedy = sglang_sampling_params(SamplingParams(temperature=0, top_k=5, max_new_tokens=4), seed=None)
    assert (greedy["temperature"], greedy["top_k"], greedy["stop_token_ids"], greedy["stop"]) == (0, 5, None, None)
    assert "sampling_seed" not in greedy


def test_outputs_are_prompt_major_and_log_probs_must_belong_to_the_tokens():
    def row(tokens, finish, shift=0):
        entries = [(-0.1 * k, token + shift, None) for k, token in enumerate(tokens)]
        return {"output_ids": tokens, "meta_info": {"finish_reason": {"type": finish}, "output_token_logprobs": entries}}

    params = SamplingParams(n=2, max_new_tokens=2)
    out = collect_sglang_outputs([row([1], "stop"), row([2, 3], "length"), row([4, 5], "length"), row([6], "stop")], 2, params)
    assert out.prompt_index == [0, 0, 1, 1] and out.truncated.tolist() == [False, True, True, False]
    assert out.log_probs[1].tolist() == pytest.approx([0.0, -0.1])
    with pytest.raises(RuntimeError, match="do not belong"):
        collect_sglang_outputs([row([1], "stop", shift=1), row([2], "stop")], 1, params)
    with pytest.raises(RuntimeError, match="3 outputs for 2 prompts"):
        collect_sglang_outputs([row([1], "stop")] * 3, 2, params)


def test_missing_sglang_gives_install_hint(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "sglang", None)
    with pytest.raises(ImportError, match="make install-sglang-cpu"):
        SGLangEngine(tmp_path / "model", device="cuda")
