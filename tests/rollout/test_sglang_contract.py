"""Contract tests of the SGLang adapter: SGLang cannot be installed here, so a fake `sglang` package
is put in `sys.modules`. It records every call the adapter makes (method, exact arguments, order)
and answers in SGLang's formats (one dict per input row with `output_ids` and `meta_info`, whose
`finish_reason` is {"type": ...} and `output_token_logprobs` holds (log_prob, token_id, text)
triples; `update_weights_from_tensor` answers (success, message)). The tests assert the call
sequence and the argument values precisely, and how the answers are turned into our outputs.
"""

from __future__ import annotations

import sys
import types

import pytest
import torch

from megatron_dapo.rollout import sglang_engine
from megatron_dapo.rollout.base import SamplingParams
from megatron_dapo.rollout.sglang_engine import SGLangEngine, sglang_sampling_params

EOS = 2
PROMPTS = [[11, 12, 13], [21], [31, 32]]


class FakeSGLang:
    """The fake package: its Engine, serializer and tensor bucket share one call log."""

    def __init__(self, multi_dtype_buckets: bool = True, with_bucket: bool = True):
        self.calls: list[tuple[str, dict]] = []
        self.serialized: dict[str, object] = {}
        self.update_answer: object = (True, "Success")
        self.engines: list[object] = []
        fake = self

        class Engine:
            def __init__(self, **kwargs):
                fake.calls.append(("Engine", kwargs))
                fake.engines.append(self)

            def generate(self, **kwargs):
                fake.calls.append(("generate", kwargs))
                rows = zip(kwargs["input_ids"], kwargs["sampling_params"])
                return [fake.answer(row, ids, sp, kwargs["return_logprob"]) for row, (ids, sp) in enumerate(rows)]

            def update_weights_from_tensor(self, **kwargs):
                fake.calls.append(("update_weights_from_tensor", kwargs))
                return fake.update_answer

            def flush_cache(self):
                fake.calls.append(("flush_cache", {}))

            # SGLang: release_memory_occupation(tags: Optional[List[str]] = None), same for resume;
            # keyword-only here, so the log shows exactly what was passed.
            def release_memory_occupation(self, **kwargs):
                fake.calls.append(("release_memory_occupation", kwargs))

            def resume_memory_occupation(self, **kwargs):
                fake.calls.append(("resume_memory_occupation", kwargs))

            def shutdown(self):
                fake.calls.append(("shutdown", {}))

        class MultiprocessingSerializer:
            @staticmethod
            def serialize(obj, output_str=False):
                key = f"payload-{len(fake.serialized)}"
                fake.serialized[key] = obj
                fake.calls.append(("serialize", {"output_str": output_str}))
                return key if output_str else key.encode()

        class FlattenedTensorBucket:
            """Byte-concatenation of the bucket, with (name, shape, dtype, start, end) metadata."""

            supports_multi_dtypes = multi_dtype_buckets

            def __init__(self, named_tensors=None, flattened_tensor=None, metadata=None):
                if named_tensors is not None:
                    if not multi_dtype_buckets:
                        assert len({t.dtype for _, t in named_tensors}) == 1, "this SGLang needs one dtype per bucket"
                    parts, self.metadata, start = [], [], 0
                    for name, tensor in named_tensors:
                        raw = tensor.reshape(-1).view(torch.uint8)
                        parts.append(raw)
                        self.metadata.append(
                            types.SimpleNamespace(
                                name=name,
                                shape=tensor.shape,
                                dtype=tensor.dtype,
                                start_idx=start,
                                end_idx=start + raw.numel(),
                            )
                        )
                        start += raw.numel()
                    self.flattened_tensor = torch.cat(parts)
                else:
                    self.flattened_tensor, self.metadata = flattened_tensor, metadata

            def get_flattened_tensor(self):
                return self.flattened_tensor

            def get_metadata(self):
                return self.metadata

            def reconstruct_tensors(self):
                return [
                    (m.name, self.flattened_tensor[m.start_idx : m.end_idx].view(m.dtype).reshape(m.shape))
                    for m in self.metadata
                ]

        def monkey_patch_torch_reductions():
            fake.calls.append(("monkey_patch_torch_reductions", {}))

        self.modules = {
            "sglang": types.ModuleType("sglang"),
            "sglang.srt": types.ModuleType("sglang.srt"),
            "sglang.srt.utils": types.ModuleType("sglang.srt.utils"),
            "sglang.srt.patch_torch": types.ModuleType("sglang.srt.patch_torch"),
            "sglang.srt.weight_sync": types.ModuleType("sglang.srt.weight_sync"),
            "sglang.srt.weight_sync.tensor_bucket": types.ModuleType("sglang.srt.weight_sync.tensor_bucket"),
            "sglang.srt.constants": types.ModuleType("sglang.srt.constants"),
            "sglang.srt.model_executor": None,  # not present: the adapter must not need it
            "sglang.srt.model_executor.model_runner": None,
        }
        self.modules["sglang"].Engine = Engine
        self.modules["sglang"].__version__ = "0.5.4"  # in the tested range (versions.SGLANG), checked at engine creation
        self.modules["sglang.srt.constants"].GPU_MEMORY_TYPE_CUDA_GRAPH = "cuda_graph"
        self.modules["sglang.srt.utils"].MultiprocessingSerializer = MultiprocessingSerializer
        self.modules["sglang.srt.patch_torch"].monkey_patch_torch_reductions = monkey_patch_torch_reductions
        if with_bucket:
            self.modules["sglang.srt.weight_sync.tensor_bucket"].FlattenedTensorBucket = FlattenedTensorBucket
        else:
            self.modules["sglang.srt.weight_sync.tensor_bucket"] = None
        self.bucket_class = FlattenedTensorBucket

    @staticmethod
    def answer(row: int, ids: list[int], sampling: dict, with_logprobs: bool) -> dict:
        """A deterministic response: 1..4 tokens; ends with EOS unless it hits max_new_tokens."""
        limit = sampling["max_new_tokens"]
        length = min(limit, 1 + row % 4)
        tokens = [3 + (sum(ids) + 7 * row + k) % 40 for k in range(length)]
        if length < limit:
            tokens[-1] = EOS
            finish = {"type": "stop", "matched": EOS}
        else:
            finish = {"type": "length", "length": length}
        meta = {"id": f"req-{row}", "prompt_tokens": len(ids), "completion_tokens": length, "finish_reason": finish}
        if with_logprobs:
            meta["output_token_logprobs"] = [
                (-0.25 * (k + 1) - 0.01 * row, token, None) for k, token in enumerate(tokens)
            ]
        return {"text": "", "output_ids": tokens, "meta_info": meta}

    def names(self) -> list[str]:
        return [name for name, _ in self.calls]

    def clear(self) -> None:
        self.calls.clear()


