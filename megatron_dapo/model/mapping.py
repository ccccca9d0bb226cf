"""HF <-> Megatron parameter mapping: declarative rows, pure TP-aware transforms, layer placement.

One row (`Map`) says: these HF tensors (1, or 3 for q/k/v, or 2 for gate/up) are this Megatron
parameter, related by this transform, split over tensor-parallel ranks along `tp_dim` (None:
replicated). Per-architecture tables (`arch_tables.py`) are lists of rows; weight conversion
(`load.py`) and the rollout weight sync use the same rows, so what is loaded is what is exported.

Transforms are pure functions of tensors with exact inverses (slicing and concatenation only, no
arithmetic), so HF -> Megatron shards -> HF is bit-exact:

- `REPLICATED`: the same tensor on every TP rank (norm weights).
- `TP_SPLIT`: an even split along `tp_dim` (row-parallel `linear_proj`/`linear_fc2` along dim 1).
- `QKV_INTERLEAVED`: Megatron's fused QKV is grouped per query group: for each of the G groups,
  [the group's heads_per_group query heads; its key head; its value head], each head_dim rows.
  A TP split along dim 0 therefore gives each rank whole groups (G / tp of them).
- `GATE_UP`: Megatron's `linear_fc1` of a SwiGLU MLP; under TP each rank holds
  [gate shard; up shard] (not a split of cat(gate, up)).
- `VOCAB_PAD`: embedding / output rows padded with zeros to the padded vocabulary, then split
  along dim 0; the inverse drops the padding. (The logits of padded ids are 0: mask them when
  normalising over the vocabulary.)

Megatron's parameter names differ between the local layer spec and the Transformer Engine spec,
which fuses the input norm into `linear_qkv` and the pre-MLP norm into `linear_fc1`; a row carries
both names (`megatron`, `megatron_te`).

Layer numbering: HF names use the global layer index; Megatron names use the index inside one
model chunk. `layer_location` / `global_layer_index` convert, following Megatron's even split
(chunk v of pipeline rank p holds layers v * L/vpp + p * L/(pp*vpp) ... + L/(pp*vpp) - 1).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterator, Optional, Sequence

import torch

__all__ = [
    "GATE_UP",
    "LOCAL_SPEC",
    "Map",
    "MappingTable",
    "ModelShape",
    "QKV_INTERLEAVED",
    "REPLICATED",
    "TE_SPEC",
    "TP_SPLIT",
    "Transform",
    "VOCAB_PAD",
    "global_layer_index",
    "layer_location",
    "padded_vocab_size",
]

LOCAL_SPEC = "local"
TE_SPEC = "te"
VOCAB_PAD_MULTIPLE = 128


def padded_vocab_size(vocab_size: int, tp_size: int, multiple: int = VOCAB_PAD_MULTIPLE) -> int:
    """Vocabulary rounded up to a multiple of `multiple * tp_size` (Megatron's padding rule)."""
    step = multiple * tp_size
    return int(math.ceil(vocab_size / step) * step)


@dataclass(frozen=True)
class ModelShape:
    """The sizes the transforms need."""

    num_attention_heads: int
    num_query_groups: int
    head_dim: int
    vocab_size: int
    padded_vocab_size: int

    @classmethod
    def from_hf(cls, cfg, tp_size: int) -> "ModelShape":
        """From an `HFModelConfig` and the tensor-parallel size (which sets the vocabulary padding)."""
        return cls(
            num_attention_heads=cfg.num_attention_heads,
            num_query_groups=cfg.num_key_value_heads,
            head_dim=cfg.head_dim,
            vocab_size=cfg.vocab_size,
            padded_vocab_size=padded_vocab_size(cfg.vocab_size, tp_size),
        )

    @property
    def heads_per_group(self) -> int:
        return self.num_attention_heads // self.num_query_groups


# ---------------------------------------------------------------------------------------------
# Transforms
# ---------------------------------------------------------------------------------------------


def _check_divisible(size: int, tp_size: int, what: str) -> None:
    if size % tp_size != 0:
        raise ValueError(f"{what} of size {size} cannot be split over {tp_size} tensor-parallel ranks")


class Transform:
    """A pure, invertible relation between HF tensors and one Megatron parameter's TP shards."""

    name = "transform"
    num_hf = 1
    """How many HF tensors make the Megatron parameter."""

    def to_megatron_shard(
        self, hf: Sequence[torch.Tensor], tp_rank: int, tp_size: int, shape: ModelShape, tp_dim: Optional[int]
    ) -> torch.Tensor:
        raise NotImplementedError

    def to_hf(self, shards: Sequence[torch.Tensor], shape: ModelShape, tp_dim: Optional[int]) -> tuple[torch.Tensor, ...]:
        raise NotImplementedError

    def __repr__(self) -> str:
        return self.name


class _Replicated(Transform):
    name = "REPLICATED"

    def to_megatron_shard(self, hf, tp_rank, tp_size, shape, tp_dim):
        return hf[0]

    def to_hf(self, shards, shape, tp_dim):
        return (shards[0],)


class _TPSplit(Transform):
    name = "TP_SPLIT"

    def to_megatron_shard(self, hf, tp_rank, tp_size, shape, tp_dim):
        if tp_dim is None:
            return hf[0]
        _check_divisible(hf[0].shape[tp_dim], tp_size, f"dimension {tp_dim}")
        return hf[0].chunk(tp_size, dim=tp_dim)[tp_rank]

    def to_hf(self, shards, shape, tp_dim):
        if tp_dim is None:
            return (shards[0],)
        return (torch.cat(list(shards), dim=tp_dim),)


class _QKVInterleaved(Transform):
    name = "QKV_INTERLEAVED"
    num_hf = 3

    @staticmethod
    def fuse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, shape: ModelShape) -> torch.Tensor:
        """Full (unsplit) Megatron QKV from HF q, k, v (weights [out, in] or biases [out])."""
        g, d, hpg = shape.num_query_groups, shape.head_dim, shape.heads_per_group
        rest = q.shape[1:]
        q = q.reshape(g, hpg * d, *rest)
        k = k.reshape(g, d, *rest)
        v = v.reshape(g, d, *rest)
        return torch.cat([q, k, v], dim=1).reshape(g * (hpg + 2) * d, *rest)

    @staticmethod
    def split(fused: torch.Tensor, shape: ModelShape, num_groups: int) -> tuple[torch.Tensor, ...]:
        """Inverse of `fuse` for `num_groups` query groups."""
        d, hpg = shape.head_dim, shape.heads_per_group
        rest = fused.shape[1:]
        grouped = fused.reshape(num_groups, (hpg + 2) * d, *rest)
        q, k, v = torch.split(grouped, [hpg * d, d, d], dim=1)
        return (
            q.reshape(num_groups * hpg * d, *rest),
            k.reshape(num_groups * d, *rest),
            v.reshape(num_groups * d, *rest),
        )

    def to_megatron_shard(self, hf, tp_rank, tp_size, shape, tp_dim):
        q, k, v = hf
        g = shape.num_query_groups
        _check_divisible(g, tp_size, "num_query_groups")
        per_rank = g // tp_size
        lo, hi = tp_rank * per_rank, (tp_rank + 1) * per_rank
        d, hpg = shape.head_dim, shape.heads_per_group
        # Slice whole groups before fusing, so each rank only touches its own rows.
        sub = ModelShape(per_rank * hpg, per_rank, d, shape.vocab_size, shape.padded_vocab_size)
        return self.fuse(q[lo * hpg * d : hi * hpg * d], k[lo * d : hi * d], v[lo * d : hi * d], sub)

    def to_hf(self, shards, shape, tp_dim):
        fused = torch.cat(list(shards), dim=0)
        return self.split(fused, shape, shape.num_query_groups)


