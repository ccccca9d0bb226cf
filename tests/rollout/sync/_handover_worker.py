"""Worker for test_shard_handover.py (run with tests/support/torchrun_utils.py; not collected by pytest).

Plain gloo processes (no Megatron): every rank is a TP rank of one group and holds its slices of a
few full tensors; `SharedMemoryHandover` must deliver the full tensors to the engine on rank 0.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist


class RecordingEngine:
    """An engine that keeps what it is given (stands for the embedded engine's load_weights)."""

    def __init__(self, fail_on: str | None = None) -> None:
        self.loaded: dict[str, torch.Tensor] = {}
        self.commits = 0
        self.fail_on = fail_on

    def load_weights(self, weights):
        for name, tensor in weights:
            if name == self.fail_on:
                raise KeyError(f"no parameter named {name}")
            self.loaded[name] = tensor.clone()

    def commit_weights(self):
        self.commits += 1


def full_tensors(dtype: torch.dtype) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return {
        "q_proj.weight": torch.randn(8, 6, generator=g).to(dtype),
        "o_proj.weight": torch.randn(6, 8, generator=g).to(dtype),
        "norm.weight": torch.randn(6, generator=g).to(dtype),
        "embed_tokens.weight": torch.randn(7, 6, generator=g).to(dtype),  # vocab 7: rank 1 holds 3 rows
    }


def my_shards(full: dict[str, torch.Tensor], rank: int, tp: int):
    from megatron_dapo.rollout.sync.shards import EngineShard

    shards = []
    for name, tensor in full.items():
        if name == "norm.weight":
            shards.append(EngineShard(name, tensor.clone(), None, 0, tensor.shape[0]))
        elif name == "embed_tokens.weight":  # Megatron-like padded split: 4 rows per rank
            lo, hi = min(4 * rank, 7), min(4 * rank + 4, 7)
            shards.append(EngineShard(name, tensor[lo:hi].clone(), 0, lo, 7))
        else:
            dim = 1 if name == "o_proj.weight" else 0
            size = tensor.shape[dim] // tp
            shards.append(EngineShard(name, tensor.narrow(dim, rank * size, size).clone(), dim, rank * size, tensor.shape[dim]))
    return shards


def main(fail_on: str | None = None, dtype: str = "float32", full_shm_on_rank: int | None = None) -> dict:
    import errno

    from megatron_dapo.rollout.sync.shared_memory import SharedMemoryHandover

    dist.init_process_group("gloo")
    rank, tp = dist.get_rank(), dist.get_world_size()
    if rank == full_shm_on_rank:  # this rank's /dev/shm is full: reserving the bucket's pages fails

        def no_space(*args):
            raise OSError(errno.ENOSPC, "No space left on device")

        os.posix_fallocate = no_space
    full = full_tensors(getattr(torch, dtype))
    engine = RecordingEngine(fail_on) if rank == 0 else None
    handover = SharedMemoryHandover.create(engine, dist.group.WORLD)
    result: dict = {"directory": str(handover.directory)}
    shards = my_shards(full, rank, tp)
    try:
        handover.load_weight_shards(shards[:2])  # two buckets, as sync_weights would cut them
        handover.load_weight_shards(shards[2:])
        handover.commit_weights()
        result["error"] = None
    except RuntimeError as error:
        result["error"] = str(error)
    dist.barrier()  # the owner removes a failed bucket's file after everyone has reported
    result["files_left"] = sorted(os.listdir(handover.directory))
    if engine is not None:
        result["equal"] = {name: torch.equal(engine.loaded[name], tensor) for name, tensor in full.items() if name in engine.loaded}
        result["commits"] = engine.commits
    dist.barrier()
    handover.close()
    result["directory_removed"] = not os.path.exists(handover.directory)
    dist.destroy_process_group()
    return result