def install(monkeypatch, package: FakeSGLang) -> FakeSGLang:
    """Put the fake package in sys.modules for one test (monkeypatch restores the real state)."""
    for name, module in package.modules.items():
        monkeypatch.setitem(sys.modules, name, module)
    monkeypatch.setattr(sglang_engine, "_PATCHED", False)
    return package


@pytest.fixture
def fake(monkeypatch) -> FakeSGLang:
    return install(monkeypatch, FakeSGLang())


def make_engine(tmp_path, **kwargs) -> SGLangEngine:
    return SGLangEngine(tmp_path / "model", **kwargs)


# --------------------------------------------------------------------------------------------------


def test_engine_is_built_with_exact_arguments(fake, tmp_path):
    make_engine(
        tmp_path,
        tensor_parallel_size=2,
        dtype="bfloat16",
        mem_fraction_static=0.5,
        max_model_len=4096,
        seed=7,
        attention_backend="fa3",
    )
    assert fake.calls == [
        (
            "Engine",
            dict(
                model_path=str(tmp_path / "model"),
                tp_size=2,
                dtype="bfloat16",
                mem_fraction_static=0.5,
                random_seed=7,
                enable_memory_saver=True,
                context_length=4096,
                log_level="error",
                attention_backend="fa3",
            ),
        )
    ]


