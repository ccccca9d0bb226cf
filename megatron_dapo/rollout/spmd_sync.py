"""Weight sync into an SPMD engine when rollout TP = actor TP: each rank loads its OWN slices, in-process.

    target = InProcessShardTarget.create(engine, tp_group)       # every rank of the TP group
    sync_weights(models, hf_cfg, target, bucket_mb=512, tp_shards=True)

In the spmd placement with `rollout.tp == parallel.tp`, the vLLM TP group of a rank is the actor's
Megatron TP group (both are the consecutive ranks [r - r % tp, ... + tp)), and TP rank r of vLLM
holds the same block of heads / rows as Megatron's TP rank r (`weight_sync.engine_shards` uses the
usual convention of TP inference engines). So nothing has to travel between ranks: each rank
turns its Megatron shard into HF-named `EngineShard`s and gives them to its own vLLM worker in
the same process (`collective_rpc` is a function call there). No gather, no file.

vLLM's loaders take full HF tensors and cut their rank's part with `narrow(dim, rank * size, size)`;
each slice is therefore placed at its offset in an otherwise untouched full-shape buffer, from
which the loader takes exactly that slice back (the rest is never read; `torch.empty` pages that
are never written are not even backed by memory for large buffers on Linux).

Vocabulary rows are the exception: Megatron pads the vocabulary to a multiple of 128 x TP before
splitting it, vLLM to a multiple of 64, so the split points can differ (Qwen2.5: 151936 rows,
Megatron's rank 0 holds 76032, vLLM's 75968). For the embedding and the LM head the ranks check
together whether every vLLM rank's rows lie inside its own Megatron slice; if not, that tensor's
slices are all-gathered over the TP group (two tensors per sync; every other tensor moves none).
"""

from __future__ import annotations

from typing import Any, Iterable, Optional

import torch
import torch.distributed as dist

from megatron_dapo.rollout.weight_sync import EngineShard


class InProcessShardTarget:
    """A `weight_sync.ShardLoadingEngine` feeding this rank's slices to this rank's SPMD vLLM engine."""

    def __init__(self, engine: Any, group: Optional[dist.ProcessGroup], vocab_rows: dict[str, tuple[int, int]]) -> None:
        self.engine = engine
        self.group = group
        self.vocab_rows = vocab_rows
        """{HF name: (first, end)} of the vocabulary rows this rank's vLLM worker holds."""
        self.exchanged_vocab: dict[str, bool] = {}
        """Per vocabulary tensor: whether the last sync had to all-gather it (split points differ)."""

    @classmethod
    def create(cls, engine: Any, group: Optional[dist.ProcessGroup]) -> "InProcessShardTarget":
        """Check that vLLM's TP group is `group` (same ranks, same order), then build the target."""
        expected = dist.get_process_group_ranks(group) if group is not None else [0]
        actual = engine.tensor_parallel_ranks()
        if list(actual) != list(expected):
            raise ValueError(
                f"the spmd engine's TP group is ranks {actual}, the actor's TP group is {expected}: per-rank "
                "shards cannot go straight into the engine (set rollout.weight_sync_mode=gather)"
            )
        return cls(engine, group, engine.vocab_rows())

    def load_weight_shards(self, shards: Iterable[EngineShard]) -> None:
        """Collective over the TP group only for vocabulary tensors whose split points differ."""
        self.engine.load_weights([(shard.name, self._engine_tensor(shard)) for shard in shards])

    def commit_weights(self) -> None:
        self.engine.commit_weights()

    def _engine_tensor(self, shard: EngineShard) -> torch.Tensor:
        """A tensor the engine's loader cuts this rank's slice from (see the module doc)."""
        if shard.dim is None:
            return shard.tensor
        if shard.name in self.vocab_rows:
            return self._vocabulary_tensor(shard)
        return _placed_in_full_buffer(shard)

    def _vocabulary_tensor(self, shard: EngineShard) -> torch.Tensor:
        first, end = self.vocab_rows[shard.name]
        held = shard.start <= first and end <= shard.start + shard.tensor.shape[0]
        missing = torch.tensor([0 if held else 1], dtype=torch.int32, device=_collective_device(shard.tensor))
        if self.group is not None:
            dist.all_reduce(missing, op=dist.ReduceOp.MAX, group=self.group)
        self.exchanged_vocab[shard.name] = bool(missing.item())
        if not missing.item():
            return _placed_in_full_buffer(shard)
        return _all_gather_rows(shard, self.group)


def _placed_in_full_buffer(shard: EngineShard) -> torch.Tensor:
    full = torch.empty(shard.full_shape, dtype=shard.tensor.dtype, device=shard.tensor.device)
    full.narrow(shard.dim, shard.start, shard.tensor.shape[shard.dim]).copy_(shard.tensor)
    return full


def _all_gather_rows(shard: EngineShard, group: Optional[dist.ProcessGroup]) -> torch.Tensor:
    """The full tensor from every TP rank's rows [start, start + len) (lengths may differ: padding)."""
    tensor = shard.tensor
    device = _collective_device(tensor)
    size = dist.get_world_size(group)
    extent = torch.tensor([shard.start, tensor.shape[0]], dtype=torch.int64, device=device)
    extents = [torch.empty_like(extent) for _ in range(size)]
    dist.all_gather(extents, extent, group=group)
    longest = max(int(e[1]) for e in extents)
    padded = torch.zeros((longest, *tensor.shape[1:]), dtype=tensor.dtype, device=device)
    padded[: tensor.shape[0]].copy_(tensor)
    pieces = [torch.empty_like(padded) for _ in range(size)]
    dist.all_gather(pieces, padded, group=group)
    full = torch.empty(shard.full_shape, dtype=tensor.dtype, device=tensor.device)
    for extent, piece in zip(extents, pieces):
        start, rows = int(extent[0]), int(extent[1])
        full[start : start + rows].copy_(piece[:rows])
    return full


def _collective_device(tensor: torch.Tensor) -> torch.device:
    return tensor.device if dist.is_initialized() and dist.get_backend() == "nccl" else torch.device("cpu")
