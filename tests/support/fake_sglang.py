"""A fake `sglang` package (0.5.23-shaped) whose Engine, serializer and tensor bucket record every
call the adapter makes: the contract tests of the adapter's GPU-only calls
(tests/rollout/engines/test_sglang_contract.py checks each recorded call against the installed
SGLang's signatures). The `fake` fixture (tests/rollout/engines/conftest.py) installs it.
"""

from __future__ import annotations

import asyncio
import types

import torch


class FakeSGLang:
    """The fake package: its Engine, serializer and tensor bucket share one call log."""

    def __init__(self):
        self.calls: list[tuple[str, dict]] = []
        self.serialized: dict[str, object] = {}
        fake = self

        class TokenizerManager:
            """The coroutines a partial rollout calls (`_PushLanding`); the batch's rows wait for the
            first resume after a pause, and report the weight-version labels SGLang would."""

            def __init__(self):
                self.rid_to_state: dict = {}
                self.label = "default"
                self.resumed = asyncio.Event()

            async def pause_generation(self, obj):
                fake.calls.append(("pause_generation", vars(obj)))

            async def continue_generation(self, obj):
                fake.calls.append(("continue_generation", vars(obj)))
                self.resumed.set()

            async def update_weight_version(self, obj):
                fake.calls.append(("update_weight_version", vars(obj)))
                self.label = obj.new_version

            def abort_request(self, rid="", abort_all=False):
                fake.calls.append(("abort_request", {"rid": rid, "abort_all": abort_all}))

        class Engine:
            def __init__(self, **kwargs):
                fake.calls.append(("Engine", kwargs))
                self.tokenizer_manager = TokenizerManager()
                self._loop = None

            @property
            def loop(self):
                if self._loop is None:  # made on first use: most tests never generate with pushes
                    self._loop = asyncio.new_event_loop()
                return self._loop

            async def async_generate(self, **kwargs):
                """Two tokens per row; a push lands after the first (the rows wait for the resume)."""
                fake.calls.append(("async_generate", kwargs))
                manager = self.tokenizer_manager
                before = manager.label
                await manager.resumed.wait()
                spans = [{"version": before, "start": 0, "end": 1}, {"version": manager.label, "start": 1, "end": 2}]
                meta = {"finish_reason": {"type": "length"}, "output_token_logprobs": [(-0.5, 3, None), (-0.25, 4, None)]}
                return [{"output_ids": [3, 4], "meta_info": {**meta, "weight_versions": spans}} for _ in kwargs["input_ids"]]

            def generate(self, **kwargs):
                fake.calls.append(("generate", kwargs))
                return [
                    {"output_ids": [3], "meta_info": {"finish_reason": {"type": "stop"}, "output_token_logprobs": [(-0.5, 3, None)]}}
                    for _ in kwargs["input_ids"]
                ]

            def begin_weight_update(self, selector="all"):
                fake.calls.append(("begin_weight_update", {"selector": selector}))
                return True, "Success"

            def end_weight_update(self):
                fake.calls.append(("end_weight_update", {}))
                return True, "Success"

            def update_weights_from_tensor(self, **kwargs):
                fake.calls.append(("update_weights_from_tensor", kwargs))
                return True, "Success"

            def flush_cache(self):
                fake.calls.append(("flush_cache", {}))
                return types.SimpleNamespace(success=True)

            # SGLang: release_memory_occupation(tags=None), same for resume; keyword-only here, so the
            # log shows exactly what was passed.
            def release_memory_occupation(self, **kwargs):
                fake.calls.append(("release_memory_occupation", kwargs))

            def resume_memory_occupation(self, **kwargs):
                fake.calls.append(("resume_memory_occupation", kwargs))

            def save_sharded_model(self, **kwargs): ...

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
            supports_multi_dtypes = True

            def __init__(self, named_tensors=None, flattened_tensor=None, metadata=None):
                if named_tensors is not None:
                    parts, self.metadata, start = [], [], 0
                    for name, tensor in named_tensors:
                        raw = tensor.reshape(-1).view(torch.uint8)
                        parts.append(raw)
                        self.metadata.append(types.SimpleNamespace(name=name, shape=tensor.shape, dtype=tensor.dtype, start_idx=start, end_idx=start + raw.numel()))
                        start += raw.numel()
                    self.flattened_tensor = torch.cat(parts)
                else:
                    self.flattened_tensor, self.metadata = flattened_tensor, metadata

            def get_flattened_tensor(self):
                return self.flattened_tensor

            def get_metadata(self):
                return self.metadata

            def reconstruct_tensors(self):
                return [(m.name, self.flattened_tensor[m.start_idx : m.end_idx].view(m.dtype).reshape(m.shape)) for m in self.metadata]

        def monkey_patch_torch_reductions():
            fake.calls.append(("monkey_patch_torch_reductions", {}))

        class SamplingParams:
            def __init__(self, max_new_tokens=128, stop_token_ids=None, no_stop_trim=False, skip_special_tokens=True, sampling_seed=None): ...

        class Request:
            """SGLang's io_struct requests as far as the adapter builds them: their fields, recorded."""

            def __init__(self, **kwargs):
                self.__dict__.update(kwargs)

        names = (
            "sglang",
            "sglang.srt",
            "sglang.srt.entrypoints.engine",
            "sglang.srt.sampling.sampling_params",
            "sglang.srt.utils",
            "sglang.srt.utils.patch_torch",
            "sglang.srt.weight_sync.tensor_bucket",
            "sglang.srt.constants",
            "sglang.srt.managers.io_struct",
            "sglang.srt.managers.tokenizer_manager",
            "sglang.srt.utils.weight_versions",
        )
        self.modules = {name: types.ModuleType(name) for name in names}
        self.modules["sglang"].Engine = Engine
        self.modules["sglang"].__version__ = "0.5.23"  # the tested release (versions.SGLANG), checked at engine creation
        self.modules["sglang.srt.entrypoints.engine"].Engine = Engine
        self.modules["sglang.srt.sampling.sampling_params"].SamplingParams = SamplingParams
        self.modules["sglang.srt.constants"].GPU_MEMORY_TYPE_CUDA_GRAPH = "cuda_graph"
        self.modules["sglang.srt.utils"].MultiprocessingSerializer = MultiprocessingSerializer
        self.modules["sglang.srt.utils.patch_torch"].monkey_patch_torch_reductions = monkey_patch_torch_reductions
        self.modules["sglang.srt.weight_sync.tensor_bucket"].FlattenedTensorBucket = FlattenedTensorBucket
        self.modules["sglang.srt.managers.tokenizer_manager"].TokenizerManager = TokenizerManager
        self.modules["sglang.srt.utils.weight_versions"].add_weight_versions_to_meta_info = lambda meta_info, spans, num_output_tokens: None
        for name in ("PauseGenerationReqInput", "ContinueGenerationReqInput", "UpdateWeightVersionReqInput"):
            setattr(self.modules["sglang.srt.managers.io_struct"], name, type(name, (Request,), {}))
        self.engine_class, self.bucket_class = Engine, FlattenedTensorBucket

    def names(self) -> list[str]:
        return [name for name, _ in self.calls]

    def clear(self) -> None:
        self.calls.clear()
