"""Weight sync into an SPMD engine when rollout TP = actor TP: each rank loads its OWN slices, in-process.

    transport = InProcessShards.create(engine, tp_group)         # every rank of the TP group
    sync_weights(models, hf_cfg, transport, bucket_mb=512)

In the spmd placement with `rollout.tp == parallel.tp`, the vLLM TP group of a rank is the actor's
Megatron TP group (both are the consecutive ranks [r - r % tp, ... + tp)), and TP rank r of vLLM
holds the same block of heads / rows as Megatron's TP rank r (`shards.engine_shards` uses the
usual convention of TP inference engines). So nothing has to travel between ranks: each rank
turns its Megatron shard into HF-named `EngineShard`s and gives them to its own vLLM worker in
the same process (`collective_rpc` is a function call there). No gather, no file.

vLLM's loaders take full HF tensors and cut their rank's part with `narrow(dim, rank * size, size)`;
each slice therefore travels as a `PlacedSlice`: a tensor with the FULL shape and no memory of its
own, whose narrow/slice inside the slice's rows returns a view of the slice (anything else raises).
No full-shape buffer is made, nothing is copied on the way: the loader copies the slice into the
parameter, on the parameter's device (`bucketing.bucket_device`; on a GPU the push never touches
host memory).

Vocabulary rows are the exception: Megatron pads the vocabulary to a multiple of 128 x TP before
splitting it, vLLM to a multiple of 64, so the split points can differ (Qwen2.5: 151936 rows,
Megatron's rank 0 holds 76032, vLLM's 75968). For the embedding and the LM head the ranks exchange
their extents (Megatron's and vLLM's rows); if every vLLM rank's rows lie inside its own Megatron
slice nothing else moves, otherwise each rank receives the rows it lacks from the ranks that hold
them (point to point) into a buffer of exactly its vLLM rows (1/TP of the tensor).
"""

from __future__ import annotations

from typing import Any, Iterable, Optional, Sequence

import torch
import torch.distributed as dist

from megatron_dapo.rollout.sync.dispatch import OwnShards
from megatron_dapo.rollout.sync.shards import EngineShard


class InProcessShards(OwnShards):
    """The weight-sync mode "tp_shards": own slices straight into this rank's SPMD engine shard."""

    mode = "tp_shards"

    @classmethod
    def create(cls, engine: Any, group: Optional[dist.ProcessGroup]) -> "InProcessShards":
        """Every rank of the actor's TP group (`InProcessShardTarget.create` checks the groups coincide)."""
        return cls(InProcessShardTarget.create(engine, group))


class InProcessShardTarget:
    """A `dispatch.ShardLoadingEngine` feeding this rank's slices to this rank's SPMD vLLM engine."""

    def __init__(self, engine: Any, group: Optional[dist.ProcessGroup], vocab_rows: dict[str, tuple[int, int]]) -> None:
        self.engine = engine
        self.group = group
        self.vocab_rows = vocab_rows
        """{HF name: (first, end)} of the vocabulary rows this rank's vLLM worker holds."""
        self.exchanged_vocab: dict[str, bool] = {}
        """Per vocabulary tensor: whether the last sync had to exchange rows of it (split points differ)."""

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
        """Collective over the TP group only for vocabulary tensors (their extents, then any rows missing)."""
        self.engine.load_weights([(shard.name, self._engine_tensor(shard)) for shard in shards])

    def commit_weights(self) -> None:
        self.engine.commit_weights()

    def _engine_tensor(self, shard: EngineShard) -> torch.Tensor:
        """A full-shape tensor the engine's loader cuts this rank's slice from (see the module doc)."""
        if shard.dim is None:
            return shard.tensor
        if shard.name in self.vocab_rows:
            return self._vocabulary_tensor(shard)
        return PlacedSlice(shard.tensor, shard.dim, shard.start, shard.full_shape)

    def _vocabulary_tensor(self, shard: EngineShard) -> torch.Tensor:
        first, end = self.vocab_rows[shard.name]
        extents = _all_gather_extents((shard.start, shard.tensor.shape[0], first, end), shard.tensor, self.group)
        exchange = any(not (start <= lo and hi <= start + rows) for start, rows, lo, hi in extents)
        self.exchanged_vocab[shard.name] = exchange
        if not exchange:
            return PlacedSlice(shard.tensor, 0, shard.start, shard.full_shape)
        rows = _exchange_rows(shard.tensor, extents, self.group)
        if rows is None:  # this rank held its rows: it only sent
            return PlacedSlice(shard.tensor, 0, shard.start, shard.full_shape)
        return PlacedSlice(rows, 0, first, shard.full_shape)


