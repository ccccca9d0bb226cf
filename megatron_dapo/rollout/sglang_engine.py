"""The SGLang rollout engine: SGLang's offline `sglang.Engine` behind the `RolloutEngine` interface.

    engine = SGLangEngine(hf_dir, tensor_parallel_size=2, dtype="bfloat16", mem_fraction_static=0.6)
    out = engine.generate(prompt_ids, SamplingParams(n=16, temperature=1.0, max_new_tokens=2048))
    engine.sleep(); ...train...; engine.wake_up()
    engine.load_weights(actor_hf_named_tensors)      # full weights after every wake-up
    engine.shutdown()

SGLang cannot be installed on the CPU machines this project is tested on, so this adapter is
written against SGLang's source and checked by contract tests (tests/rollout/test_sglang_contract.py)
that record every call it makes. Source read: sgl-project/sglang main,
`python/sglang/srt/entrypoints/engine.py` at commit 001067fffe33427bee0ed2f007fb7551a1d76b44,
`python/sglang/srt/sampling/sampling_params.py` at 00c17cafcb9e289d5ca97c50e44ada54e4fd5b03 and
`python/sglang/srt/weight_sync/tensor_bucket.py` at 0cbf0687be1b263c40f5e888741646398cd43809
(the 0.5.x line; `setup.py` asks for sglang>=0.5). The calls used have kept their shape since 0.4.6:

- `sglang.Engine(model_path=, tp_size=, dtype=, mem_fraction_static=, random_seed=,
  enable_memory_saver=, context_length=, log_level=, [base_gpu_id=, gpu_id_step=,] **server_args)`;
- `Engine.generate(input_ids=[[...], ...], sampling_params=[{...}, ...], return_logprob=bool)` ->
  one dict per input row, in input order: {"text", "output_ids", "meta_info": {"finish_reason":
  {"type": "stop" | "length" | "abort", ...}, "completion_tokens", "output_token_logprobs":
  [(log_prob, token_id, text), ...]}};
- `Engine.update_weights_from_tensor(named_tensors=, load_format=, flush_cache=)` -> (ok, message);
- `Engine.flush_cache()`, `release_memory_occupation()`, `resume_memory_occupation()`, `shutdown()`.

Devices. SGLang starts one scheduler process per TP rank and puts TP rank i on GPU
`base_gpu_id + i * gpu_id_step`, counted among the GPUs this process sees (0.5.23:
`entrypoints/engine.py`, `_launch_scheduler_processes`; the fields in `arg_groups/fields/device.py`).
Without them every engine starts on GPU 0: the trainer passes each leader's own GPUs
(`placement.assign_engine_devices`).

Generation. Each prompt is sent `n` times as separate rows (sampling param n = 1), so the output is
prompt-major by construction and each sample can carry its own seed (`sampling_seed` = seed + row,
sent only for seeded calls; SGLang added it in the 0.5 line for its seeded / deterministic
sampling path, so bit-reproducibility follows SGLang's own guarantees there). SGLang's radix cache
shares the repeated prompt's prefill. Stop strings are
kept in the output (`no_stop_trim`), like EOS. SGLang's returned log-probs are taken after
temperature scaling (unless the server sets SGLANG_RETURN_ORIGINAL_LOGPROB), before top-k/top-p
filtering: the actor's `log_softmax(logits / T)`. Greedy (T = 0) is SGLang's top_k = 1 at T = 1.

Weights. `load_weights` streams (name, tensor) pairs in buckets of `weight_bucket_mb` moved to the
engine's GPU. The default `weight_load_format="flattened_bucket"` packs each bucket into one flat
tensor (`FlattenedTensorBucket`), serialises it (`MultiprocessingSerializer`, CUDA IPC handles, no
copy) once per TP rank -- for this format the caller must hand SGLang one payload per rank -- and
sends it with `load_format="flattened_bucket"`: one IPC handle per bucket instead of one per tensor.
`weight_load_format="tensors"` sends the (name, tensor) list and lets SGLang serialise it per rank.
Buckets are sent with `flush_cache=False`; the radix cache is flushed once, before the next
`generate`, because one update may span many `load_weights` calls. SGLang's model loaders take
HF-named full tensors and shard/fuse them themselves, in any order and any grouping.

Memory. With `enable_memory_saver` (default on) `sleep(level)` releases all of the engine's GPU
memory (`release_memory_occupation()`: weights, KV cache, CUDA graphs) at either level, and
`wake_up(tags)` re-allocates it (`resume_memory_occupation(tags=[...])`, SGLang's tags "weights"
and "kv_cache"; the CUDA graphs come back with the KV cache, or everything with `wake_up()`). The
weights' CONTENT is not kept unless the engine is started with `enable_weights_cpu_backup=True`
(so level 1 behaves like level 2): the trainer pushes full weights after every wake-up (sleep ->
wake weights -> sync -> wake KV cache -> generate).

`named_weights` is not offered: SGLang only exposes truncated views of single parameters
(`get_weights_by_name`), which cannot prove a full sync.
"""

