"""Weight sync (resharding) throughput and memory: actor shards -> HF tensors -> rollout engine.

A randomly initialised Qwen2-style model (default: hidden 512, 12 layers, 8 heads / 4 KV heads of
head_dim 64, FFN 1408, vocabulary 32000, untied: ~68M parameters, 272 MB in float32) is saved as an
HF checkpoint, loaded into the Megatron actor (TP x PP processes, float32) and into an embedded
engine on rank 0. Measured in one run, median of `--iters` after one warm-up:

* sync: `sync_weights` into the embedded engine (export: TP all-gather, PP broadcast, transforms;
  then the engine's `load_weights` copy), per bucket size; GB/s counts the model's bytes once;
* plain copy, alternating with the sync runs so that machine noise hits both: `dst.copy_(src)` of
  the same tensors into the same engine parameters from a pre-made copy - the machine's practical
  limit for moving these bytes (what a zero-overhead sync would cost);
* stream only: the full-tensor export with nothing consuming it, and the TP-shard stream
  (`iter_weight_shard_buckets`, no TP gather) for comparison;
* at TP > 1, the same syncs through the shared-memory hand-over (`rollout.weight_sync_mode=
  shared_memory`: every TP rank writes only its own slices into a /dev/shm bucket file that the
  engine reads; no gather), alternating with the gather syncs and the plain copy;
* with `--vllm` (when vLLM is importable): the time to push the weights into a vLLM engine on rank 0
  (`sync_weights`, which ends with vLLM's commit: layer-wise reload and CPU re-packing) versus the
  time that engine takes to generate one batch (`--gen-prompts` x `--gen-n` responses of up to
  `--gen-tokens` tokens); at TP > 1 in both sync modes, with a vLLM engine of `--vllm-tp` workers;
* with `--spmd` as well: the same push and generation with `rollout.placement=spmd` (each rank one
  vLLM shard in its own process; weights handed over in-process, `tp_shards` when --tp = --vllm-tp);
* peak extra memory of a sync, last (it changes the allocator): exactly, the bytes of streamed
  tensors alive at once (weak references); and on each rank the resident-set high-water mark during
  the sync minus the resident set before it (Linux: VmHWM reset through /proc/self/clear_refs, glibc
  told to unmap freed blocks >= 1 MB so that freed buckets leave the resident set). The RSS figure
  adds the transient buffers of one gathered parameter (TP shards + the concatenation).

    python benchmarks/bench_reshard.py                              # TP=1
    python -m torch.distributed.run --nproc_per_node 2 benchmarks/bench_reshard.py --tp 2
    python benchmarks/bench_reshard.py --vllm                       # + the vLLM push vs generate
    python -m torch.distributed.run --nproc_per_node 2 benchmarks/bench_reshard.py --tp 2 --vllm --vllm-tp 2
    python -m torch.distributed.run --nproc_per_node 2 benchmarks/bench_reshard.py --tp 2 --vllm --vllm-tp 2 --spmd
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
        hidden_size=args.hidden,
        num_attention_heads=args.hidden // 64,
        num_key_value_heads=max(1, args.hidden // 128),
        intermediate_size=args.ffn,
        num_hidden_layers=args.layers,
        vocab_size=args.vocab,
        max_position_embeddings=1024,
        tie_word_embeddings=False,
    )
    cfg.architectures = ["Qwen2ForCausalLM"]
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).save_pretrained(path)


# ---------------------------------------------------------------------------------------------
# Memory: resident-set high-water mark (Linux)
# ---------------------------------------------------------------------------------------------


def _status_kb(field: str) -> int:
    with open("/proc/self/status") as handle:
        for line in handle:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise KeyError(field)


def reset_peak_rss() -> bool:
    """Reset VmHWM to the current RSS; False where the kernel does not allow it."""
    try:
        with open("/proc/self/clear_refs", "w") as handle:
            handle.write("5")
        return True
    except OSError:
        return False


def return_freed_memory_to_the_os() -> bool:
    """Make glibc serve allocations >= 1 MB with mmap and unmap them on free (no dynamic threshold).

    By default glibc raises its mmap threshold after large frees (up to 32 MB) and keeps freed heap
    memory, so the resident set would not drop after a bucket is freed and a later measurement
    would under-count. Called only before the memory measurements, after the timings.
    """
    import ctypes

    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return False
    m_trim_threshold, m_mmap_threshold = -1, -3
    ok = bool(libc.mallopt(m_mmap_threshold, 1 << 20)) and bool(libc.mallopt(m_trim_threshold, 1 << 20))
    # Release what the heap kept from the timed runs now, not during the first measured sync (its
    # resident set would shrink first and the peak would under-count).
    libc.malloc_trim(0)
    return ok


def _trim_heap() -> None:
    import ctypes
    import gc

    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:
        pass


def measure_peak_extra(fn) -> tuple[object, float]:
    """(fn(), MB of resident memory above the starting point at its peak); nan if unmeasurable."""
    _trim_heap()
    can_reset = reset_peak_rss()
    before = _status_kb("VmRSS")
    result = fn()
    peak = _status_kb("VmHWM")
    return result, ((peak - before) / 1024 if can_reset else float("nan"))


class LiveBytesProbe:
    """Wraps an engine: forwards each bucket and tracks (weak references) how many bytes of streamed
    tensors are alive at once - exactly what the stream holds, independent of the allocator."""

    def __init__(self, engine) -> None:
        self.engine = engine
        self.refs: list = []
        self.peak = 0

    def load_weights(self, bucket) -> None:
        import weakref

        self.refs = [(ref, size) for ref, size in self.refs if ref() is not None]
        for _, tensor in bucket:
            self.refs.append((weakref.ref(tensor), tensor.numel() * tensor.element_size()))
        self.peak = max(self.peak, sum(size for ref, size in self.refs if ref() is not None))
        if self.engine is not None:
            self.engine.load_weights(bucket)


# ---------------------------------------------------------------------------------------------
# Timed pieces
# ---------------------------------------------------------------------------------------------


def timed(fn, iters: int) -> tuple[float, object]:
    """Median seconds of `iters` calls after one warm-up (every rank calls in step), and the last result."""
    import torch.distributed as dist

    result = fn()
    times = []
    for _ in range(iters):
        dist.barrier()
        start = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times), result


def make_plain_copy(engine):
    """A function copying every engine tensor from a pre-made copy (the practical limit), and the bytes."""
    pairs = [(param, param.detach().clone()) for _, param in engine.named_weights()]
    nbytes = sum(p.numel() * p.element_size() for p, _ in pairs)

    def copy_all():
        with torch.no_grad():
            for dst, src in pairs:
                dst.copy_(src)

    return copy_all, nbytes


def timed_against_copy(sync_fn, copy_fn, iters: int) -> tuple[float, float, object]:
    """Median seconds of sync_fn (every rank) and of copy_fn (rank 0, None elsewhere), alternating
    so that machine noise hits both; one warm-up each. Returns (sync s, copy s or nan, last result)."""
    import torch.distributed as dist

    result = sync_fn()
    if copy_fn is not None:
        copy_fn()
    sync_times, copy_times = [], []
    for _ in range(iters):
        dist.barrier()
        start = time.perf_counter()
        result = sync_fn()
        sync_times.append(time.perf_counter() - start)
        if copy_fn is not None:
            start = time.perf_counter()
            copy_fn()
            copy_times.append(time.perf_counter() - start)
    return statistics.median(sync_times), statistics.median(copy_times) if copy_times else float("nan"), result


def consume(stream) -> int:
    total = 0
    for bucket in stream:
        for item in bucket:
            tensor = item.tensor if hasattr(item, "tensor") else item[1]
            total += tensor.numel() * tensor.element_size()
    return total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--pp", type=int, default=1)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--ffn", type=int, default=1408)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--bucket-mb", type=float, nargs="+", default=[16, 64, 512])
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--vllm", action="store_true", help="also time a push into vLLM against one generation batch")
    parser.add_argument("--vllm-tp", type=int, default=1, help="tensor-parallel size of that vLLM engine (default 1)")
    parser.add_argument("--spmd", action="store_true", help="with --vllm: also time push and generation with rollout.placement=spmd")
    parser.add_argument("--gen-prompts", type=int, default=8)
    parser.add_argument("--gen-n", type=int, default=4)
    parser.add_argument("--gen-tokens", type=int, default=64)
    parser.add_argument("--prompt-length", type=int, default=32)
    parser.add_argument("--model-dir", default=None, help="reuse / create the random HF model here (default: a temp dir)")
    args = parser.parse_args()

    import torch.distributed as dist

    from megatron_dapo.model.builder import build_gpt_models
    from megatron_dapo.model.hf_config import read_hf_config
    from megatron_dapo.model.load import load_hf_into_megatron
    from megatron_dapo.rollout.engines.embedded import EmbeddedEngine
    from megatron_dapo.rollout.group import RolloutGroup
    from megatron_dapo.rollout.sync.dispatch import sync_weights
    from megatron_dapo.rollout.sync.gather import iter_weight_buckets
    from megatron_dapo.rollout.sync.shards import iter_weight_shard_buckets

    ctx = init_distributed(ParallelLayout(tp=args.tp, pp=args.pp), timeout_s=1800, seed=0)
    rank0 = ctx.rank == 0
    temp = None
    model_dir = Path(args.model_dir) if args.model_dir else None
    if model_dir is None:  # rank 0's temporary directory, for every rank
        from megatron_dapo.distributed.objects import broadcast_object

        temp = tempfile.TemporaryDirectory(prefix="bench_reshard_") if rank0 else None
        model_dir = Path(broadcast_object(str(Path(temp.name) / "model") if rank0 else None, src=0))
    if rank0 and not (model_dir / "config.json").is_file():
        save_model(model_dir, args)
    dist.barrier()

    hf_cfg = read_hf_config(model_dir)
    models = build_gpt_models(hf_cfg, ctx.layout, torch.float32, transformer_engine="off", init_weights=False)
    load_hf_into_megatron(models, model_dir, hf_cfg)
    engine = EmbeddedEngine(model_dir, dtype=torch.float32, device="cpu") if rank0 else None
    params = sum(p.numel() for p in engine.model.parameters()) if rank0 else 0

    report: dict = {
        "machine": f"{platform.machine()} {os.cpu_count()} cores, torch {torch.__version__}, threads/rank {torch.get_num_threads()}",
        "layout": f"tp={args.tp} pp={args.pp} (world {ctx.world_size})",
        "model": f"hidden {args.hidden}, {args.layers} layers, ffn {args.ffn}, vocab {args.vocab}: {params / 1e6:.1f}M params float32",
    }

    # The practical limit: a plain copy of the same bytes into the same engine storage (rank 0).
    copy_fn, nbytes = make_plain_copy(engine) if rank0 else (None, 0)
    report["model_mb"] = nbytes / 2**20

    # Streams alone (no engine): full tensors (TP gather) and this rank's TP shards.
    stream_s, _, stream_bytes = timed_against_copy(lambda: consume(iter_weight_buckets(models, hf_cfg, 512)), None, args.iters)
    shard_s, _, shard_bytes = timed_against_copy(lambda: consume(iter_weight_shard_buckets(models, hf_cfg, 512)), None, args.iters)
    report["stream_full"] = {"seconds": stream_s, "gb_per_s": stream_bytes / stream_s / 1e9}
    report["stream_tp_shards"] = {"seconds": shard_s, "gb_per_s": shard_bytes / shard_s / 1e9, "mb_per_rank": shard_bytes / 2**20}

    # At TP > 1 the sync all-gathers every parameter: the same bytes in ONE flat all-gather are the
    # practical limit of that communication on this machine.
    if args.tp > 1:
        from megatron.core import parallel_state as ps

        tp_group = ps.get_tensor_model_parallel_group()
        local_bytes = sum(p.numel() * p.element_size() for m in models for p in m.parameters())
        flat = torch.ones(local_bytes // 4, dtype=torch.float32)
        gathered = [torch.empty_like(flat) for _ in range(args.tp)]
        gather_s, _, _ = timed_against_copy(lambda: dist.all_gather(gathered, flat, group=tp_group), None, args.iters)
        report["plain_all_gather"] = {"seconds": gather_s, "gb_per_s": local_bytes * args.tp / gather_s / 1e9, "mb_per_rank": local_bytes / 2**20}
        del flat, gathered

    # Full syncs into the embedded engine, per bucket size, each against the plain copy; at TP > 1
    # also through the shared-memory hand-over (the trainer's default there).
    handover = RolloutGroup(engine, sync_mode="shared_memory", engine_kind="embedded")
    report["sync"] = []
    for bucket_mb in args.bucket_mb:
        sync_s, copy_s, stats = timed_against_copy(lambda: sync_weights(models, hf_cfg, engine, bucket_mb=bucket_mb), copy_fn, args.iters)
        if args.tp > 1:
            handover_s, _, _ = timed_against_copy(lambda: handover.sync_weights(models, hf_cfg, bucket_mb), copy_fn, args.iters)
        report["sync"].append({
            "bucket_mb": bucket_mb,
            "seconds": sync_s,
            "gb_per_s": stats.bytes / sync_s / 1e9,
            "copy_seconds": copy_s,
            "copy_gb_per_s": nbytes / copy_s / 1e9 if rank0 else float("nan"),
            "load_seconds_last": stats.load_seconds,
            "num_buckets": stats.num_buckets,
            "peak_bucket_mb": stats.peak_bucket_bytes / 2**20,
            **({"handover_seconds": handover_s, "handover_gb_per_s": nbytes / handover_s / 1e9} if args.tp > 1 else {}),
        })  # fmt: skip

    # vLLM: push time versus one generation batch.
    if args.vllm:
        report["vllm"] = vllm_push_vs_generate(args, models, hf_cfg, model_dir, rank0)

    # Peak extra memory of one sync per bucket size (after the timings: changes the allocator).
    report["allocator_returns_memory"] = return_freed_memory_to_the_os()
    sync_weights(models, hf_cfg, engine, bucket_mb=args.bucket_mb[0])  # settle the new allocator policy
    for entry in report["sync"]:
        dist.barrier()
        _, extra_mb = measure_peak_extra(lambda: sync_weights(models, hf_cfg, engine, bucket_mb=entry["bucket_mb"]))
        extras = [None] * ctx.world_size
        dist.all_gather_object(extras, extra_mb)
        entry["peak_extra_rss_mb_per_rank"] = extras
        probe = LiveBytesProbe(engine) if rank0 else None
        sync_weights(models, hf_cfg, probe, bucket_mb=entry["bucket_mb"])
        entry["peak_live_stream_mb"] = probe.peak / 2**20 if rank0 else None
        if args.tp > 1:
            dist.barrier()
            _, extra_mb = measure_peak_extra(lambda: handover.sync_weights(models, hf_cfg, entry["bucket_mb"]))
            extras = [None] * ctx.world_size
            dist.all_gather_object(extras, extra_mb)
            entry["handover_peak_extra_rss_mb_per_rank"] = extras
    handover.close_weight_sync()

    if rank0:
        print_report(report)
        print("JSON " + json.dumps(report))
    if engine is not None:
        engine.shutdown()
    teardown()
    if temp is not None and rank0:
        temp.cleanup()


def vllm_push_vs_generate(args, models, hf_cfg, model_dir: Path, rank0: bool) -> dict:
    import torch.distributed as dist

    from megatron_dapo.rollout.base import SamplingParams
    from megatron_dapo.rollout.sync.dispatch import sync_weights

    available = torch.tensor([0])
    if rank0:
        try:
            import vllm  # noqa: F401

            available[0] = 1
        except Exception:
            pass
    dist.broadcast(available, src=0)
    if not int(available):
        return {"skipped": "vLLM is not importable"}
    engine = None
    if rank0:
        from megatron_dapo.rollout.engines.vllm.engine import VLLMEngine

        os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
        started = time.perf_counter()
        engine = VLLMEngine(str(model_dir), tensor_parallel_size=args.vllm_tp, dtype="float32", max_model_len=args.prompt_length + args.gen_tokens + 8,
                            kv_cache_memory_bytes=512 << 20, weight_bucket_mb=512)  # fmt: skip
        start_s = time.perf_counter() - started
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(0, args.vocab, (args.gen_prompts, args.prompt_length), generator=g).tolist()
    sampling = SamplingParams(n=args.gen_n, temperature=1.0, max_new_tokens=args.gen_tokens, seed=0)

    # sync_weights ends with the engine's commit_weights: vLLM's layer-wise reload is finished and counted.
    push_s, stats = timed(lambda: sync_weights(models, hf_cfg, engine, bucket_mb=512), args.iters)
    result: dict = {"push_seconds": push_s, "push_gb_per_s": stats.bytes / push_s / 1e9, "engine_tp": args.vllm_tp}
    if args.tp > 1:
        from megatron_dapo.rollout.group import RolloutGroup

        handover = RolloutGroup(engine, sync_mode="shared_memory", engine_kind="vllm")
        result["handover_push_seconds"], _ = timed(lambda: handover.sync_weights(models, hf_cfg, 512), args.iters)
        handover.close_weight_sync()
    if rank0:
        engine.generate(prompts, sampling)  # warm-up
        times, tokens = [], 0
        for _ in range(args.iters):
            started = time.perf_counter()
            out = engine.generate(prompts, sampling)
            times.append(time.perf_counter() - started)
            tokens = int(out.response_lengths.sum())
        result.update(
            engine_start_seconds=start_s,
            generate_seconds=statistics.median(times),
            generated_tokens=tokens,
            batch=f"{args.gen_prompts} prompts x {args.gen_n} samples, up to {args.gen_tokens} new tokens",
        )
        result["push_over_generate"] = push_s / result["generate_seconds"]
        engine.shutdown()
    dist.barrier()
    if args.spmd:
        result["spmd"] = spmd_push_and_generate(args, models, hf_cfg, model_dir, prompts, sampling)
    return result


def spmd_push_and_generate(args, models, hf_cfg, model_dir: Path, prompts, sampling) -> dict:
    """The same push and generation with `rollout.placement=spmd`: every rank holds one vLLM shard
    (external_launcher, `--vllm-tp` = world size here: one rollout-TP group generating the same batch
    as the leader engine above), weights handed over in-process (tp_shards when --tp = --vllm-tp)."""
    import torch.distributed as dist

    from megatron_dapo.rollout.group import RolloutGroup
    from megatron_dapo.distributed.placement import SpmdSlot
    from megatron_dapo.rollout.engines.vllm.engine import VLLMEngine

    started = time.perf_counter()
    engine = VLLMEngine(str(model_dir), tensor_parallel_size=args.vllm_tp, dtype="float32", max_model_len=args.prompt_length + args.gen_tokens + 8,
                        kv_cache_memory_bytes=512 << 20, weight_bucket_mb=512, placement="spmd")  # fmt: skip
    start_s = time.perf_counter() - started
    group = RolloutGroup(engine, sync_mode="auto", engine_kind="vllm", spmd=SpmdSlot(dist.get_rank(), dist.get_world_size(), args.vllm_tp))
    try:
        push_s, stats = timed(lambda: group.sync_weights(models, hf_cfg, 512), args.iters)
        engine.generate(prompts, sampling)  # warm-up
        times, tokens = [], 0
        for _ in range(args.iters):
            dist.barrier()
            started = time.perf_counter()
            out = engine.generate(prompts, sampling)
            times.append(time.perf_counter() - started)
            tokens = int(out.response_lengths.sum())
        return {
            "sync_mode": group.sync_mode,
            "engine_start_seconds": start_s,
            "push_seconds": push_s,
            "push_mb_per_rank": stats.bytes / 2**20,
            "generate_seconds": statistics.median(times),
            "generated_tokens": tokens,
        }
    finally:
        group.shutdown()


def print_report(r: dict) -> None:
    print(f"machine: {r['machine']}")
    print(f"actor:   {r['layout']};  model: {r['model']} ({r['model_mb']:.0f} MB)")
    sf, ss = r["stream_full"], r["stream_tp_shards"]
    print(f"stream only, full HF tensors (TP gather):  {sf['seconds'] * 1e3:7.1f} ms = {sf['gb_per_s']:.2f} GB/s")
    print(f"stream only, this rank's TP shards:        {ss['seconds'] * 1e3:7.1f} ms = {ss['gb_per_s']:.2f} GB/s ({ss['mb_per_rank']:.0f} MB/rank)")
    if "plain_all_gather" in r:
        g = r["plain_all_gather"]
        print(f"plain all-gather of the same bytes (one flat tensor, {g['mb_per_rank']:.0f} MB/rank): "
              f"{g['seconds'] * 1e3:.1f} ms = {g['gb_per_s']:.2f} GB/s gathered")  # fmt: skip
    print("sync into the embedded engine (rank 0) vs a plain copy of the same bytes into the same tensors:")
    print("  bucket MB | sync ms | GB/s | plain copy ms | GB/s | sync/copy | buckets | peak bucket MB | "
          "stream-held peak MB | peak extra RSS MB per rank")  # fmt: skip
    for s in r["sync"]:
        if "handover_seconds" in s:
            handover_extras = ", ".join(f"{e:.0f}" for e in s["handover_peak_extra_rss_mb_per_rank"])
            print(f"  (bucket {s['bucket_mb']:g} MB) shared-memory hand-over, no gather: {s['handover_seconds'] * 1e3:.1f} ms = "
                  f"{s['handover_gb_per_s']:.2f} GB/s, {s['seconds'] / s['handover_seconds']:.2f}x the gather sync; "
                  f"peak extra RSS MB per rank {handover_extras}")  # fmt: skip
    for s in r["sync"]:
        extras = ", ".join("n/a" if e != e else f"{e:.0f}" for e in s["peak_extra_rss_mb_per_rank"])
        print(f"  {s['bucket_mb']:>9g} | {s['seconds'] * 1e3:>7.1f} | {s['gb_per_s']:.2f} | {s['copy_seconds'] * 1e3:>13.1f} | "
              f"{s['copy_gb_per_s']:.2f} | {s['gb_per_s'] / s['copy_gb_per_s']:>9.0%} | {s['num_buckets']:>7} | "
              f"{s['peak_bucket_mb']:>14.1f} | {s['peak_live_stream_mb']:>19.1f} | {extras}")  # fmt: skip
    if "vllm" in r:
        v = r["vllm"]
        if "skipped" in v:
            print(f"vLLM: skipped ({v['skipped']})")
        else:
            print(f"vLLM (float32, CPU, engine start {v['engine_start_seconds']:.0f} s): push {v['push_seconds']:.2f} s "
                  f"({v['push_gb_per_s']:.2f} GB/s) vs generate one batch {v['generate_seconds']:.2f} s "
                  f"[{v['batch']}, {v['generated_tokens']} tokens]: push = {v['push_over_generate']:.0%} of a generation"
                  f" (engine TP {v['engine_tp']})")  # fmt: skip
            if "handover_push_seconds" in v:
                print(f"vLLM push through the shared-memory hand-over (no gather): {v['handover_push_seconds']:.2f} s = "
                      f"{v['push_seconds'] / v['handover_push_seconds']:.2f}x faster than with the gather")  # fmt: skip
            if "spmd" in v:
                sp = v["spmd"]
                reference = v.get("handover_push_seconds", v["push_seconds"])
                leader_rate, spmd_rate = v["generated_tokens"] / v["generate_seconds"], sp["generated_tokens"] / sp["generate_seconds"]
                print(f"vLLM placement spmd (engine start {sp['engine_start_seconds']:.1f} s): push ({sp['sync_mode']}, "
                      f"{sp['push_mb_per_rank']:.0f} MB/rank) {sp['push_seconds']:.3f} s = {reference / sp['push_seconds']:.1f}x faster than the "
                      f"leader placement's best push ({reference:.2f} s); generate {sp['generate_seconds']:.2f} s = {spmd_rate:.0f} tokens/s "
                      f"vs leader {leader_rate:.0f} tokens/s ({spmd_rate / leader_rate:.2f}x)")  # fmt: skip


if __name__ == "__main__":
    main()