def test_generate_sends_one_row_per_sample_and_reads_outputs(fake, tmp_path):
    engine = make_engine(tmp_path)
    fake.clear()
    params = SamplingParams(n=2, temperature=0.8, top_p=0.9, top_k=-1, max_new_tokens=3, stop_token_ids=(9,), seed=100)
    out = engine.generate(PROMPTS, params)

    assert fake.names() == ["generate"]
    sent = fake.calls[0][1]
    assert set(sent) == {"input_ids", "sampling_params", "return_logprob"}
    assert sent["input_ids"] == [[11, 12, 13], [11, 12, 13], [21], [21], [31, 32], [31, 32]]
    assert sent["return_logprob"] is True
    assert sent["sampling_params"] == [
        dict(
            max_new_tokens=3,
            temperature=0.8,
            top_p=0.9,
            top_k=-1,
            stop_token_ids=[9],
            stop=None,
            no_stop_trim=True,
            skip_special_tokens=False,
            sampling_seed=100 + row,
        )
        for row in range(6)
    ]

    # Rows 0..5 answer 1, 2, 3, 3(=max), 1, 2 tokens: prompt-major, truncated exactly on "length".
    assert out.prompt_index == [0, 0, 1, 1, 2, 2]
    assert [len(r) for r in out.response_ids] == [1, 2, 3, 3, 1, 2]
    assert out.finish_reasons == ["stop", "stop", "length", "length", "stop", "stop"]
    assert out.truncated.tolist() == [False, False, True, True, False, False]
    for row, (response, log_probs) in enumerate(zip(out.response_ids, out.log_probs)):
        expected = FakeSGLang.answer(row, sent["input_ids"][row], sent["sampling_params"][row], True)
        assert response == expected["output_ids"]
        assert log_probs.dtype == torch.float32
        assert log_probs.tolist() == pytest.approx([lp for lp, _, _ in expected["meta_info"]["output_token_logprobs"]])
        if out.finish_reasons[row] == "stop":
            assert response[-1] == EOS


def test_generate_unseeded_without_logprobs(fake, tmp_path):
    engine = make_engine(tmp_path)
    fake.clear()
    out = engine.generate([[5, 6]], SamplingParams(n=1, max_new_tokens=2, stop=("\n\n",), logprobs=False))
    sent = fake.calls[0][1]
    assert sent["return_logprob"] is False
    assert sent["sampling_params"] == [
        dict(
            max_new_tokens=2,
            temperature=1.0,
            top_p=1.0,
            top_k=-1,
            stop_token_ids=None,
            stop=["\n\n"],
            no_stop_trim=True,
            skip_special_tokens=False,
        )
    ]
    assert out.log_probs is None and len(out) == 1
    assert engine.generate([], SamplingParams()).response_ids == []
    assert fake.names() == ["generate"]  # an empty call does not reach SGLang


def test_log_probs_of_other_tokens_are_rejected(fake, tmp_path, monkeypatch):
    engine = make_engine(tmp_path)
    original = FakeSGLang.answer

    def shifted(row, ids, sampling, with_logprobs):
        answer = original(row, ids, sampling, with_logprobs)
        entries = answer["meta_info"]["output_token_logprobs"]
        answer["meta_info"]["output_token_logprobs"] = [(lp, token + 1, text) for lp, token, text in entries]
        return answer

    monkeypatch.setattr(fake, "answer", shifted)
    with pytest.raises(RuntimeError, match="do not belong"):
        engine.generate(PROMPTS, SamplingParams(max_new_tokens=3))


