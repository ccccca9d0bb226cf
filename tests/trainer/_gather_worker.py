"""Ranks of a gloo world gather rollout samples through the tensor path; the pickled
all_gather_object of the same samples is the reference."""

from __future__ import annotations

import torch.distributed as dist

from tests.support.samples import as_plain, make_samples
from tests.support.torchrun_utils import write_rank_result


def main(contributors: list[int]) -> None:
    from megatron_dapo.trainer.samples import Samples, gather_samples

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    # Contributors in reverse rank order: the order key, not the rank, decides the order.
    order = {r: i for i, r in enumerate(reversed(contributors))}
    local = make_samples(seed=rank, num_prompts=3 + rank, n=2) if rank in order else None
    gathered = gather_samples(local, order_key=order.get(rank))
    reference: list = [None] * dist.get_world_size()
    dist.all_gather_object(reference, None if local is None else (order[rank], as_plain(local)))
    expected = Samples.concat([])
    parts = sorted((r for r in reference if r is not None), key=lambda entry: entry[0])
    expected_plain = {k: [v for _, part in parts for v in part[k]] for k in as_plain(expected)}
    write_rank_result({"equal": as_plain(gathered) == expected_plain, "count": len(gathered),
                       "dtypes": sorted({str(t.dtype) for t in gathered.response_ids + gathered.prompt_ids})})  # fmt: skip
    dist.barrier()
    dist.destroy_process_group()  # gloo aborts a process that exits with its group alive