class _GateUp(Transform):
    name = "GATE_UP"
    num_hf = 2

    def to_megatron_shard(self, hf, tp_rank, tp_size, shape, tp_dim):
        gate, up = hf
        _check_divisible(gate.shape[0], tp_size, "ffn_hidden_size")
        return torch.cat([gate.chunk(tp_size, dim=0)[tp_rank], up.chunk(tp_size, dim=0)[tp_rank]], dim=0)

    def to_hf(self, shards, shape, tp_dim):
        gates, ups = [], []
        for shard in shards:
            gate, up = shard.chunk(2, dim=0)
            gates.append(gate)
            ups.append(up)
        return torch.cat(gates, dim=0), torch.cat(ups, dim=0)


class _VocabPad(Transform):
    name = "VOCAB_PAD"

    def to_megatron_shard(self, hf, tp_rank, tp_size, shape, tp_dim):
        full = hf[0]
        if full.shape[0] != shape.vocab_size:
            raise ValueError(f"vocabulary tensor has {full.shape[0]} rows, the config says vocab_size={shape.vocab_size}")
        _check_divisible(shape.padded_vocab_size, tp_size, "padded vocabulary")
        per_rank = shape.padded_vocab_size // tp_size
        lo, hi = tp_rank * per_rank, (tp_rank + 1) * per_rank
        shard = full.new_zeros((per_rank, *full.shape[1:]))
        real_hi = min(hi, shape.vocab_size)
        if real_hi > lo:
            shard[: real_hi - lo] = full[lo:real_hi]
        return shard

    def to_hf(self, shards, shape, tp_dim):
        return (torch.cat(list(shards), dim=0)[: shape.vocab_size],)


