"""The tests' vLLM CPU engines: a tiny model, float32, eager, a small KV cache, and a TP size the
machine can give (vLLM's CPU backend needs one CPU per TP worker)."""

from __future__ import annotations

import os
import time
import warnings
from pathlib import Path

import pytest


def usable_tp(tp: int, what: str) -> int:
    """`tp`, or 1 with a warning where this process has fewer CPUs; under CI that is a failure (the
    TP path must be tested there)."""
    cpus = len(os.sched_getaffinity(0))
    if tp <= 1 or cpus >= tp:
        return tp
    from tests.support.ci import under_ci

    message = f"{what} runs vLLM with TP={tp} and needs {tp} CPUs; this process may use {cpus}"
    if under_ci():
        pytest.fail(f"{message} (CI: the TP={tp} path must be tested, give the job {tp} CPUs)", pytrace=False)
    warnings.warn(f"{message}: running it with TP=1 instead", stacklevel=2)
    return 1


def start_test_engine(path: Path, tp: int, bucket_mb: float, what: str):
    """A `VLLMEngine` on the HF directory `path` (the caller shuts it down)."""
    from megatron_dapo.rollout.engines.vllm.engine import VLLMEngine

    started = time.perf_counter()
    engine = VLLMEngine(
        path,
        tensor_parallel_size=tp,
        dtype="float32",
        max_model_len=128,
        enforce_eager=True,
        kv_cache_memory_bytes=32 * 2**20,  # CPU: do not size the KV cache from the machine's RAM
        weight_bucket_mb=bucket_mb,
    )
    print(f"\n[vllm] {what} engine (tp={tp}) started in {time.perf_counter() - started:.1f}s")
    return engine
