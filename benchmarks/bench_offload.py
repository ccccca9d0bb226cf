"""Actor offload round trip (`actor/offload.py`) against plain copies of the same bytes.

One process (gloo, world size 1) builds a Qwen2-shaped Megatron `GPTModel` (random weights), wraps it
as the actor does (Megatron DDP, fp32 grad buffer, Megatron's optimizer; bf16 with the distributed
optimizer by default, as the recipes) and takes one optimizer step so that Adam's state exists. Then,
interleaved over `--repeats` rounds:

  (a) offload: `ActorOffload.offload("grads", "optimizer")` then `offload("params")`, as the trainer
      does after an update; onload: `ActorOffload.onload()`, as before the old log-probs; once with
      every kind copied (`keep_grads=True`, the bytes the baselines copy) and once as the trainer
      runs it, with the grads dropped (freed, back as zeros: no copy);
  (b) baselines on the same storages, per storage: `copy`: a copy into a preallocated host tensor of
      the same size (the memory-bandwidth limit of the offload's copies); `clone`: `clone()` of the
      storage's bytes (allocation + copy: what onload does, since it re-allocates the freed storages).

Reported: bytes per kind, median seconds and GB/s (1e9 bytes/s) of offload and onload, and of the two
baselines (GB/s of the dropped-grads rows: the bytes actually copied); the all-copied round trip is
checked bit for bit, the dropped-grads one for zero grads and the rest bit for bit. On a GPU the host buffers are pinned and the
copies cross PCIe; on a CPU-only machine everything is a host memcpy plus allocation / page faults.

    python benchmarks/bench_offload.py [--hidden 1024] [--layers 12] [--ffn 2816] [--vocab 32000] [--dtype bfloat16] [--repeats 5]
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def build_actor_state(args):
    from megatron_dapo.actor.optim import build_optimizer, prepare_for_training
    from megatron_dapo.config import OptimizerConfig
    from megatron_dapo.distributed import ParallelLayout, init_distributed
    from megatron_dapo.model.builder import build_gpt_models
    from megatron_dapo.model.hf_config import read_hf_config

    ctx = init_distributed(ParallelLayout(), timeout_s=600, seed=0)
    hf = read_hf_config({
        "architectures": ["Qwen2ForCausalLM"], "hidden_act": "silu", "hidden_size": args.hidden,
        "intermediate_size": args.ffn, "num_hidden_layers": args.layers, "num_attention_heads": args.hidden // 64,
        "num_key_value_heads": max(1, args.hidden // 256), "vocab_size": args.vocab, "max_position_embeddings": 4096,
        "rope_theta": 1000000.0, "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
    })  # fmt: skip
    models = build_gpt_models(hf, ctx.layout, getattr(torch, args.dtype), transformer_engine="off", init_weights=True)
    models = [m.to(ctx.device) for m in models]
    models = prepare_for_training(models, use_distributed_optimizer=not args.no_distributed_optimizer)
    optimizer = build_optimizer(models, OptimizerConfig(lr=1e-5), use_distributed_optimizer=not args.no_distributed_optimizer)
    for model in models:  # one step with a small random gradient: Adam's state exists from here on
        model.zero_grad_buffer()
        for buffer in model.buffers:
            buffer.grad_data.normal_(0, 1e-3)
    optimizer.step()
    return ctx, models, optimizer


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def baseline(storages, device, hosts=None) -> tuple[float, int]:
    """Seconds to copy every storage's bytes into `hosts` (preallocated), or to clone them (hosts None)."""
    from megatron_dapo.actor.offload import _bytes_of

    synchronize(device)
    started = time.perf_counter()
    total = 0
    clones = []
    for i, storage in enumerate(storages):
        source = _bytes_of(storage)
        if hosts is None:
            clones.append(source.clone())
        else:
            hosts[i].copy_(source, non_blocking=device.type == "cuda")
        total += storage.nbytes()
    synchronize(device)
    seconds = time.perf_counter() - started
    del clones
    return seconds, total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--ffn", type=int, default=2816)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--no-distributed-optimizer", action="store_true")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()

    from megatron_dapo.actor.offload import KINDS, ActorOffload, _bytes_of
    from megatron_dapo.distributed.setup import teardown

    ctx, models, optimizer = build_actor_state(args)
    device = ctx.device
    offload = ActorOffload(models, optimizer, KINDS, keep_grads=True)
    dropping = ActorOffload(models, optimizer, KINDS)  # the trainer's: grads dropped
    storages = [s for kind in KINDS for s in offload.storages(kind)]
    is_grad = [kind == "grads" for kind in KINDS for _ in offload.storages(kind)]
    per_kind = {kind: sum(s.nbytes() for s in offload.storages(kind)) for kind in KINDS}
    parameters = sum(p.numel() for m in models for p in m.parameters())
    before = [_bytes_of(s).clone() for s in storages]
    hosts = [torch.empty(s.nbytes(), dtype=torch.uint8, pin_memory=device.type == "cuda") for s in storages]

    rows: dict[str, list[float]] = {key: [] for key in ("offload", "onload", "offload_drop", "onload_drop", "copy", "clone")}
    moved = copied = 0
    exact = None
    for _ in range(args.repeats):
        seconds, moved = baseline(storages, device, hosts)
        rows["copy"].append(seconds)
        rows["clone"].append(baseline(storages, device)[0])
        first = offload.offload("grads", "optimizer")
        second = offload.offload("params")
        rows["offload"].append(first.seconds + second.seconds)
        back = offload.onload()
        rows["onload"].append(back.seconds)
        assert first.bytes + second.bytes == back.bytes == moved
        if exact is None:  # before any dropped-grads round
            exact = all(torch.equal(b, _bytes_of(s)) for b, s in zip(before, storages))
        first, second = dropping.offload("grads", "optimizer"), dropping.offload("params")
        rows["offload_drop"].append(first.seconds + second.seconds)
        back = dropping.onload()
        rows["onload_drop"].append(back.seconds)
        copied = back.bytes
        assert first.bytes + second.bytes == copied == moved - per_kind["grads"] == moved - back.dropped
    dropped_ok = all(
        not torch.count_nonzero(_bytes_of(s)) if grad else torch.equal(b, _bytes_of(s))
        for b, s, grad in zip(before, storages, is_grad)
    )

    print(f"machine: {platform.node()} ({os.cpu_count()} cores), device {device}, torch {torch.__version__}, "
          f"pinned host buffers: {offload.pin_memory}")  # fmt: skip
    print(f"model: {parameters / 1e6:.1f}M parameters, {args.dtype}, hidden {args.hidden}, {args.layers} layers, "
          f"ffn {args.ffn}, vocab {args.vocab}; distributed optimizer {not args.no_distributed_optimizer}")  # fmt: skip
    print("bytes moved: " + ", ".join(f"{k} {v / 1e9:.3f} GB" for k, v in per_kind.items()) + f"; total {moved / 1e9:.3f} GB "
          f"in {len(storages)} storages; round trip bit-exact: {exact}; dropped grads: zeros, the rest "
          f"bit-exact: {dropped_ok}")  # fmt: skip
    print(f"{'':<34}{'median s':>10}{'GB/s':>8}   (all rounds, s)")
    labels = {
        "offload": "offload (grads+optimizer, params)",
        "onload": "onload (everything)",
        "offload_drop": "offload, grads dropped (trainer)",
        "onload_drop": "onload, grads dropped (trainer)",
        "copy": "baseline: copy into preallocated",
        "clone": "baseline: clone (alloc + copy)",
    }
    for key, label in labels.items():
        median = statistics.median(rows[key])
        nbytes = copied if key.endswith("_drop") else moved
        print(f"{label:<34}{median:>10.3f}{nbytes / median / 1e9:>8.2f}   " + " ".join(f"{x:.3f}" for x in rows[key]))
    full = statistics.median(rows["offload"]) + statistics.median(rows["onload"])
    drop = statistics.median(rows["offload_drop"]) + statistics.median(rows["onload_drop"])
    print(f"round trip, grads dropped / all copied: {drop / full:.3f} ({drop:.3f} s / {full:.3f} s)")
    teardown()
    if not (exact and dropped_ok):
        raise SystemExit("the round trip changed the state")


if __name__ == "__main__":
    main()