REPLICATED: Transform = _Replicated()
TP_SPLIT: Transform = _TPSplit()
QKV_INTERLEAVED: Transform = _QKVInterleaved()
GATE_UP: Transform = _GateUp()
VOCAB_PAD: Transform = _VocabPad()


# ---------------------------------------------------------------------------------------------
# Rows and tables
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Map:
    """One Megatron parameter and the HF tensor(s) it is made of.

    Names containing "{i}" are per decoder layer: `{i}` is the global layer index in HF names and
    the index inside the model chunk in Megatron names.
    """

    hf: tuple[str, ...]
    megatron: str
    transform: Transform
    tp_dim: Optional[int] = None
    megatron_te: Optional[str] = None
    """The name under the Transformer Engine layer spec, when it differs."""
    untied_only: bool = False
    """Present only when input and output embeddings are not tied (the output layer)."""

    def __post_init__(self) -> None:
        if len(self.hf) != self.transform.num_hf:
            raise ValueError(f"{self.transform} takes {self.transform.num_hf} HF tensors, row {self.megatron} lists {len(self.hf)}")
        per_layer = ["{i}" in n for n in (*self.hf, self.megatron)]
        if any(per_layer) and not all(per_layer):
            raise ValueError(f"row {self.megatron}: '{{i}}' must appear in all names or none")

    @property
    def per_layer(self) -> bool:
        return "{i}" in self.megatron

    def hf_names(self, layer: Optional[int] = None) -> tuple[str, ...]:
        """HF names, for global layer `layer` if the row is per layer."""
        return tuple(n.format(i=layer) for n in self.hf) if self.per_layer else self.hf

    def megatron_name(self, spec: str = LOCAL_SPEC, local_layer: Optional[int] = None) -> str:
        """Megatron name under `spec` ("local" or "te"), for chunk-local layer `local_layer`."""
        if spec not in (LOCAL_SPEC, TE_SPEC):
            raise ValueError(f"unknown layer spec {spec!r}")
        name = self.megatron_te if spec == TE_SPEC and self.megatron_te else self.megatron
        return name.format(i=local_layer) if self.per_layer else name

    def to_megatron_shard(
        self, hf_tensors: Sequence[torch.Tensor], tp_rank: int, tp_size: int, shape: ModelShape
    ) -> torch.Tensor:
        """This TP rank's Megatron tensor from the full HF tensors (in `hf` order)."""
        return self.transform.to_megatron_shard(tuple(hf_tensors), tp_rank, tp_size, shape, self.tp_dim)

    def to_hf(self, megatron_shards: Sequence[torch.Tensor], shape: ModelShape) -> tuple[torch.Tensor, ...]:
        """The full HF tensors (in `hf` order) from all TP ranks' shards, in TP rank order."""
        return self.transform.to_hf(tuple(megatron_shards), shape, self.tp_dim)


