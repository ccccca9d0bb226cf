"""Generation results between ranks: pickled Python lists (before) vs one flat tensor per replica (now).

Every data-parallel replica's leader holds its share of a generation batch; every rank needs the
whole batch (dynamic sampling and advantages are decided identically everywhere). Both paths run in
the same process group, on the same synthetic samples, interleaved over `--repeats` rounds:

  (a) lists:  the samples as the trainer held them before (token ids and log-probs as Python lists),
              `all_gather_object` of them, as `gather_from_leaders` did;
  (b) tensor: `trainer.samples.gather_samples`: small fields pickled, token ids + log-prob bits in one
              int32 buffer per replica (each prompt once per group), broadcast from its leader.

Reported per round: bytes each replica serialises (pickle size for (a), header pickle + buffer for
(b)), and wall time of the whole gather (median over rounds, slowest rank). Lengths: each prompt
has 100-300 tokens; responses are log-normal around `--response-tokens` (capped at 4x), 16 per
prompt (`--samples-per-prompt`).

    torchrun --nproc_per_node 2 benchmarks/bench_gather_samples.py [--prompts 32] [--samples-per-prompt 16] [--response-tokens 2048]
"""

from __future__ import annotations

import argparse
import pickle
import random
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron_dapo.trainer.samples import Samples, gather_samples, pack_samples  # noqa: E402


def synthetic_samples(replica: int, prompts: int, n: int, response_tokens: int, seed: int) -> Samples:
    rng = random.Random(seed * 1000 + replica)
    gen = torch.Generator().manual_seed(seed * 1000 + replica)
    fields: dict[str, list] = {name: [] for name in Samples.__dataclass_fields__}
    for p in range(prompts):
        prompt = torch.randint(0, 150_000, (rng.randint(100, 300),), generator=gen)
        for _ in range(n):
            length = min(4 * response_tokens, max(1, int(response_tokens * rng.lognormvariate(0.0, 0.6))))
            fields["uid"].append(f"s1g0r{replica}p{p}")
            fields["prompt_ids"].append(prompt)
            fields["response_ids"].append(torch.randint(0, 150_000, (length,), generator=gen))
            fields["rollout_log_probs"].append(-torch.rand(length, generator=gen) * 3)
            fields["truncated"].append(length == 4 * response_tokens)
            fields["score"].append(rng.choice([1.0, -1.0]))
            fields["task_score"].append(fields["score"][-1])
            fields["acc"].append(fields["score"][-1] > 0)
            fields["pred"].append(str(rng.randint(0, 999)))
            fields["overlong_penalty"].append(0.0)
            fields["data_source"].append("math_dapo")
    return Samples(**fields)


def as_lists(samples: Samples) -> dict[str, list]:
    """The pre-tensor representation: token ids and log-probs as Python lists."""
    out = samples.as_fields()
    for name in ("prompt_ids", "response_ids", "rollout_log_probs"):
        out[name] = [t.tolist() for t in out[name]]
    return out


def slowest(seconds: float) -> float:
    value = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return float(value)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=32, help="prompts per replica")
    parser.add_argument("--samples-per-prompt", type=int, default=16, help="responses per prompt (rollout.n)")
    parser.add_argument("--response-tokens", type=int, default=2048, help="typical response length")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    local = synthetic_samples(rank, args.prompts, args.samples_per_prompt, args.response_tokens, args.seed)
    local_lists = as_lists(local)
    tokens = sum(len(r) for r in local.response_ids)
    header, payload = pack_samples(local)
    bytes_lists = len(pickle.dumps(local_lists))
    bytes_tensor = len(pickle.dumps(header)) + payload.numel() * payload.element_size()

    times: dict[str, list[float]] = {"lists": [], "tensor": []}
    for _ in range(args.repeats):
        dist.barrier()
        start = time.perf_counter()
        gathered: list = [None] * world
        dist.all_gather_object(gathered, local_lists)
        times["lists"].append(slowest(time.perf_counter() - start))
        del gathered
        dist.barrier()
        start = time.perf_counter()
        result = gather_samples(local, order_key=rank)
        times["tensor"].append(slowest(time.perf_counter() - start))
        assert len(result) == world * len(local)
        del result

    if rank == 0:
        a, b = statistics.median(times["lists"]), statistics.median(times["tensor"])
        print(f"{world} replicas x {args.prompts} prompts x {args.samples_per_prompt} responses, {tokens / len(local):.0f} response tokens on average "
              f"({tokens / 1e6:.2f} M response tokens per replica)")  # fmt: skip
        print(f"bytes per replica: lists {bytes_lists / 1e6:.1f} MB ({bytes_lists / tokens:.2f} B/token), "
              f"tensor {bytes_tensor / 1e6:.1f} MB ({bytes_tensor / tokens:.2f} B/token): {bytes_lists / bytes_tensor:.2f}x fewer")  # fmt: skip
        print(f"gather time (median of {args.repeats}, slowest rank): lists {a:.3f} s, tensor {b:.3f} s: {a / b:.1f}x faster")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