from __future__ import annotations

import os
from typing import Any, Iterable, Literal, Optional, Sequence

import torch

from megatron_dapo.rollout.base import ENGINE_MEMORY_TAGS, GenerationOutput, RolloutEngine, SamplingParams, check_memory_tags
from megatron_dapo.rollout.bucketing import iter_buckets
from megatron_dapo.versions import require as require_version

_INSTALL_HINT = (
    "the SGLang rollout engine needs SGLang: `pip install 'megatron-dapo[sglang]'` "
    "(or `pip install sglang`) on a GPU machine"
)

_DEFAULT_BUCKET_MB = 512
FINISH_LENGTH = "length"


def _graph_tags() -> list[str]:
    """SGLang's memory tag of CUDA-graph buffers, woken together with the KV cache (newer SGLang only)."""
    try:
        from sglang.srt.constants import GPU_MEMORY_TYPE_CUDA_GRAPH
    except ImportError:
        return []
    return [GPU_MEMORY_TYPE_CUDA_GRAPH]


def _import_sglang():
    try:
        import sglang
    except ImportError as error:
        raise ImportError(_INSTALL_HINT) from error
    return sglang


def sglang_sampling_params(params: SamplingParams, seed: Optional[int]) -> dict[str, Any]:
    """SGLang's sampling-parameter dict for ONE sample (the adapter sends each sample as its own row)."""
    sampling: dict[str, Any] = dict(
        max_new_tokens=params.max_new_tokens,
        temperature=params.temperature,
        top_p=params.top_p,
        top_k=params.top_k,  # SGLang also uses -1 for "off"
        stop_token_ids=list(params.stop_token_ids) or None,
        stop=list(params.stop) or None,
        no_stop_trim=True,  # keep the stop string in the output, as EOS is kept
        skip_special_tokens=False,
    )
    if seed is not None:
        sampling["sampling_seed"] = seed
    return sampling


def finish_reason_type(meta_info: dict) -> str:
    """"stop" / "length" / "abort" from SGLang's finish_reason ({"type": ...}, or a plain string)."""
    reason = meta_info.get("finish_reason")
    if isinstance(reason, dict):
        return str(reason.get("type"))
    return str(reason)


