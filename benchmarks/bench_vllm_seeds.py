"""vLLM generation with per-prompt seeds (every request its own generator) vs one engine-level seed.

With a seed per request, vLLM's sampler draws each seeded request's noise from that request's
generator, one request at a time, at every decode step (CPU: a `torch.randint(..., generator=)` and
`.item()` per request; GPU: a per-row `exponential_` and no FlashInfer sampling). Training seeds the
engine once per call instead (`rollout.seed_per_prompt=false`): one batched draw per step.

One process, an SPMD engine (vLLM's external launcher in a one-rank gloo world), a randomly
initialised Qwen3-style model (hidden 64, 4 layers, vocabulary 300; float32) so that sampling is a
visible part of a step. `--prompts` prompts x `--n` samples, `--tokens` new tokens each (no stop
token: every response is full length). Both modes alternate after one warm-up call each; median of
`--repeats` calls (tokens per second, min-max).

    python benchmarks/bench_vllm_seeds.py [--prompts 64 --n 8 --tokens 64 --repeats 5]
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # megatron_dapo and tests.support


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()

    import torch.distributed as dist

    from megatron_dapo.distributed.launch import find_free_port
    from megatron_dapo.rollout.base import SamplingParams
    from megatron_dapo.rollout.engines.vllm.engine import VLLMEngine
    from tests.support.tiny_models import save_tiny_model

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(find_free_port()), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    dist.init_process_group("gloo")
    with tempfile.TemporaryDirectory() as tmp:
        model = save_tiny_model("qwen3", Path(tmp) / "qwen3")
        engine = VLLMEngine(
            model, dtype="float32", max_model_len=args.tokens + 16, placement="spmd", enforce_eager=True,
            kv_cache_memory_bytes=256 << 20,
        )  # fmt: skip
        prompts = [[1 + (7 * p + k) % 250 for k in range(8)] for p in range(args.prompts)]
        modes = {
            "per prompt": dict(seed_per_prompt=True),
            "per engine": dict(seed_per_prompt=False),
        }
        rates: dict[str, list[float]] = {name: [] for name in modes}
        for round_ in range(args.repeats + 1):
            for name, mode in modes.items():
                params = SamplingParams(n=args.n, temperature=1.0, max_new_tokens=args.tokens, seed=round_, stop_token_ids=(), **mode)
                started = time.perf_counter()
                out = engine.generate(prompts, params)
                seconds = time.perf_counter() - started
                if round_:  # round 0 warms up
                    rates[name].append(sum(len(r) for r in out.response_ids) / seconds)
        engine.shutdown()
    dist.destroy_process_group()
    print(f"{args.prompts} prompts x {args.n} samples x {args.tokens} tokens; {platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__}")
    for name, values in rates.items():
        print(f"{name:>10}: median {statistics.median(values):,.0f} tokens/s (min {min(values):,.0f}, max {max(values):,.0f})")
    print(f"per engine / per prompt: {statistics.median(rates['per engine']) / statistics.median(rates['per prompt']):.2f}x")


if __name__ == "__main__":
    main()
