"""MoE routing payload per rank: before (int32, every rank all of it, whole batch widened) vs after.

A synthetic Qwen3-30B-A3B-shaped rollout (48 MoE layers, top-8 of 128 experts) of `--engines`
generating ranks x `--sequences` sequences of `--tokens` tokens read each, trained by `--replicas`
data-parallel replicas. One process plays the busiest rank (a generating rank of replica 0), each
side in a fresh child process so that its peak resident memory (ru_maxrss) is its own:

  before: the engine's routing as int32; `gather_samples` appended it to the token payload, so the
          rank unpacks every engine's share (the whole generation batch); the policy batch of its
          replica's rows is a padded int32 [rows, width, 48, 8]; every micro-batch widened the whole
          batch to int64 before taking its rows (`micro_batch_routing`).
  after:  `routing_dtype(128)` = int8 from the engine on; the rank keeps only its own engine's share
          (`RoutingStore`) and receives only its replica's rows (`routing_exchange.fetch_routing`);
          the padded policy batch is int8; each micro-batch widens only its own positions.

Reported: routing bytes per token read (what one token's routing costs in host memory and on the
wire), and the peak resident memory of each side above a baseline child that imports the same
modules and builds nothing (median and spread over `--rounds` alternating rounds, after a warm-up).

    python benchmarks/bench_routing_payload.py [--engines 8] [--replicas 8] [--sequences 32] [--tokens 1024] [--rounds 5]
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

LAYERS, TOPK, EXPERTS = 48, 8, 128
MICRO_BATCH_ROWS = 2


def _routing(sequences: int, tokens: int, dtype) -> list:
    import torch

    return [torch.randint(0, EXPERTS, (tokens, LAYERS, TOPK), dtype=torch.int32).to(dtype) for _ in range(sequences)]


def _widen_micro_batches(batch, rows_per_micro_batch: int, widen_first: bool) -> None:
    """What the actor does per micro-batch (`micro_batch_routing`), old order or new order."""
    import torch

    from megatron_dapo.actor.routing import micro_batch_routing

    n, width = batch.shape[:2]
    for start in range(0, n, rows_per_micro_batch):
        rows = torch.arange(start, min(n, start + rows_per_micro_batch))
        source = (rows[:, None] * width + torch.arange(width)[None, :]).reshape(len(rows), width)
        if widen_first:  # the old code: the whole batch to int64, then the micro-batch's positions
            flat = batch.reshape(n * width, LAYERS, TOPK).to(torch.long)
            taken = flat[source.clamp(min=0)]
            del flat, taken
        else:
            micro_batch_routing(batch, source)


def side(name: str, args: argparse.Namespace) -> dict:
    """Build what the busiest rank holds on one side; returns its figures (run in a child process)."""
    import torch

    from megatron_dapo.actor.routing import routing_dtype
    from megatron_dapo.trainer.routing_exchange import RoutingStore

    torch.manual_seed(0)
    held = []
    rows = args.engines * args.sequences // args.replicas  # this replica's rows of the train batch
    if name == "before":
        # Every engine's share arrives (the whole generation batch), int32, appended to the token payload.
        for _ in range(args.engines):
            held.append(torch.cat([r.reshape(-1) for r in _routing(args.sequences, args.tokens, torch.int32)]))
        own = [r for r in _routing(rows, args.tokens, torch.int32)]
        batch = torch.full((rows, args.tokens, LAYERS, TOPK), -1, dtype=torch.int32)
        for i, r in enumerate(own):
            batch[i] = r
        _widen_micro_batches(batch, MICRO_BATCH_ROWS, widen_first=True)
        entry = 4
    elif name == "after":
        dtype = routing_dtype(EXPERTS)
        store = RoutingStore()
        store.keep(0, _routing(args.sequences, args.tokens, dtype))  # its own engine's share only
        received = _routing(rows, args.tokens, dtype)  # its replica's rows (fetch_routing)
        batch = torch.full((rows, args.tokens, LAYERS, TOPK), -1, dtype=dtype)
        for i, r in enumerate(received):
            batch[i] = r
        _widen_micro_batches(batch, MICRO_BATCH_ROWS, widen_first=False)
        held = [store, received]
        entry = torch.empty(0, dtype=dtype).element_size()
    elif name == "baseline":
        entry = 0
    else:
        raise ValueError(name)
    peak_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {"side": name, "peak_mib": peak_kib / 1024, "bytes_per_token": LAYERS * TOPK * entry}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--engines", type=int, default=8, help="generating ranks (engines) of the step")
    parser.add_argument("--replicas", type=int, default=8, help="data-parallel replicas sharing the train batch")
    parser.add_argument("--sequences", type=int, default=32, help="sequences each engine generated")
    parser.add_argument("--tokens", type=int, default=1024, help="tokens read per sequence (prompt + response - 1)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--side", default=None, help=argparse.SUPPRESS)  # a child's own side
    args = parser.parse_args()
    if args.side:
        print(json.dumps(side(args.side, args)))
        return
    forwarded = ["--engines", str(args.engines), "--replicas", str(args.replicas), "--sequences", str(args.sequences), "--tokens", str(args.tokens)]

    def run(name: str) -> dict:
        out = subprocess.run([sys.executable, __file__, "--side", name, *forwarded], capture_output=True, text=True, check=True)
        return json.loads(out.stdout.strip().splitlines()[-1])

    run("baseline")  # warm-up: page cache, imports
    figures: dict[str, list[float]] = {"baseline": [], "before": [], "after": []}
    per_token = {}
    for round_ in range(args.rounds):
        order = ("baseline", "before", "after") if round_ % 2 == 0 else ("baseline", "after", "before")
        for name in order:
            result = run(name)
            figures[name].append(result["peak_mib"])
            per_token[name] = result["bytes_per_token"]
    base = statistics.median(figures["baseline"])
    print(f"shape: {args.engines} engines x {args.sequences} sequences x {args.tokens} tokens read, {args.replicas} replicas; "
          f"{LAYERS} layers x top-{TOPK} of {EXPERTS} experts; {args.rounds} rounds (alternating), median [min, max]")  # fmt: skip
    for name in ("before", "after"):
        above = [v - base for v in figures[name]]
        print(f"  {name:6s}: {per_token[name]:5d} B/token   peak above baseline {statistics.median(above):8.1f} MiB "
              f"[{min(above):.1f}, {max(above):.1f}]")  # fmt: skip
    before = statistics.median(figures["before"]) - base
    after = statistics.median(figures["after"]) - base
    print(f"  ratio before/after: {per_token['before'] / per_token['after']:.1f}x bytes per token, {before / after:.1f}x peak host memory")


if __name__ == "__main__":
    main()
