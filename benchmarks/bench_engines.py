"""SGLang vs vLLM on CPU, same tiny model, one run: engine start, generation tokens/s, weight push.

Both engines go through the project's adapters (`SGLangEngine`, `VLLMEngine`, leader placement,
float32), on a randomly initialised Qwen3-style model (tests/support/tiny_models.py: hidden 64,
4 layers, head_dim 32, vocabulary 300). A round starts one engine of each kind in turn (the order alternates
between rounds), and on each: times the start (constructor until ready), `--pushes` weight pushes
of the whole model through `load_weights` (the trainer's path; the median push counts for the
round), and one `generate` of `--prompts` prompts x `--n` samples x up to `--tokens` new tokens
(tokens/s counts the tokens generated), then shuts it down. One warm-up start of
each engine first (untimed: it fills the OS file cache and vLLM's model-class cache). Reported:
median over `--rounds` rounds with min-max, and the SGLang / vLLM ratio of the medians.

    python benchmarks/bench_engines.py [--rounds 5 --prompts 16 --n 4 --tokens 64 --pushes 5]
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

ENGINES = ("vllm", "sglang")


def start_engine(kind: str, model: Path, max_model_len: int):
    if kind == "vllm":
        from megatron_dapo.rollout.engines.vllm.engine import VLLMEngine

        return VLLMEngine(model, dtype="float32", max_model_len=max_model_len, enforce_eager=True, kv_cache_memory_bytes=256 << 20)
    from megatron_dapo.rollout.engines.sglang.engine import SGLangEngine

    return SGLangEngine(model, dtype="float32", max_model_len=max_model_len, skip_tokenizer_init=True)


def one_round(kind: str, model: Path, weights: list[tuple[str, torch.Tensor]], args) -> dict[str, float]:
    from megatron_dapo.rollout.base import SamplingParams

    started = time.perf_counter()
    engine = start_engine(kind, model, args.tokens + 32)
    start_s = time.perf_counter() - started
    try:
        pushes = []
        for _ in range(args.pushes):
            t = time.perf_counter()
            engine.load_weights(iter(weights))
            engine.commit_weights()  # one push = one update, closed as the trainer's next generate closes it
            pushes.append(time.perf_counter() - t)
        prompts = [[3 + (7 * p + k) % 250 for k in range(16)] for p in range(args.prompts)]
        params = SamplingParams(n=args.n, max_new_tokens=args.tokens, temperature=1.0, seed=0)
        t = time.perf_counter()
        out = engine.generate(prompts, params)
        generate_s = time.perf_counter() - t
        tokens = sum(len(r) for r in out.response_ids)  # a response may end early at EOS: count what came
    finally:
        engine.shutdown()
    return {"start_s": start_s, "push_ms": 1e3 * statistics.median(pushes), "tokens_per_s": tokens / generate_s}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--pushes", type=int, default=5)
    args = parser.parse_args()
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    from safetensors.torch import load_file
    from tests.support.tiny_models import save_tiny_model

    with tempfile.TemporaryDirectory() as tmp:
        os.environ.setdefault("VLLM_CACHE_ROOT", str(Path(tmp) / "vllm_cache"))  # shared by every start
        model = save_tiny_model("qwen3", Path(tmp) / "qwen3")
        weights = sorted((name, tensor) for file in sorted(model.glob("*.safetensors")) for name, tensor in load_file(file).items())
        size_mb = sum(t.numel() * t.element_size() for _, t in weights) / 2**20
        for kind in ENGINES:  # warm-up
            one_round(kind, model, weights, argparse.Namespace(**{**vars(args), "pushes": 1}))
        results: dict[str, list[dict[str, float]]] = {kind: [] for kind in ENGINES}
        for index in range(args.rounds):
            for kind in ENGINES if index % 2 == 0 else ENGINES[::-1]:
                results[kind].append(one_round(kind, model, weights, args))
                print(f"round {index + 1} {kind}: {results[kind][-1]}", flush=True)
    print(f"\nmachine: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__}")
    print(f"model: tiny Qwen3 ({size_mb:.2f} MiB float32), {args.prompts} prompts x {args.n} x {args.tokens} tokens, {args.rounds} rounds")
    print(f"{'metric':<14}{'vLLM median (min-max)':>28}{'SGLang median (min-max)':>30}{'SGLang/vLLM':>13}")
    for metric in ("start_s", "push_ms", "tokens_per_s"):
        cells, medians = [], []
        for kind in ENGINES:
            values = [r[metric] for r in results[kind]]
            medians.append(statistics.median(values))
            cells.append(f"{medians[-1]:.3g} ({min(values):.3g}-{max(values):.3g})")
        print(f"{metric:<14}{cells[0]:>28}{cells[1]:>30}{medians[1] / medians[0]:>13.2f}")


if __name__ == "__main__":
    main()