def _pushed_weights() -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [
        ("model.embed_tokens.weight", torch.randn(16, 8, generator=g)),  # 512 bytes
        ("model.layers.0.self_attn.q_proj.weight", torch.randn(8, 8, generator=g)),  # 256
        ("model.layers.0.self_attn.q_proj.bias", torch.randn(8, generator=g)),  # 32
        ("model.layers.0.input_layernorm.weight", torch.randn(8, generator=g).to(torch.bfloat16)),  # 16
        ("model.norm.weight", torch.randn(8, generator=g)),  # 32
    ]


def _unpack(fake: FakeSGLang, call: dict, tp_size: int) -> list[tuple[str, torch.Tensor]]:
    """What SGLang's TP rank r would load: deserialize payload r and rebuild the bucket's tensors."""
    payloads = call["named_tensors"]
    assert isinstance(payloads, list) and len(payloads) == tp_size
    assert len(set(payloads)) == tp_size  # one serialisation per rank (each rank consumes its own)
    rebuilt = []
    for payload in payloads:
        data = fake.serialized[payload]
        assert set(data) == {"flattened_tensor", "metadata"}
        bucket = fake.bucket_class(flattened_tensor=data["flattened_tensor"], metadata=data["metadata"])
        rebuilt.append(bucket.reconstruct_tensors())
    assert all([n for n, _ in r] == [n for n, _ in rebuilt[0]] for r in rebuilt)
    return rebuilt[0]


def test_load_weights_as_flattened_buckets_then_flush_once(fake, tmp_path):
    engine = make_engine(tmp_path, tensor_parallel_size=2, weight_bucket_mb=600 / 2**20)  # 600-byte buckets
    fake.clear()
    weights = _pushed_weights()
    engine.load_weights(iter(weights))

    # Buckets of <= 600 bytes: [embed], [q_proj.weight, q_proj.bias, layernorm, norm] (256+32+16+32).
    updates = [kwargs for name, kwargs in fake.calls if name == "update_weights_from_tensor"]
    assert fake.names() == [
        "monkey_patch_torch_reductions",
        "serialize",
        "serialize",
        "update_weights_from_tensor",
        "serialize",
        "serialize",
        "update_weights_from_tensor",
    ]
    assert all(c == {"output_str": True} for n, c in fake.calls if n == "serialize")
    assert all(u["load_format"] == "flattened_bucket" and u["flush_cache"] is False for u in updates)
    assert set(updates[0]) == {"named_tensors", "load_format", "flush_cache"}
    received = _unpack(fake, updates[0], 2) + _unpack(fake, updates[1], 2)
    assert [n for n, _ in received] == [n for n, _ in weights]
    for (_, got), (_, sent) in zip(received, weights):
        assert got.dtype == sent.dtype and torch.equal(got, sent)

    # The cache is flushed once, right before the next generation, not per bucket or per call.
    fake.clear()
    engine.load_weights(weights[:1])
    fake.clear()
    engine.generate(PROMPTS[:1], SamplingParams(max_new_tokens=2))
    engine.generate(PROMPTS[:1], SamplingParams(max_new_tokens=2))
    assert fake.names() == ["flush_cache", "generate", "generate"]


def test_single_dtype_buckets_for_older_sglang(monkeypatch, tmp_path):
    fake = install(monkeypatch, FakeSGLang(multi_dtype_buckets=False))
    engine = make_engine(tmp_path, weight_bucket_mb=1.0)  # everything would fit in one bucket
    engine.load_weights(_pushed_weights())
    updates = [kwargs for name, kwargs in fake.calls if name == "update_weights_from_tensor"]
    dtypes = [[t.dtype for _, t in _unpack(fake, u, 1)] for u in updates]
    assert dtypes == [[torch.float32] * 3, [torch.bfloat16], [torch.float32]]


