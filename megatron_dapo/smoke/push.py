"""The smoke check's weight push: the actor -> engine sync of a model made on the spot, against a
plain device copy of the same bytes.

    python -m megatron_dapo.smoke.push --shape 1.5b      # Qwen2.5-1.5B's shape, bf16 (a GPU)
    python -m megatron_dapo.smoke.push --shape cpu       # the same family, small, float32

A randomly initialised Qwen2 of the shape is written to a temporary directory (no download), loaded
into a one-process Megatron actor and into the embedded engine on the same device; then
`sync_weights` (the trainer's path: export, buckets, the engine's loader) is timed against copying
the same bytes device to device into preallocated buffers, the floor any push is measured by. The
median of `--iters` runs of each, alternating, after one warm-up. Prints one JSON line:
{"bytes", "sync_s", "copy_s", "sync_gb_per_s", "copy_gb_per_s", "ratio"}.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

SHAPES = {
    # Qwen2.5-1.5B (config.json of the release): 1.54B parameters, tied embeddings.
    "1.5b": dict(hidden_size=1536, num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2, intermediate_size=8960,
                 vocab_size=151936, tie_word_embeddings=True),
    # The same family at a size two CPU cores push in seconds.
    "cpu": dict(hidden_size=256, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, intermediate_size=704,
                vocab_size=4096, tie_word_embeddings=True),
}  # fmt: skip
DTYPES = {"1.5b": "bfloat16", "cpu": "float32"}


def _median_pair(first, second, iters: int) -> tuple[float, float]:
    """Median seconds of `first` and `second`, alternating, after one warm-up of each."""
    import torch

    def timed(fn) -> float:
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        return time.perf_counter() - start

    timed(first), timed(second)
    a, b = [], []
    for i in range(iters):
        order = ((a, first), (b, second)) if i % 2 == 0 else ((b, second), (a, first))
        for into, fn in order:
            into.append(timed(fn))
    return statistics.median(a), statistics.median(b)


def measure(shape: str, iters: int = 5) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, Qwen2Config

    from megatron_dapo.distributed import ParallelLayout, init_distributed, teardown
    from megatron_dapo.model.builder import build_gpt_models
    from megatron_dapo.model.hf_config import read_hf_config
    from megatron_dapo.model.load import export_megatron_to_hf, load_hf_into_megatron
    from megatron_dapo.rollout.engines.embedded import EmbeddedEngine
    from megatron_dapo.rollout.sync.dispatch import sync_weights

    dtype = getattr(torch, DTYPES[shape])
    ctx = init_distributed(ParallelLayout(), timeout_s=600, seed=0, env={})
    try:
        with tempfile.TemporaryDirectory(prefix="smoke_push_") as tmp:
            config = Qwen2Config(max_position_embeddings=512, rope_theta=1_000_000.0, **SHAPES[shape])
            config.architectures = ["Qwen2ForCausalLM"]
            torch.manual_seed(0)
            AutoModelForCausalLM.from_config(config, dtype=dtype).save_pretrained(tmp)
            hf_cfg = read_hf_config(tmp)
            models = build_gpt_models(hf_cfg, ctx.layout, dtype, transformer_engine="off", init_weights=False)
            load_hf_into_megatron(models, tmp, hf_cfg)
            engine = EmbeddedEngine(tmp, dtype=dtype, device=ctx.device)
            sources = [tensor.detach().to(ctx.device) for _, tensor in export_megatron_to_hf(models, hf_cfg)]
            targets = [torch.empty_like(t) for t in sources]

            def copy() -> None:
                for target, source in zip(targets, sources):
                    target.copy_(source)

            stats = sync_weights(models, hf_cfg, engine, bucket_mb=512)
            sync_s, copy_s = _median_pair(lambda: sync_weights(models, hf_cfg, engine, bucket_mb=512), copy, iters)
            engine.shutdown()
    finally:
        teardown()
    nbytes = stats.bytes
    return {
        "shape": shape, "dtype": DTYPES[shape], "device": ctx.device.type, "bytes": nbytes, "sync_s": sync_s, "copy_s": copy_s,
        "sync_gb_per_s": nbytes / sync_s / 1e9, "copy_gb_per_s": nbytes / copy_s / 1e9, "ratio": sync_s / copy_s,
    }  # fmt: skip


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="cpu")
    parser.add_argument("--iters", type=int, default=5)
    args = parser.parse_args(argv)
    print(json.dumps(measure(args.shape, args.iters)), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