class PlacedSlice(torch.Tensor):
    """A stand-in with the full tensor's shape for one slice of it: ``full.narrow(dim, start, len) == slice``.

    It has no memory of its own. Slicing it (`narrow`, `[a:b]`) inside the slice's extent along
    `dim` returns a view of the slice; slicing along another dimension gives a `PlacedSlice` of the
    sliced slice, and so does `.to(device / dtype)` (only the slice is copied); metadata (shape,
    dtype, device, numel) are the full tensor's. Any other operation raises, naming it: an engine
    loader that reads the whole tensor must get a real one.
    """

    @staticmethod
    def __new__(cls, piece: torch.Tensor, dim: int, start: int, full_shape: Sequence[int]) -> "PlacedSlice":
        full_shape = tuple(int(size) for size in full_shape)
        expected = full_shape[:dim] + (piece.shape[dim],) + full_shape[dim + 1 :]
        if tuple(piece.shape) != expected or not 0 <= start <= full_shape[dim] - piece.shape[dim]:
            raise ValueError(f"a slice of shape {tuple(piece.shape)} cannot sit at {start} along dim {dim} of {full_shape}")
        placed = torch.Tensor._make_wrapper_subclass(cls, full_shape, dtype=piece.dtype, device=piece.device, requires_grad=False)
        placed.piece, placed.dim_, placed.start = piece, dim, start
        return placed

    __torch_function__ = torch._C._disabled_torch_function_impl

    def __repr__(self) -> str:  # the default would read the (absent) values
        return f"PlacedSlice(shape={tuple(self.shape)}, rows [{self.start}, {self.start + self.piece.shape[self.dim_]}) of dim {self.dim_})"

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        aten = torch.ops.aten
        placed = args[0]
        if func in (aten.detach.default, aten.alias.default):
            return PlacedSlice(func(placed.piece), placed.dim_, placed.start, placed.shape)
        if func is aten._to_copy.default:  # `.to(device / dtype)`: only the slice moves
            return PlacedSlice(func(placed.piece, **kwargs), placed.dim_, placed.start, placed.shape)
        if func is aten.slice.Tensor:
            return placed._slice(*args[1:], **kwargs)
        if func is aten.unsqueeze.default:  # vLLM's expert loader: one expert as a stack of one
            return placed._unsqueeze(*args[1:], **kwargs)
        if func is aten.unbind.int:  # ... which it then takes apart again, expert by expert
            return placed._unbind(*args[1:], **kwargs)
        raise NotImplementedError(
            f"{func} on a PlacedSlice (a {tuple(placed.shape)} tensor holding only {tuple(placed.piece.shape)} at {placed.start} "
            f"along dim {placed.dim_}): the engine's loader must only narrow it to its own rows"
        )

    def _unsqueeze(self, dim: int) -> "PlacedSlice":
        dim = dim % (self.dim() + 1)
        shape = list(self.shape)
        shape.insert(dim, 1)
        return PlacedSlice(self.piece.unsqueeze(dim), self.dim_ + (dim <= self.dim_), self.start, shape)

    def _unbind(self, dim: int = 0) -> tuple:
        dim = dim % self.dim()
        if dim == self.dim_:
            raise NotImplementedError(f"unbind along dim {dim}, the dimension a PlacedSlice holds only part of")
        shape = [size for index, size in enumerate(self.shape) if index != dim]
        return tuple(PlacedSlice(piece, self.dim_ - (dim < self.dim_), self.start, shape) for piece in self.piece.unbind(dim))

    def _slice(self, dim: int = 0, start: Optional[int] = None, end: Optional[int] = None, step: int = 1) -> torch.Tensor:
        dim = dim % self.dim()
        start, end, _ = slice(start, end).indices(self.shape[dim])
        end = max(start, end)
        if dim != self.dim_:  # the other dimensions are whole in the piece
            piece = self.piece[(slice(None),) * dim + (slice(start, end, step),)]
            shape = list(self.shape)
            shape[dim] = piece.shape[dim]
            return PlacedSlice(piece, self.dim_, self.start, shape)
        held = self.piece.shape[dim]
        if step != 1 or start < self.start or end > self.start + held:
            raise NotImplementedError(
                f"slice [{start}:{end}:{step}] of dim {dim} of a PlacedSlice that holds only [{self.start}:{self.start + held}]: "
                "the engine cut rows of another rank (does its TP rank / split match the actor's?)"
            )
        return self.piece.narrow(dim, start - self.start, end - start)


