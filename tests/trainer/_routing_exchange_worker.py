"""Worker for test_routing_exchange.py: 4 gloo ranks, two replicas ([0, 1] and [2, 3]) whose leaders
(ranks 0 and 2) generated 3 samples each and keep their routing; the train batch takes 4 of the 6
samples (dynamic sampling dropped two), rows 0-1 for replica 0 and rows 2-3 for replica 1."""

from __future__ import annotations

import torch
import torch.distributed as dist

from tests.support.torchrun_utils import reporting

LAYERS, TOPK = 3, 2
READ = [5, 2, 7, 4, 3, 6]  # tokens read by the 6 generated samples (3 from rank 0, then 3 from rank 2)


def routing_of(sample: int) -> torch.Tensor:
    """The routing sample `sample` was generated with (any rank can recompute it to check)."""
    g = torch.Generator().manual_seed(100 + sample)
    return torch.randint(0, 8, (READ[sample], LAYERS, TOPK), generator=g, dtype=torch.int32).to(torch.int8)


def main() -> dict:
    from megatron_dapo.trainer.routing_exchange import RoutingStore, fetch_routing

    out: dict = {}
    with reporting(out):
        dist.init_process_group("gloo")
        rank = dist.get_rank()
        store = RoutingStore()
        generated = {0: [0, 1, 2], 2: [3, 4, 5]}
        refs_of = {}
        for owner, samples in generated.items():
            refs = store.keep(owner, [routing_of(s) for s in samples]) if rank == owner else [(owner, i) for i in range(3)]
            refs_of.update(zip(samples, refs))
        out["kept_bytes"] = store.nbytes
        train = [4, 0, 5, 2]  # the chosen samples, in train order (1 and 3 were dropped)
        needed_by = [[0, 1], [0, 1], [2, 3], [2, 3]]
        got = fetch_routing([refs_of[s] for s in train], needed_by, [READ[s] for s in train], (LAYERS, TOPK), torch.int8, store)
        out["positions"] = sorted(got)
        out["equal"] = all(torch.equal(got[p], routing_of(train[p])) for p in got)
        out["dtypes"] = sorted({str(t.dtype) for t in got.values()})
        out["received_bytes"] = sum(t.numel() * t.element_size() for t in got.values())
        dist.destroy_process_group()
    return out
