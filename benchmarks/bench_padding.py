"""Padding overhead of micro-batching schemes on a DAPO-like batch (no model: pure token accounting).

Lengths (fixed seed): 512 prompts x 16 responses. Each prompt has 50-300 tokens and a difficulty
factor (log-normal) shared by its 16 responses; a response is truncated at the 20480-token maximum
with probability 10%, else drawn log-normal around 2500 x difficulty tokens (clipped below the
maximum) - a mix of short answers and long, near-maximum chains of thought. The batch is split
over 8 data-parallel ranks in contiguous shards, as the trainer does, and micro-batched per rank:

  (a) fixed micro-batch size 4, right padding, arrival order;
  (b) token budget, right padding   (`split_into_micro_batches(..., packed=False)`);
  (c) token budget, packed THD      (`split_into_micro_batches(..., packed=True)`).

For (b) and (c) the ranks then agree on MAX of their micro-batch counts and split again with that
minimum (what keeps pipeline schedules in step); overhead is reported after that. Two budgets:
2048 + 20480 = 22528 (DAPO's actor_ppo_max_token_len, one full sequence) and twice that. Two
granularities: the whole batch per rank (forward-only log-probs of old/reference policy) and one
DAPO mini-batch (32 prompts x 16 = 512 sequences, 64 per rank; the update step). A last row
shows (c) again after dealing sequences to ranks by length (sorted, snake order), to separate the
spread of micro-batch counts caused by the DP split from that of the micro-batching.

    python benchmarks/bench_padding.py [--seed 0] [--dp 8]
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron_dapo.data.micro_batches import micro_batch_cost, pad_overhead, split_into_micro_batches  # noqa: E402

MAX_PROMPT, MAX_RESPONSE = 2048, 20480


def dapo_like_lengths(prompts: int, samples: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    lengths = []
    for _ in range(prompts):
        prompt = rng.randint(50, 300)
        difficulty = rng.lognormvariate(0.0, 0.5)
        for _ in range(samples):
            if rng.random() < 0.10:
                response = MAX_RESPONSE
            else:
                response = min(MAX_RESPONSE - 1, max(16, int(2500 * difficulty * rng.lognormvariate(0.0, 0.8))))
            lengths.append(prompt + response)
    return lengths


def fixed_size(lengths: list[int], size: int) -> list[list[int]]:
    return [list(range(i, min(i + size, len(lengths)))) for i in range(0, len(lengths), size)]


def report(name: str, per_rank: list[tuple[list[int], list[list[int]]]], packed: bool, budget: int | None) -> None:
    real = sum(sum(lengths) for lengths, _ in per_rank)
    computed = sum(micro_batch_cost([lengths[i] for i in mb], packed) for lengths, bins in per_rank for mb in bins)
    overhead = 0.0 if computed == 0 else 1 - real / computed
    counts = [len(bins) for _, bins in per_rank]
    costs = [micro_batch_cost([lengths[i] for i in mb], packed) for lengths, bins in per_rank for mb in bins if mb]
    rank_overheads = [pad_overhead(bins, lengths, packed) for lengths, bins in per_rank]
    over = "" if budget is None else f" over-budget={sum(c > budget for c in costs)}"
    print(
        f"  {name:<34} padding {100 * overhead:5.1f}% (ranks {100 * min(rank_overheads):.1f}-"
        f"{100 * max(rank_overheads):.1f}%)  micro-batches/rank {min(counts)}-{max(counts)}  "
        f"tokens/micro-batch {min(costs)}-{max(costs)} (mean {statistics.mean(costs):.0f}){over}"
    )


def snake_shards(lengths: list[int], dp: int) -> list[list[int]]:
    """Equal-count DP shards with similar token totals: longest first, dealt 0..dp-1, dp-1..0, ..."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    shards: list[list[int]] = [[] for _ in range(dp)]
    for position, index in enumerate(order):
        lap, offset = divmod(position, dp)
        shards[offset if lap % 2 == 0 else dp - 1 - offset].append(lengths[index])
    return shards


def run(lengths: list[int], dp: int, budget: int) -> None:
    shard = len(lengths) // dp
    ranks = [lengths[r * shard : (r + 1) * shard] for r in range(dp)]
    totals = [sum(r) for r in ranks]
    print(f"    contiguous DP shards: tokens/rank {min(totals)}-{max(totals)}")
    report("(a) fixed size 4, padded", [(l, fixed_size(l, 4)) for l in ranks], False, budget)
    for label, packed in (("(b) token budget, padded", False), ("(c) token budget, packed", True)):
        start = time.perf_counter()
        local = [split_into_micro_batches(l, budget, packed=packed) for l in ranks]
        elapsed = (time.perf_counter() - start) / dp
        report(label + " (local)", list(zip(ranks, local)), packed, budget)
        target = max(len(b) for b in local)
        synced = [split_into_micro_batches(l, budget, min_num_micro_batches=target, packed=packed) for l in ranks]
        assert all(len(b) == target for b in synced)
        report(label + f" (MAX-synced: {target})", list(zip(ranks, synced)), packed, budget)
        print(f"      split time {1000 * elapsed:.1f} ms per rank")
    # Not part of the trainer (yet): how much of the count spread comes from the DP split itself.
    balanced = snake_shards(lengths, dp)
    totals = [sum(r) for r in balanced]
    print(f"    token-balanced DP shards (sorted, snake order): tokens/rank {min(totals)}-{max(totals)}")
    local = [split_into_micro_batches(l, budget, packed=True) for l in balanced]
    target = max(len(b) for b in local)
    synced = [split_into_micro_batches(l, budget, min_num_micro_batches=target, packed=True) for l in balanced]
    report("(c) packed, local", list(zip(balanced, local)), True, budget)
    report(f"(c) packed, MAX-synced: {target}", list(zip(balanced, synced)), True, budget)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--prompts", type=int, default=512)
    parser.add_argument("--samples", type=int, default=16)
    parser.add_argument("--dp", type=int, default=8)
    parser.add_argument("--mini-batch-prompts", type=int, default=32)
    args = parser.parse_args()

    lengths = dapo_like_lengths(args.prompts, args.samples, args.seed)
    ordered = sorted(lengths)
    truncated = sum(n >= MAX_RESPONSE + 50 for n in lengths) / len(lengths)
    print(
        f"{len(lengths)} sequences ({args.prompts} prompts x {args.samples}), seed {args.seed}: "
        f"mean {statistics.mean(lengths):.0f} tokens, median {ordered[len(ordered) // 2]}, "
        f"p90 {ordered[int(0.9 * len(ordered))]}, max {ordered[-1]}, truncated at max {100 * truncated:.1f}%"
    )
    mini = args.mini_batch_prompts * args.samples
    for budget in (MAX_PROMPT + MAX_RESPONSE, 2 * (MAX_PROMPT + MAX_RESPONSE)):
        per_rank = len(lengths) // args.dp
        print(f"\nbudget {budget} tokens/micro-batch, DP={args.dp}, whole batch ({per_rank} sequences/rank):")
        run(lengths, args.dp, budget)
        print(f"budget {budget}, first mini-batch of {mini} sequences ({mini // args.dp}/rank):")
        run(lengths[:mini], args.dp, budget)


if __name__ == "__main__":
    main()