@dataclass(frozen=True)
class MappingTable:
    """All rows of one architecture, resolved for tied or untied embeddings."""

    architecture: str
    rows: tuple[Map, ...]
    tie_word_embeddings: bool

    @property
    def global_rows(self) -> tuple[Map, ...]:
        return tuple(r for r in self.rows if not r.per_layer)

    @property
    def layer_rows(self) -> tuple[Map, ...]:
        return tuple(r for r in self.rows if r.per_layer)

    def row_for_megatron(self, megatron_name_template: str) -> Map:
        for row in self.rows:
            if megatron_name_template in (row.megatron, row.megatron_te):
                return row
        raise KeyError(megatron_name_template)

    def tied_output_row(self) -> Map:
        """The pipeline-last-stage copy of a tied embedding: `output_layer.weight` from the HF embedding.

        Megatron keeps this copy when the embedding and the output layer live on different
        pipeline stages; it is loaded, never exported (the first stage's embedding is the tensor).
        """
        embedding = self.row_for_megatron("embedding.word_embeddings.weight")
        return Map(hf=embedding.hf, megatron="output_layer.weight", transform=embedding.transform, tp_dim=embedding.tp_dim)

    def ordered(self, num_layers: int) -> Iterator[tuple[Map, Optional[int]]]:
        """(row, global layer or None) in HF order: embeddings, layers 0..L-1, final norm, output."""
        leading = [r for r in self.global_rows if r.megatron.startswith("embedding.")]
        trailing = [r for r in self.global_rows if not r.megatron.startswith("embedding.")]
        for row in leading:
            yield row, None
        for layer in range(num_layers):
            for row in self.layer_rows:
                yield row, layer
        for row in trailing:
            yield row, None

    def hf_names(self, num_layers: int) -> list[str]:
        """Every HF tensor name the model has, in HF order."""
        return [name for row, layer in self.ordered(num_layers) for name in row.hf_names(layer)]


# ---------------------------------------------------------------------------------------------
# Layer placement
# ---------------------------------------------------------------------------------------------


def _layers_per_chunk(num_layers: int, pp: int, vpp: Optional[int]) -> int:
    chunks = pp * (vpp or 1)
    if num_layers % chunks != 0:
        raise ValueError(f"{num_layers} layers cannot be split evenly into pp x vpp = {chunks} model chunks")
    return num_layers // chunks


def layer_location(global_layer: int, num_layers: int, pp: int = 1, vpp: Optional[int] = None) -> tuple[int, int, int]:
    """(pipeline rank, virtual-pipeline chunk, index inside the chunk) of a global layer."""
    if not 0 <= global_layer < num_layers:
        raise ValueError(f"layer {global_layer} outside 0..{num_layers - 1}")
    per_chunk = _layers_per_chunk(num_layers, pp, vpp)
    per_vpp_chunk = num_layers // (vpp or 1)
    vpp_rank, within = divmod(global_layer, per_vpp_chunk)
    pp_rank, local = divmod(within, per_chunk)
    return pp_rank, vpp_rank, local


def global_layer_index(
    pp_rank: int, vpp_rank: int, local_layer: int, num_layers: int, pp: int = 1, vpp: Optional[int] = None
) -> int:
    """Inverse of `layer_location`."""
    per_chunk = _layers_per_chunk(num_layers, pp, vpp)
    if not 0 <= local_layer < per_chunk:
        raise ValueError(f"local layer {local_layer} outside 0..{per_chunk - 1}")
    return vpp_rank * (num_layers // (vpp or 1)) + pp_rank * per_chunk + local_layer
