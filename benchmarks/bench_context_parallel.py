"""Context parallelism (no Transformer Engine): per-rank activation memory and update time, CP=2 vs CP=1.

Run with two processes; both layouts run in the same launch, on the same long sequences:

    torchrun --nproc_per_node 2 benchmarks/bench_context_parallel.py [--seq 4096 --batch 1 --iters 3]

* CP=1 (x DP=2): each rank runs the update step on the whole batch (the baseline: what one GPU does
  without CP);
* CP=2: the two ranks share every sequence (Megatron's 2*CP chunk layout, K/V all-gathered by the SDPA
  core attention, per-token log-probs gathered over CP).

Measured per rank: the bytes autograd saves for backward during the forward of one update (the
activation memory that decides the longest response a GPU can train on; counted exactly with
`saved_tensors_hooks`, storage-deduplicated), the wall time of one update step (median of `--iters`
after a warm-up; the two ranks share this machine's cores), and the update's loss (equal between the
layouts up to float32 reduction order). A Qwen2-style float32 model (`--hidden`, `--layers`, GQA 4/2
heads) is saved as an HF checkpoint and loaded by both layouts.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_actor import make_batch, save_model  # noqa: E402

from megatron_dapo.actor import build_actor  # noqa: E402
from megatron_dapo.config import Config  # noqa: E402
from megatron_dapo.distributed import ParallelLayout, init_distributed, teardown  # noqa: E402


@contextlib.contextmanager
def count_saved_activations(counter: dict):
    """Sum the bytes of distinct storages autograd saves for backward (parameters excluded)."""
    seen: set[int] = set()
    parameters = counter["parameter_storages"]

    def pack(tensor: torch.Tensor):
        storage = tensor.untyped_storage()
        key = storage.data_ptr()
        if key not in seen and key not in parameters:
            seen.add(key)
            counter["bytes"] += storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        yield


def build(model_dir: str, cp: int, args):
    from megatron_dapo.model.builder import build_gpt_models
    from megatron_dapo.model.hf_config import read_hf_config
    from megatron_dapo.model.load import load_hf_into_megatron

    ctx = init_distributed(ParallelLayout(cp=cp), timeout_s=600, seed=0)
    hf_cfg = read_hf_config(model_dir)
    models = build_gpt_models(hf_cfg, ctx.layout, torch.float32, transformer_engine="off", init_weights=False)
    load_hf_into_megatron(models, model_dir, hf_cfg)
    cfg = Config()
    cfg.optimizer.lr = 1e-6
    cfg.trainer.micro_batch_size = args.batch
    cfg.parallel.use_distributed_optimizer = False
    return build_actor(cfg, models, vocab_size=hf_cfg.vocab_size)


def measure(actor, batch, iters: int) -> dict:
    counter = {"bytes": 0, "parameter_storages": {p.untyped_storage().data_ptr() for m in actor.models for p in m.parameters()}}
    with count_saved_activations(counter):
        first = actor.update([batch])
    times = []
    for _ in range(iters):
        dist.barrier()
        start = time.perf_counter()
        actor.update([batch])
        times.append(time.perf_counter() - start)
    return {"activation_bytes": counter["bytes"], "seconds": statistics.median(times), "loss": first["loss"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=1, help="sequences in the update")
    parser.add_argument("--seq", type=int, default=4096, help="tokens per sequence (prompt + response)")
    parser.add_argument("--prompt", type=int, default=256)
    parser.add_argument("--iters", type=int, default=3)
    args = parser.parse_args()
    args.variable = False
    if int(os.environ.get("WORLD_SIZE", "1")) != 2:
        parser.error("run with two processes: torchrun --nproc_per_node 2 benchmarks/bench_context_parallel.py")
    torch.set_num_threads(1)  # two ranks on this machine's cores: one thread each, no oversubscription

    dist.init_process_group("gloo")
    with tempfile.TemporaryDirectory() as tmp:
        shared = [str(Path(tmp) / "model")]
        dist.broadcast_object_list(shared, src=0)  # rank 0's directory: both ranks load the same model
        model_dir = Path(shared[0])
        if dist.get_rank() == 0:
            save_model(model_dir, args)
        dist.barrier()
        results = {}
        for cp in (1, 2):
            actor = build(str(model_dir), cp, args)
            results[cp] = measure(actor, make_batch(args), args.iters)
            del actor
            teardown(keep_process_group=True)
        dist.barrier()
    if dist.get_rank() == 0:
        one, two = results[1], results[2]
        tokens = args.batch * args.seq
        print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}")
        print(f"model: hidden {args.hidden}, {args.layers} layers, vocab {args.vocab}; batch {args.batch} x {args.seq} tokens")
        for cp, r in results.items():
            print(f"CP={cp}: activations saved for backward {r['activation_bytes'] / 2**20:8.1f} MiB per rank "
                  f"({r['activation_bytes'] / tokens / 1024:.1f} KiB per token of the batch), update {r['seconds']:.3f} s, "
                  f"loss {r['loss']:.6f}")  # fmt: skip
        print(f"CP=2 / CP=1: activation memory per rank x{two['activation_bytes'] / one['activation_bytes']:.3f}, "
              f"update time x{two['seconds'] / one['seconds']:.3f}")  # fmt: skip
    teardown()


if __name__ == "__main__":
    main()
