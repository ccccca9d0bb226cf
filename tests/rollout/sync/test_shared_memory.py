"""The shared bucket file, one process: every TP rank's slices (from the architecture tables' own
Megatron shards, at TP 2 and 4, vocabulary padding included) written into one file in any rank
order read back as exactly the full HF tensors. The collective hand-over between processes runs in
test_shard_handover.py."""

from __future__ import annotations

import pytest
import torch

from megatron_dapo.model.arch_tables import ARCH_TABLES
from megatron_dapo.model.bucketing import bucket_stream
from megatron_dapo.model.mapping import MappingTable, ModelShape, expand_experts, padded_vocab_size
from megatron_dapo.rollout.sync.shards import EngineShard, engine_shards
from megatron_dapo.rollout.sync.shared_memory import iter_safetensors, write_shards_into_bucket_file
from tests.support.shard_shapes import SHARD_SHAPE, hf_tensor


def _full_hf_tensors(table: MappingTable, num_layers: int, dtype: torch.dtype, seed: int) -> dict[str, torch.Tensor]:
    """Random full HF tensors for every name of the table (shapes from SHARD_SHAPE)."""
    g = torch.Generator().manual_seed(seed)
    return {name: hf_tensor(name, g).to(dtype) for row, layer in table.ordered(num_layers) for name in row.hf_names(layer)}


@pytest.mark.parametrize("arch", sorted(ARCH_TABLES))
@pytest.mark.parametrize("tp,dtype", [(2, torch.float32), (4, torch.bfloat16)])
def test_every_ranks_slices_assemble_the_full_tensors_in_one_file(arch, tp, dtype, tmp_path):
    s = SHARD_SHAPE
    table = MappingTable(arch, expand_experts(ARCH_TABLES[arch], s["experts"]), False, s["experts"])
    shape = ModelShape(s["heads"], s["groups"], s["head_dim"], s["vocab"], padded_vocab_size(s["vocab"], tp))
    full = _full_hf_tensors(table, num_layers=2, dtype=dtype, seed=tp)
    per_rank = {rank: [] for rank in range(tp)}
    for row, layer in table.ordered(2):
        for rank in range(tp):
            megatron = row.to_megatron_shard([full[n] for n in row.hf_names(layer)], rank, tp, shape)
            per_rank[rank].extend(engine_shards(row, layer, megatron, rank, tp, shape))
    # Buckets cut by full-tensor bytes are the same on every rank (the vocab shards differ in size).
    limit = 3000
    buckets = {rank: list(bucket_stream(per_rank[rank], limit, size_of=lambda sh: sh.full_nbytes)) for rank in range(tp)}
    cuts = {rank: [[sh.name for sh in b] for b in buckets[rank]] for rank in range(tp)}
    assert all(cuts[rank] == cuts[0] for rank in range(tp)) and len(cuts[0]) > 3
    read_back: dict[str, torch.Tensor] = {}
    for index in range(len(cuts[0])):
        path = tmp_path / f"bucket{index}.safetensors"
        for rank in reversed(range(tp)):  # any order: the header is rank 0's, slices are disjoint
            write_shards_into_bucket_file(path, buckets[rank][index], rank)
        names = [name for name, _ in iter_safetensors(path)]
        assert sorted(names) == sorted(cuts[0][index])
        read_back.update(iter_safetensors(path))
    assert sorted(read_back) == sorted(full)
    for name, tensor in full.items():
        assert read_back[name].dtype == dtype and torch.equal(read_back[name], tensor), name


def test_a_missing_rank_leaves_its_slice_empty(tmp_path):
    """The check can fail: without rank 1's slices its rows stay zero (the file is not pre-filled)."""
    full = torch.randn(4, 3) + 10
    path = tmp_path / "b.safetensors"
    write_shards_into_bucket_file(path, [EngineShard("w", full[:2].clone(), 0, 0, 4)], 0)
    (name, tensor), = list(iter_safetensors(path))
    assert torch.equal(tensor[:2], full[:2]) and torch.equal(tensor[2:], torch.zeros(2, 3))