def test_plain_tensor_format_and_fallback_without_buckets(monkeypatch, tmp_path):
    for package, kwargs in ((FakeSGLang(), {"weight_load_format": "tensors"}), (FakeSGLang(with_bucket=False), {})):
        fake = install(monkeypatch, package)
        engine = make_engine(tmp_path, tensor_parallel_size=2, **kwargs)
        fake.clear()
        weights = _pushed_weights()
        engine.load_weights(weights)
        assert fake.names() == ["update_weights_from_tensor"]  # SGLang serialises per rank itself
        call = fake.calls[0][1]
        assert call["load_format"] is None and call["flush_cache"] is False
        assert [n for n, _ in call["named_tensors"]] == [n for n, _ in weights]
        assert all(torch.equal(a, b) for (_, a), (_, b) in zip(call["named_tensors"], weights))


def test_failed_weight_update_raises(fake, tmp_path):
    engine = make_engine(tmp_path)
    fake.update_answer = (False, "Failed to update parameter online: no parameter named foo")
    with pytest.raises(RuntimeError, match="no parameter named foo"):
        engine.load_weights([("foo", torch.zeros(2))])
    fake.update_answer = None  # older SGLang answered nothing: not an error
    engine.load_weights([("model.norm.weight", torch.zeros(2))])


def test_sleep_wake_and_shutdown(fake, tmp_path):
    engine = make_engine(tmp_path)
    fake.clear()
    engine.sleep()
    engine.sleep()  # already asleep: nothing more
    assert engine.is_sleeping
    with pytest.raises(RuntimeError, match="asleep"):
        engine.generate(PROMPTS, SamplingParams())
    with pytest.raises(RuntimeError, match="asleep"):
        engine.load_weights(_pushed_weights())
    engine.wake_up()
    engine.wake_up()
    assert fake.names() == ["release_memory_occupation", "resume_memory_occupation"]
    engine.shutdown()
    engine.shutdown()
    assert fake.names()[-1] == "shutdown" and fake.names().count("shutdown") == 1
    with pytest.raises(RuntimeError, match="shut down"):
        engine.generate(PROMPTS, SamplingParams())

    # The trainer's order with level 2: sleep -> wake weights -> full push -> wake KV cache (and graphs).
    engine = make_engine(tmp_path)
    fake.clear()
    engine.sleep(level=2)
    engine.wake_up(["weights"])
    with pytest.raises(RuntimeError, match=r"asleep \(\['kv_cache'\]\)"):
        engine.generate(PROMPTS, SamplingParams())
    engine.load_weights(_pushed_weights())  # weights awake: allowed
    engine.wake_up(["kv_cache"])
    engine.wake_up(["kv_cache"])  # already awake: nothing more
    engine.generate(PROMPTS, SamplingParams())
    memory_calls = [call for call in fake.calls if call[0].endswith("memory_occupation")]
    assert memory_calls == [
        ("release_memory_occupation", {}),
        ("resume_memory_occupation", {"tags": ["weights"]}),
        ("resume_memory_occupation", {"tags": ["kv_cache", "cuda_graph"]}),
    ]
    with pytest.raises(ValueError, match="1 or 2"):
        engine.sleep(level=3)
    with pytest.raises(ValueError, match="unknown memory tags"):
        engine.wake_up(["cuda_graph"])

    without_saver = make_engine(tmp_path, enable_memory_saver=False)
    fake.clear()
    without_saver.sleep()
    without_saver.wake_up()
    assert fake.calls == [] and not without_saver.is_sleeping


def test_sampling_params_helper_maps_greedy_and_top_k():
    greedy = sglang_sampling_params(SamplingParams(temperature=0, top_k=5, max_new_tokens=4), seed=None)
    assert (greedy["temperature"], greedy["top_k"], greedy["max_new_tokens"]) == (0, 5, 4)
    assert "sampling_seed" not in greedy


def test_missing_sglang_gives_install_hint(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "sglang", None)
    with pytest.raises(ImportError, match="pip install sglang"):
        make_engine(tmp_path)
