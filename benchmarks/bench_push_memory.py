"""Weight push into an in-process (SPMD) vLLM engine: memory the path allocates and time, before vs after.

"Before" is the push as it was until issue 17 item 2, reproduced here side by side with today's
code in the same processes: every TP slice first expanded into a full-shape buffer
(`rollout/sync/tp_shards.py` before its per-rank slices), vocabulary rows all-gathered into full tensors, and every
bucket moved to host memory and made contiguous (`iter_buckets(device="cpu")`) before vLLM's loaders
saw it. "After" is today's `RolloutGroup.sync_weights` (full-shape `PlacedSlice`s, rows exchanged
point to point, buckets on the engine parameters' device).

Two ranks (gloo, CPU), a TP=2 Megatron actor and a TP=2 vLLM engine whose shards live in the same
two processes (`rollout.placement=spmd`), pushes in mode tp_shards (each rank its own slices) and
gather (full tensors). Measured in one run:

* memory: one push of each kind under `weight_path_ledger` (tests/support/storage_ledger.py: the
  export and vLLM's own loading paused): bytes the path between them allocates and the peak of those alive at once,
  per rank; and under a plain `StorageLedger` (nothing paused: export transforms and vLLM's
  layer-wise reload included) for scale. On this CPU the allocations are host memory; on a GPU
  before, each of them was a copy through pageable host memory (tp_shards: the full buffers were
  on the GPU, then copied to the host);
* time: `--rounds` pushes of each kind after one warm-up each, after and before alternating within
  every round (and which goes first, from round to round); median and min-max on rank 0 (every push
  ends with vLLM's commit);
* computed for the 32B recipe (configs/dapo_qwen2.5_32b.yaml: bf16, TP=8, spmd, tp_shards, 512 MB
  buckets): bytes through host memory per rank per sync, before and after.

    OMP_NUM_THREADS=1 python -m torch.distributed.run --nproc_per_node 2 benchmarks/bench_push_memory.py
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron_dapo.distributed import ParallelLayout, init_distributed, teardown  # noqa: E402


def save_model(path: Path, args) -> None:
    from transformers import AutoModelForCausalLM, Qwen2Config

    cfg = Qwen2Config(
        hidden_size=args.hidden, num_attention_heads=args.hidden // 64, num_key_value_heads=max(1, args.hidden // 128),
        intermediate_size=args.ffn, num_hidden_layers=args.layers, vocab_size=args.vocab, max_position_embeddings=256,
        tie_word_embeddings=False,
    )  # fmt: skip
    cfg.architectures = ["Qwen2ForCausalLM"]
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).save_pretrained(path)


# ---------------------------------------------------------------------------------------------
# Before: the push as it was (reproduced; the engine's internals are today's)
# ---------------------------------------------------------------------------------------------


def before_engine_load(engine, weights) -> None:
    """`VLLMEngine.load_weights` (spmd) before: every bucket moved to host memory, contiguous."""
    from megatron_dapo.model.bucketing import iter_buckets

    engine._weights_awake_llm()
    for bucket in iter_buckets(weights, engine._bucket_bytes, device="cpu", contiguous=True):
        engine._load("mdapo_load_weights", bucket)


class BeforeGatherEngine:
    """The engine as mode gather fed it before (full tensors through `before_engine_load`)."""

    def __init__(self, engine) -> None:
        self.engine = engine

    def load_weights(self, weights) -> None:
        before_engine_load(self.engine, weights)

    def commit_weights(self) -> None:
        self.engine.commit_weights()


class BeforeShardTarget:
    """`tp_shards.InProcessShardTarget` before: each slice in a full-shape buffer, vocabularies all-gathered."""

    def __init__(self, target) -> None:
        self.engine, self.group, self.vocab_rows = target.engine, target.group, target.vocab_rows

    def load_weight_shards(self, shards) -> None:
        before_engine_load(self.engine, [(shard.name, self._engine_tensor(shard)) for shard in shards])

    def commit_weights(self) -> None:
        self.engine.commit_weights()

    def _engine_tensor(self, shard):
        import torch.distributed as dist

        if shard.dim is None:
            return shard.tensor
        if shard.name in self.vocab_rows:
            first, end = self.vocab_rows[shard.name]
            held = shard.start <= first and end <= shard.start + shard.tensor.shape[0]
            missing = torch.tensor([0 if held else 1], dtype=torch.int32)
            dist.all_reduce(missing, op=dist.ReduceOp.MAX, group=self.group)
            if missing.item():
                return _all_gather_rows(shard, self.group)
        full = torch.empty(shard.full_shape, dtype=shard.tensor.dtype, device=shard.tensor.device)
        full.narrow(shard.dim, shard.start, shard.tensor.shape[shard.dim]).copy_(shard.tensor)
        return full


def _all_gather_rows(shard, group):
    import torch.distributed as dist

    tensor = shard.tensor
    size = dist.get_world_size(group)
    extent = torch.tensor([shard.start, tensor.shape[0]], dtype=torch.int64)
    extents = [torch.empty_like(extent) for _ in range(size)]
    dist.all_gather(extents, extent, group=group)
    longest = max(int(e[1]) for e in extents)
    padded = torch.zeros((longest, *tensor.shape[1:]), dtype=tensor.dtype)
    padded[: tensor.shape[0]].copy_(tensor)
    pieces = [torch.empty_like(padded) for _ in range(size)]
    dist.all_gather(pieces, padded, group=group)
    full = torch.empty(shard.full_shape, dtype=tensor.dtype)
    for extent, piece in zip(extents, pieces):
        start, rows = int(extent[0]), int(extent[1])
        full[start : start + rows].copy_(piece[:rows])
    return full


# ---------------------------------------------------------------------------------------------
# The 32B recipe, computed
# ---------------------------------------------------------------------------------------------


def recipe_32b() -> dict:
    """Bytes through host memory per rank per sync for configs/dapo_qwen2.5_32b.yaml, before and after."""
    from megatron_dapo.config import load_config
    from megatron_dapo.plan import hf_parameter_count, known_model

    cfg = load_config(str(Path(__file__).resolve().parents[1] / "configs" / "dapo_qwen2.5_32b.yaml"))
    model = known_model("qwen2.5-32b")
    dtype_bytes = torch.empty((), dtype=getattr(torch, cfg.model.dtype)).element_size()
    full = hf_parameter_count(model) * dtype_bytes
    tp, bucket = cfg.parallel.tp, cfg.rollout.weight_sync_bucket_mb * 2**20
    ranks_per_node = 8
    return {
        "recipe": f"Qwen2.5-32B {cfg.model.dtype}, TP={tp}, rollout.tp={cfg.rollout.tp}, placement {cfg.rollout.placement} -> spmd, "
        f"sync mode {cfg.rollout.weight_sync_mode} -> tp_shards, buckets {cfg.rollout.weight_sync_bucket_mb} MB",
        "hf_bytes": full,
        # tp_shards before: each rank's full-shape buffers (every HF tensor's full size) were copied to
        # the host, one bucket at a time; gather before: the full tensors, the same bytes.
        "before_host_bytes_per_rank": full,
        "before_host_bytes_per_node": full * ranks_per_node,
        "before_peak_host_bytes_per_rank": bucket,
        "before_peak_gpu_extra_bytes_per_rank": bucket,  # the bucket of full-shape buffers
        "after_host_bytes_per_rank": 0,
        "after_peak_host_bytes_per_rank": 0,
        # leader placement, mode gather (the leader rank): a host copy of every bucket, then the file
        "leader_gather_before_host_bytes": 2 * full,
        "leader_gather_after_host_bytes": full,
    }


# ---------------------------------------------------------------------------------------------
# Run
# ---------------------------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--ffn", type=int, default=1408)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--bucket-mb", type=float, default=64)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--model-dir", default=None)
    args = parser.parse_args()

    import torch.distributed as dist

    from megatron_dapo.distributed.objects import broadcast_object
    from megatron_dapo.distributed.placement import SpmdSlot
    from megatron_dapo.model.builder import build_gpt_models
    from megatron_dapo.model.hf_config import read_hf_config
    from megatron_dapo.model.load import export_megatron_to_hf, load_hf_into_megatron
    from megatron_dapo.rollout.engines.vllm.engine import VLLMEngine
    from megatron_dapo.rollout.group import RolloutGroup
    from megatron_dapo.rollout.sync.dispatch import sync_weights
    from megatron_dapo.rollout.sync.tp_shards import InProcessShards
    from tests.support.storage_ledger import StorageLedger, weight_path_ledger

    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    ctx = init_distributed(ParallelLayout(tp=2, pp=1), timeout_s=1800, seed=0)
    rank0 = ctx.rank == 0
    temp = tempfile.TemporaryDirectory(prefix="bench_push_memory_") if rank0 and not args.model_dir else None
    model_dir = Path(args.model_dir or broadcast_object(str(Path(temp.name) / "model") if rank0 else None, src=0))
    if rank0 and not (model_dir / "config.json").is_file():
        save_model(model_dir, args)
    dist.barrier()
    hf_cfg = read_hf_config(model_dir)
    models = build_gpt_models(hf_cfg, ctx.layout, torch.float32, transformer_engine="off", init_weights=False)
    load_hf_into_megatron(models, model_dir, hf_cfg)
    model_bytes = sum(t.numel() * t.element_size() for _, t in export_megatron_to_hf(models, hf_cfg))

    engine = VLLMEngine(str(model_dir), tensor_parallel_size=2, dtype="float32", max_model_len=64, enforce_eager=True,
                        kv_cache_memory_bytes=64 << 20, weight_bucket_mb=args.bucket_mb, placement="spmd")  # fmt: skip
    slot = SpmdSlot(dist.get_rank(), dist.get_world_size(), 2)
    group = RolloutGroup(engine, sync_mode="tp_shards", engine_kind="vllm", spmd=slot)
    group.sync_weights(models, hf_cfg, args.bucket_mb)  # makes the target
    before_target = InProcessShards(BeforeShardTarget(group.transport.target))
    before_gather = BeforeGatherEngine(engine)
    pushes = {
        "tp_shards after": lambda: group.sync_weights(models, hf_cfg, args.bucket_mb),
        "tp_shards before": lambda: sync_weights(models, hf_cfg, before_target, bucket_mb=args.bucket_mb),
        "gather after": lambda: sync_weights(models, hf_cfg, engine, bucket_mb=args.bucket_mb),
        "gather before": lambda: sync_weights(models, hf_cfg, before_gather, bucket_mb=args.bucket_mb),
    }
    report: dict = {
        "machine": f"{platform.machine()} {os.cpu_count()} cores, torch {torch.__version__}, threads/rank {torch.get_num_threads()}",
        "model": f"Qwen2 hidden {args.hidden}, {args.layers} layers, ffn {args.ffn}, vocab {args.vocab}, float32: {model_bytes / 2**20:.0f} MB",
        "bucket_mb": args.bucket_mb,
        "model_bytes": model_bytes,
        "memory": {},
        "seconds": {},
    }
    try:
        for name, push in pushes.items():
            dist.barrier()
            with weight_path_ledger() as path:
                push()
            dist.barrier()
            with StorageLedger() as everything:
                push()
            figures = {"path": path.summary(), "all": everything.summary()}
            gathered = [None] * ctx.world_size
            dist.all_gather_object(gathered, figures)
            report["memory"][name] = gathered

        times: dict = {name: [] for name in pushes}
        for name, push in pushes.items():  # warm-up
            push()
        for index in range(args.rounds):
            for kind in ("tp_shards", "gather"):
                for side in ("after", "before") if index % 2 == 0 else ("before", "after"):
                    name = f"{kind} {side}"
                    dist.barrier()
                    started = time.perf_counter()
                    pushes[name]()
                    times[name].append(time.perf_counter() - started)
        for name, values in times.items():
            report["seconds"][name] = {"median": statistics.median(values), "min": min(values), "max": max(values), "rounds": len(values)}
    finally:
        group.shutdown()
    report["recipe_32b"] = recipe_32b()
    if rank0:
        print_report(report)
        print("JSON " + json.dumps(report))
    teardown()
    if temp is not None:
        temp.cleanup()


def print_report(r: dict) -> None:
    mb = 2**20
    print(f"machine: {r['machine']}")
    print(f"model:   {r['model']}; buckets {r['bucket_mb']} MB; TP=2 actor -> TP=2 spmd vLLM engine")
    print("memory per push, per rank (path = between export and vLLM's loading; all = nothing paused):")
    for name, ranks in r["memory"].items():
        cells = "; ".join(
            f"rank {rank}: path {f['path']['allocated_bytes'] / mb:.2f} MB allocated, peak {f['path']['peak_live_bytes'] / mb:.2f} MB | "
            f"all {f['all']['allocated_bytes'] / mb:.1f} MB, peak {f['all']['peak_live_bytes'] / mb:.1f} MB"
            for rank, f in enumerate(ranks)
        )
        print(f"  {name:17s} {cells}")
    print("push time, rank 0 (median, min-max):")
    for name, s in r["seconds"].items():
        print(f"  {name:17s} {s['median'] * 1e3:7.1f} ms ({s['min'] * 1e3:.1f}-{s['max'] * 1e3:.1f}, {s['rounds']} rounds)")
    c = r["recipe_32b"]
    gb = 1e9
    print(f"32B recipe ({c['recipe']}): HF weights {c['hf_bytes'] / gb:.1f} GB")
    print(f"  through host memory per rank per sync: before {c['before_host_bytes_per_rank'] / gb:.1f} GB "
          f"({c['before_host_bytes_per_node'] / gb:.0f} GB per node), after {c['after_host_bytes_per_rank'] / gb:.1f} GB")  # fmt: skip
    print(f"  leader placement, mode gather, leader rank: before {c['leader_gather_before_host_bytes'] / gb:.1f} GB, "
          f"after {c['leader_gather_after_host_bytes'] / gb:.1f} GB (the bucket files)")  # fmt: skip


if __name__ == "__main__":
    main()