def collect_sglang_outputs(
    outputs: Sequence[dict], num_prompts: int, params: SamplingParams
) -> GenerationOutput:
    """Turn SGLang's per-row dicts (row = prompt * n + sample) into a prompt-major output."""
    if len(outputs) != num_prompts * params.n:
        raise RuntimeError(f"SGLang returned {len(outputs)} outputs for {num_prompts} prompts x n={params.n}")
    response_ids: list[list[int]] = []
    finish_reasons: list[str] = []
    log_probs: list[torch.Tensor] = []
    for row, output in enumerate(outputs):
        meta = output["meta_info"]
        tokens = [int(token) for token in output["output_ids"]]
        response_ids.append(tokens)
        finish_reasons.append(finish_reason_type(meta))
        if params.logprobs:
            entries = meta.get("output_token_logprobs")
            if entries is None or [int(entry[1]) for entry in entries] != tokens:
                raise RuntimeError(f"SGLang output {row}: log-probs do not belong to the sampled tokens")
            log_probs.append(torch.tensor([float(entry[0]) for entry in entries], dtype=torch.float32))
    return GenerationOutput(
        prompt_index=[row // params.n for row in range(len(outputs))],
        response_ids=response_ids,
        truncated=torch.tensor([reason == FINISH_LENGTH for reason in finish_reasons], dtype=torch.bool),
        log_probs=log_probs if params.logprobs else None,
        finish_reasons=finish_reasons,
    )


def _flattened_bucket_class():
    """SGLang's FlattenedTensorBucket (moved from model_runner to weight_sync in 0.5.x), or None."""
    for module in ("sglang.srt.weight_sync.tensor_bucket", "sglang.srt.model_executor.model_runner"):
        try:
            return getattr(__import__(module, fromlist=["FlattenedTensorBucket"]), "FlattenedTensorBucket")
        except (ImportError, AttributeError):
            continue
    return None


class SGLangEngine(RolloutEngine):
    """SGLang's offline engine as the rollout engine (see the module docstring)."""

    def __init__(
        self,
        hf_dir: str | os.PathLike,
        tensor_parallel_size: int = 1,
        dtype: str = "bfloat16",
        mem_fraction_static: float = 0.6,
        max_model_len: Optional[int] = None,
        seed: int = 0,
        enable_memory_saver: bool = True,
        weight_bucket_mb: float = _DEFAULT_BUCKET_MB,
        weight_load_format: Literal["flattened_bucket", "tensors"] = "flattened_bucket",
        base_gpu_id: Optional[int] = None,
        gpu_id_step: int = 1,
        **engine_kwargs: Any,
    ) -> None:
        """Start SGLang on an HF model directory; other keyword arguments go to `sglang.Engine`.

        `base_gpu_id` / `gpu_id_step`: the engine's GPUs, TP rank i on GPU base + i * step (this
        process's CUDA numbering; `placement.EngineDevices`); None leaves SGLang's default (GPU 0 on).
        """
        if base_gpu_id is not None:
            if base_gpu_id < 0 or gpu_id_step < 1:
                raise ValueError(f"base_gpu_id must be >= 0 and gpu_id_step >= 1, got {base_gpu_id} and {gpu_id_step}")
            engine_kwargs.update(base_gpu_id=base_gpu_id, gpu_id_step=gpu_id_step)
        sglang = _import_sglang()
        require_version("sglang")  # installed version in the tested range, every API we call present
        if weight_bucket_mb <= 0:
            raise ValueError(f"weight_bucket_mb must be > 0, got {weight_bucket_mb}")
        if weight_load_format not in ("flattened_bucket", "tensors"):
            raise ValueError(f"weight_load_format must be 'flattened_bucket' or 'tensors', got {weight_load_format!r}")
        self._bucket_class = _flattened_bucket_class() if weight_load_format == "flattened_bucket" else None
        if weight_load_format == "flattened_bucket" and self._bucket_class is None:
            weight_load_format = "tensors"  # an SGLang without flattened buckets
        self._load_format = weight_load_format
        self._tp_size = tensor_parallel_size
        self._bucket_bytes = int(weight_bucket_mb * 2**20)
        self._memory_saver = enable_memory_saver
        self._asleep_tags: set[str] = set()
        self._cache_stale = False
        # Buckets go to SGLang as CUDA IPC handles: tensors must sit on this process's GPU.
        self._device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else "cpu"
        if max_model_len is not None:
            engine_kwargs.setdefault("context_length", max_model_len)
        engine_kwargs.setdefault("log_level", "error")
        self._engine = sglang.Engine(
            model_path=str(hf_dir),
            tp_size=tensor_parallel_size,
            dtype=dtype,
            mem_fraction_static=mem_fraction_static,
            random_seed=seed,
            enable_memory_saver=enable_memory_saver,
            **engine_kwargs,
        )

    # ---- generation ---------------------------------------------------------------------------

    def generate(self, prompt_ids: Sequence[Sequence[int]], params: SamplingParams) -> GenerationOutput:
        engine = self._awake_engine()
        if not prompt_ids:
            return collect_sglang_outputs([], 0, params)
        self.commit_weights()
        rows = [[int(token) for token in prompt] for prompt in prompt_ids for _ in range(params.n)]
        sampling = [
            sglang_sampling_params(params, None if params.seed is None else params.seed + row)
            for row in range(len(rows))
        ]
        outputs = engine.generate(input_ids=rows, sampling_params=sampling, return_logprob=params.logprobs)
        if isinstance(outputs, dict):  # defensive: a single row can come back unwrapped
            outputs = [outputs]
        return collect_sglang_outputs(outputs, len(prompt_ids), params)

    # ---- weights ------------------------------------------------------------------------------

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Stream HF-named full tensors into SGLang bucket by bucket; the cache is flushed before generating."""
        engine = self._awake_engine(need=("weights",))
        multi_dtype = bool(getattr(self._bucket_class, "supports_multi_dtypes", False))
        split_on_dtype = self._load_format == "flattened_bucket" and not multi_dtype
        for bucket in iter_buckets(weights, self._bucket_bytes, device=self._device, split_on_dtype=split_on_dtype):
            if self._load_format == "flattened_bucket":
                payloads = self._serialize_flattened(bucket)
                result = engine.update_weights_from_tensor(
                    named_tensors=payloads, load_format="flattened_bucket", flush_cache=False
                )
            else:
                result = engine.update_weights_from_tensor(named_tensors=bucket, load_format=None, flush_cache=False)
            self._cache_stale = True
            _raise_on_failure(result, [name for name, _ in bucket])

    def _serialize_flattened(self, bucket: list[tuple[str, torch.Tensor]]) -> list[str]:
        """One serialised flattened bucket per TP rank (SGLang hands rank r the r-th payload)."""
        from sglang.srt.utils import MultiprocessingSerializer

        _patch_torch_reductions()
        flattened = self._bucket_class(named_tensors=bucket)
        payload = {"flattened_tensor": flattened.get_flattened_tensor(), "metadata": flattened.get_metadata()}
        return [MultiprocessingSerializer.serialize(payload, output_str=True) for _ in range(self._tp_size)]

    def commit_weights(self) -> None:
        """Drop the radix cache computed with the old weights (once per update)."""
        if self._cache_stale:
            self._awake_engine().flush_cache()
            self._cache_stale = False

    # ---- memory ---------------------------------------------------------------------------------

    def sleep(self, level: int = 1) -> None:
        """Release weights and KV cache at either level (their content is lost: push full weights after `wake_up`)."""
        if level not in (1, 2):
            raise ValueError(f"sleep level must be 1 or 2 (rollout.sleep_level), got {level}")
        if self._memory_saver and not self._asleep_tags:
            self._require_engine().release_memory_occupation()
            self._asleep_tags = set(ENGINE_MEMORY_TAGS)

    def wake_up(self, tags: Optional[Sequence[str]] = None) -> None:
        """Re-allocate the memory of `tags` ("weights", "kv_cache"; None = all) that `sleep` released."""
        waking = [tag for tag in check_memory_tags(tags) if tag in self._asleep_tags]
        if not waking:
            return
        engine = self._require_engine()
        if len(waking) == len(ENGINE_MEMORY_TAGS):
            engine.resume_memory_occupation()  # everything, CUDA graphs included
        else:
            engine.resume_memory_occupation(tags=[*waking, *_graph_tags()] if "kv_cache" in waking else waking)
        self._asleep_tags.difference_update(waking)

    @property
    def is_sleeping(self) -> bool:
        return bool(self._asleep_tags)

    def shutdown(self) -> None:
        engine, self._engine = self._engine, None
        if engine is not None:
            engine.shutdown()

    def _require_engine(self):
        if self._engine is None:
            raise RuntimeError("the SGLang engine was shut down")
        return self._engine

    def _awake_engine(self, need: Sequence[str] = ENGINE_MEMORY_TAGS):
        engine = self._require_engine()
        asleep = sorted(self._asleep_tags.intersection(need))
        if asleep:
            raise RuntimeError(f"the SGLang engine is asleep ({asleep}): call wake_up() before pushing weights or generating")
        return engine


def _raise_on_failure(result: Any, names: list[str]) -> None:
    """SGLang answers a weight update with (success, message); older versions answer None."""
    if isinstance(result, (tuple, list)) and len(result) >= 1 and result[0] is False:
        message = result[1] if len(result) > 1 else ""
        raise RuntimeError(f"SGLang failed to load weights {names[:3]}{'...' if len(names) > 3 else ''}: {message}")


_PATCHED = False


def _patch_torch_reductions() -> None:
    """SGLang's fix for CUDA IPC handles between processes that see different device indices."""
    global _PATCHED
    if _PATCHED:
        return
    try:
        from sglang.srt.patch_torch import monkey_patch_torch_reductions
    except ImportError:
        return
    monkey_patch_torch_reductions()
    _PATCHED = True
