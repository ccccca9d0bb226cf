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

Experts (mixture-of-experts layers). A row whose names contain "{e}" is one expert's parameter:
HF names carry the global expert id (`mlp.experts.{e}.gate_proj.weight`), Megatron names the id
among the experts of this expert-parallel rank (`mlp.experts.local_experts.{e}.linear_fc1.weight`
with the local spec's sequential experts, `mlp.experts.linear_fc1.weight{e}` with TE's grouped
GEMM). Under expert parallelism EP rank r holds the global experts r * E/EP ... (r+1) * E/EP - 1
(`expert_location` / `global_expert_index`). A table is resolved for a model's expert count
(`MappingTable.rows` holds one bound row per expert, `Map.expert`); an expert's rows are adjacent,
so a consumer walking the table meets each expert's fused fc1 and its fc2 together. Expert rows are
split over the expert-tensor-parallel group (Megatron's `expert_tensor_parallel_size`), the other
rows over the tensor-parallel group; the transforms are the dense ones (GATE_UP, TP_SPLIT).
"""

from __future__ import annotations

import dataclasses
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
    "expand_experts",
    "expert_location",
    "global_expert_index",
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
    the index inside the model chunk in Megatron names. Names containing "{e}" are per expert: `{e}`
    is the global expert id in HF names and the id among this expert-parallel rank's experts in
    Megatron names; a table resolved for a model binds such a row to one expert (`expert`).
    """

    hf: tuple[str, ...]
    megatron: str
    transform: Transform
    tp_dim: Optional[int] = None
    megatron_te: Optional[str] = None
    """The name under the Transformer Engine layer spec, when it differs."""
    untied_only: bool = False
    """Present only when input and output embeddings are not tied (the output layer)."""
    expert: Optional[int] = None
    """The global expert this row is bound to (per-expert rows of a resolved table), else None."""

    def __post_init__(self) -> None:
        if len(self.hf) != self.transform.num_hf:
            raise ValueError(f"{self.transform} takes {self.transform.num_hf} HF tensors, row {self.megatron} lists {len(self.hf)}")
        names = (*self.hf, self.megatron, *((self.megatron_te,) if self.megatron_te else ()))
        for placeholder in ("{i}", "{e}"):
            present = [placeholder in n for n in names]
            if any(present) and not all(present):
                raise ValueError(f"row {self.megatron}: '{placeholder}' must appear in all names or none")
        if self.per_expert and not self.per_layer:
            raise ValueError(f"row {self.megatron}: a per-expert row ('{{e}}') must be per layer ('{{i}}')")
        if self.expert is not None and not self.per_expert:
            raise ValueError(f"row {self.megatron} is not per expert and cannot be bound to expert {self.expert}")

    @property
    def per_layer(self) -> bool:
        return "{i}" in self.megatron

    @property
    def per_expert(self) -> bool:
        """One expert's parameter: split over the expert-tensor-parallel group, placed by expert parallelism."""
        return "{e}" in self.megatron

    def for_expert(self, expert: int) -> "Map":
        """This per-expert row bound to global expert `expert`."""
        if not self.per_expert:
            raise ValueError(f"row {self.megatron} is not per expert")
        return dataclasses.replace(self, expert=expert)

    def _bound_expert(self, local_expert: Optional[int], side: str) -> dict:
        if not self.per_expert:
            return {}
        expert = self.expert if local_expert is None else local_expert
        if expert is None:
            raise ValueError(f"row {self.megatron} is per expert: bind it (for_expert) or name the {side} expert")
        return {"e": expert}

    def hf_names(self, layer: Optional[int] = None) -> tuple[str, ...]:
        """HF names, for global layer `layer` if the row is per layer (and the bound global expert)."""
        if not self.per_layer:
            return self.hf
        return tuple(n.format(i=layer, **self._bound_expert(None, "global")) for n in self.hf)

    def megatron_name(self, spec: str = LOCAL_SPEC, local_layer: Optional[int] = None, local_expert: Optional[int] = None) -> str:
        """Megatron name under `spec` ("local" or "te"), for chunk-local layer `local_layer`.

        Per-expert rows name `local_expert`, the expert's id on its expert-parallel rank; it defaults
        to the bound global expert, which is the local id without expert parallelism.
        """
        if spec not in (LOCAL_SPEC, TE_SPEC):
            raise ValueError(f"unknown layer spec {spec!r}")
        name = self.megatron_te if spec == TE_SPEC and self.megatron_te else self.megatron
        return name.format(i=local_layer, **self._bound_expert(local_expert, "local")) if self.per_layer else name

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
    num_experts: int = 0
    """Experts per MoE layer (0: dense); `rows` holds each per-expert template row bound to every expert."""

    def __post_init__(self) -> None:
        unbound = [r.megatron for r in self.rows if r.per_expert and r.expert is None]
        if unbound:
            raise ValueError(f"per-expert rows {unbound} must be bound to experts (`expand_experts`)")

    @property
    def global_rows(self) -> tuple[Map, ...]:
        return tuple(r for r in self.rows if not r.per_layer)

    @property
    def layer_rows(self) -> tuple[Map, ...]:
        return tuple(r for r in self.rows if r.per_layer)

    @property
    def expert_rows(self) -> tuple[Map, ...]:
        return tuple(r for r in self.rows if r.per_expert)

    def row_for_megatron(self, megatron_name_template: str, expert: Optional[int] = None) -> Map:
        """The row of a Megatron name template (per-expert rows: the one bound to global `expert`)."""
        for row in self.rows:
            if megatron_name_template in (row.megatron, row.megatron_te) and row.expert == expert:
                return row
        raise KeyError(megatron_name_template if expert is None else f"{megatron_name_template} (expert {expert})")

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


def expand_experts(rows: Sequence[Map], num_experts: int) -> tuple[Map, ...]:
    """`rows` with each run of per-expert template rows repeated for experts 0..num_experts-1.

    Expert-major: expert 0's rows (e.g. fc1, fc2), then expert 1's, ..., so an expert's parameters
    stay adjacent in the table's order.
    """
    out: list[Map] = []
    run: list[Map] = []

    def flush() -> None:
        if run and num_experts < 1:
            raise ValueError(f"per-expert rows {[r.megatron for r in run]} need num_experts >= 1, got {num_experts}")
        out.extend(row.for_expert(e) for e in range(num_experts) for row in run)
        run.clear()

    for row in rows:
        if row.per_expert:
            run.append(row)
        else:
            flush()
            out.append(row)
    flush()
    return tuple(out)


# ---------------------------------------------------------------------------------------------
# Expert placement
# ---------------------------------------------------------------------------------------------


def _experts_per_rank(num_experts: int, ep: int) -> int:
    if ep < 1 or num_experts % ep != 0:
        raise ValueError(f"{num_experts} experts cannot be split evenly over expert-parallel size {ep}")
    return num_experts // ep


def expert_location(global_expert: int, num_experts: int, ep: int = 1) -> tuple[int, int]:
    """(expert-parallel rank, local expert id) of a global expert (Megatron's contiguous split)."""
    if not 0 <= global_expert < num_experts:
        raise ValueError(f"expert {global_expert} outside 0..{num_experts - 1}")
    return divmod(global_expert, _experts_per_rank(num_experts, ep))


def global_expert_index(ep_rank: int, local_expert: int, num_experts: int, ep: int = 1) -> int:
    """Inverse of `expert_location`: ep_rank * experts_per_rank + local_expert."""
    per_rank = _experts_per_rank(num_experts, ep)
    if not 0 <= local_expert < per_rank or not 0 <= ep_rank < ep:
        raise ValueError(f"local expert {local_expert} of EP rank {ep_rank} outside {ep} ranks x {per_rank} experts")
    return ep_rank * per_rank + local_expert


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