def _all_gather_extents(extent: Sequence[int], like: torch.Tensor, group: Optional[dist.ProcessGroup]) -> list[tuple[int, ...]]:
    """Every TP rank's `extent` (a few ints), in group-rank order."""
    mine = torch.tensor(list(extent), dtype=torch.int64, device=_collective_device(like, group))
    if group is None and not dist.is_initialized():
        return [tuple(int(v) for v in mine)]
    gathered = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(gathered, mine, group=group)
    return [tuple(int(v) for v in entry.tolist()) for entry in gathered]


def _exchange_rows(
    tensor: torch.Tensor, extents: Sequence[tuple[int, ...]], group: Optional[dist.ProcessGroup]
) -> Optional[torch.Tensor]:
    """This rank's vLLM rows [first, end) of a vocabulary tensor split at Megatron's points (a collective).

    `extents[k]` = (Megatron start, Megatron rows, vLLM first, vLLM end) of group rank k; this rank
    holds `tensor` = rows [start, start + rows). Each rank sends the rows others need from its own
    slice and receives what it lacks, point to point; only the result (1/TP of the tensor) is new.
    None where this rank holds all of its vLLM rows itself (it only sends).
    """
    me = dist.get_rank(group) if dist.is_initialized() else 0
    start, held, first, end = extents[me]
    receives = not (start <= first and end <= start + held)
    rows = torch.empty((end - first, *tensor.shape[1:]), dtype=tensor.dtype, device=tensor.device) if receives else None
    operations = []
    for peer, (peer_start, peer_held, peer_first, peer_end) in enumerate(extents):
        lo, hi = max(first, peer_start), min(end, peer_start + peer_held)  # what `peer` holds of mine
        if receives and hi > lo:
            if peer == me:
                rows[lo - first : hi - first].copy_(tensor[lo - start : hi - start])
            else:
                operations.append(dist.P2POp(dist.irecv, rows[lo - first : hi - first], _global_rank(group, peer), group))
        peer_receives = not (peer_start <= peer_first and peer_end <= peer_start + peer_held)
        lo, hi = max(peer_first, start), min(peer_end, start + held)  # what I hold of `peer`'s
        if peer_receives and hi > lo and peer != me:
            operations.append(dist.P2POp(dist.isend, tensor[lo - start : hi - start].contiguous(), _global_rank(group, peer), group))
    # Every rank of the group has just taken part in the extents' all-gather, so a batch that
    # involves only some of them is allowed on NCCL too.
    if operations:
        for request in dist.batch_isend_irecv(operations):
            request.wait()
    return rows


def _global_rank(group: Optional[dist.ProcessGroup], group_rank: int) -> int:
    return group_rank if group is None else dist.get_global_rank(group, group_rank)


def _collective_device(tensor: torch.Tensor, group: Optional[dist.ProcessGroup] = None) -> torch.device:
    return tensor.device if dist.is_initialized() and dist.get_backend(group) == "nccl" else torch.device("cpu")
