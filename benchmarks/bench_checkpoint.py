"""Checkpoint save and load: the old funnel (fully_reshardable, one writer, DP rank 0 writes everything)
against the new periodic save (dp_reshardable, parallel writers, fully parallel save, checksums).

Run under torchrun (DP = number of processes, gloo on a CPU machine):

    torchrun --nproc_per_node 2 benchmarks/bench_checkpoint.py [--hidden 512] [--layers 8] [--ffn 1408]
        [--vocab 32000] [--dtype bfloat16] [--rounds 5] [--dir /tmp/bench_ckpt]

Every process builds the same Qwen2-shaped Megatron `GPTModel` (random weights), wraps it as the actor
does (Megatron DDP, distributed optimizer, Adam), and takes one optimizer step so Adam's state exists.
Then, after one warm-up round, `--rounds` rounds each save and load the same state in every variant
(the order rotates from round to round):

  before     fully_reshardable, 1 writer thread, no fully parallel save, no checksums (the code before
             this change); load without checksum verification
  after      dp_reshardable, 2 writer threads, fully parallel save over DP, checksums; load verifies them
  after-nock the same without checksums, load without verification (after - after-nock = checksum cost)
  final      fully_reshardable with 2 writers, fully parallel save and checksums (the save after the last
             step); load verifies

Reported per variant: median seconds of save and load (min-max), the bytes of tensor data files each
rank wrote (`__<rank>_*.distcp`), and the number of files. The load reads what the save just wrote
(page cache), the same for every variant. Save = from a barrier before `save_checkpoint` to its
return on rank 0 (it ends with a barrier); load likewise.
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

VARIANTS = {
    "before": dict(optimizer_format="fully_reshardable", write_threads=1, parallel_save=False, checksums=False, verify=False),
    "after": dict(optimizer_format="dp_reshardable", write_threads=2, parallel_save=True, checksums=True, verify=True),
    "after-nock": dict(optimizer_format="dp_reshardable", write_threads=2, parallel_save=True, checksums=False, verify=False),
    "final": dict(optimizer_format="fully_reshardable", write_threads=2, parallel_save=True, checksums=True, verify=True),
}


def build_state(args):
    from megatron_dapo.actor.optim import build_optimizer, prepare_for_training
    from megatron_dapo.config import OptimizerConfig
    from megatron_dapo.distributed import ParallelLayout, init_distributed
    from megatron_dapo.model.builder import build_gpt_models
    from megatron_dapo.model.hf_config import read_hf_config

    ctx = init_distributed(ParallelLayout(), timeout_s=1200, seed=0)
    hf = read_hf_config({
        "architectures": ["Qwen2ForCausalLM"], "hidden_act": "silu", "hidden_size": args.hidden,
        "intermediate_size": args.ffn, "num_hidden_layers": args.layers, "num_attention_heads": args.hidden // 64,
        "num_key_value_heads": max(1, args.hidden // 256), "vocab_size": args.vocab, "max_position_embeddings": 4096,
        "rope_theta": 1000000.0, "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
    })  # fmt: skip
    models = build_gpt_models(hf, ctx.layout, getattr(torch, args.dtype), transformer_engine="off", init_weights=True)
    models = prepare_for_training(models, use_distributed_optimizer=True)
    optimizer = build_optimizer(models, OptimizerConfig(lr=1e-5), use_distributed_optimizer=True)
    for model in models:  # one step with a small random gradient: Adam's state exists from here on
        model.zero_grad_buffer()
        for buffer in model.buffers:
            buffer.grad_data.normal_(0, 1e-3)
    optimizer.step()
    params = sum(p.numel() for m in models for p in m.parameters())
    return ctx, models, optimizer, params


def one_round(name: str, spec: dict, models, optimizer, root: Path) -> tuple[float, float, dict[int, int], int]:
    import torch.distributed as dist

    from megatron_dapo.checkpoint.core import load_checkpoint, save_checkpoint

    save_kwargs = {k: v for k, v in spec.items() if k != "verify"}
    dist.barrier()
    started = time.perf_counter()
    path = save_checkpoint(root / name, 1, models, optimizer, **save_kwargs)
    save_s = time.perf_counter() - started
    sizes: dict[int, int] = {}
    for f in (path / "dist").glob("__*_*.distcp"):
        rank = int(f.name.split("_")[2])
        sizes[rank] = sizes.get(rank, 0) + f.stat().st_size
    files = sum(1 for f in path.rglob("*") if f.is_file())
    dist.barrier()
    started = time.perf_counter()
    load_checkpoint(path, models, optimizer, load_rng=False, verify=spec["verify"])
    dist.barrier()
    load_s = time.perf_counter() - started
    if dist.get_rank() == 0:
        shutil.rmtree(root / name)
    dist.barrier()
    return save_s, load_s, sizes, files


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--ffn", type=int, default=1408)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--dir", default="/tmp/bench_ckpt")
    parser.add_argument("--variants", default=",".join(VARIANTS))
    args = parser.parse_args()

    import torch.distributed as dist

    from megatron_dapo.checkpoint.integrity import checksum_algorithm
    from megatron_dapo.distributed.setup import teardown

    ctx, models, optimizer, params = build_state(args)
    root = Path(args.dir)
    names = args.variants.split(",")
    rank0 = dist.get_rank() == 0
    results: dict[str, dict[str, list]] = {n: {"save": [], "load": []} for n in names}
    sizes, files = {}, {}
    for round_index in range(args.rounds + 1):  # round 0 warms up
        order = names[round_index % len(names):] + names[: round_index % len(names)]
        for name in order:
            save_s, load_s, sizes[name], files[name] = one_round(name, VARIANTS[name], models, optimizer, root)
            if round_index:
                results[name]["save"].append(save_s)
                results[name]["load"].append(load_s)
    if rank0:
        world = dist.get_world_size()
        print(f"\n{platform.node()} ({os.cpu_count()} CPUs), torch {torch.__version__}, world {world} (DP={world}, gloo), "
              f"{params / 1e6:.1f}M params ({args.dtype}, distributed Adam), checksum {checksum_algorithm()}, "
              f"{args.rounds} rounds after a warm-up, {args.dir}")  # fmt: skip
        print(f"{'variant':<11} {'save s median (min-max)':<26} {'load s median (min-max)':<26} "
              f"{'MB written per rank (.distcp)':<32} files")  # fmt: skip
        for name in names:
            s, l = results[name]["save"], results[name]["load"]
            per_rank = " / ".join(f"{sizes[name].get(r, 0) / 1e6:.0f}" for r in range(world))
            print(f"{name:<11} {statistics.median(s):6.2f} ({min(s):.2f}-{max(s):.2f}){'':<9} "
                  f"{statistics.median(l):6.2f} ({min(l):.2f}-{max(l):.2f}){'':<9} {per_rank:<32} {files[name]}")  # fmt: skip
    teardown()


if __name__ == "__main__":
    main()
