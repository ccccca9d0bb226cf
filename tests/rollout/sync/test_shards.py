"""The TP-shard rule (`engine_shards`), one process, no Megatron: checked for every row of every
architecture table against the slices a TP inference engine holds, written out here from the
convention (heads / query groups in contiguous blocks, gate and up rows, the input dimension of
o_proj / down_proj, vocabulary rows without padding). Every rank's stream against the full export
runs under torchrun in test_weight_sync.py."""

from __future__ import annotations

import pytest
import torch

from megatron_dapo.model.arch_tables import ARCH_TABLES
from megatron_dapo.model.mapping import MappingTable, ModelShape, expand_experts, padded_vocab_size
from megatron_dapo.rollout.sync.shards import engine_shards
from tests.support.shard_shapes import SHARD_SHAPE, hf_tensor


def _slice_of_rank(full: torch.Tensor, rank: int, tp: int, dim: int) -> torch.Tensor:
    """Rank `rank`'s contiguous block of `full` along `dim` (the TP inference convention)."""
    size = full.shape[dim] // tp
    return full.narrow(dim, rank * size, size)


@pytest.mark.parametrize("arch", sorted(ARCH_TABLES))
@pytest.mark.parametrize("tp", [1, 2, 4])
def test_engine_shards_are_the_engine_slices_of_every_mapping_row(arch, tp):
    """From each rank's Megatron shard (made by the table's own loader), the hand-over yields exactly
    the slices a TP engine shard holds, written out here from the convention, not from the code."""
    s = SHARD_SHAPE
    table = MappingTable(arch, expand_experts(ARCH_TABLES[arch], s["experts"]), False, s["experts"])
    shape = ModelShape(s["heads"], s["groups"], s["head_dim"], s["vocab"], padded_vocab_size(s["vocab"], tp))
    g = torch.Generator().manual_seed(tp)
    heads_per_rank, groups_per_rank, d = s["heads"] // tp, s["groups"] // tp, s["head_dim"]
    for row, layer in table.ordered(num_layers=1):
        full = {name: hf_tensor(name, g) for name in row.hf_names(layer)}
        covered = {name: [] for name in full}
        for rank in range(tp):
            megatron = row.to_megatron_shard([full[n] for n in row.hf_names(layer)], rank, tp, shape)
            shards = engine_shards(row, layer, megatron, rank, tp, shape)
            assert [sh.name for sh in shards] == list(row.hf_names(layer))
            for shard in shards:
                whole = full[shard.name]
                name = shard.name
                if name.endswith(("q_proj.weight", "q_proj.bias")):
                    expected, dim = whole[rank * heads_per_rank * d : (rank + 1) * heads_per_rank * d], 0
                elif name.endswith(("k_proj.weight", "v_proj.weight", "k_proj.bias", "v_proj.bias")):
                    expected, dim = whole[rank * groups_per_rank * d : (rank + 1) * groups_per_rank * d], 0
                elif name.endswith(("gate_proj.weight", "up_proj.weight")):
                    expected, dim = _slice_of_rank(whole, rank, tp, 0), 0
                elif name.endswith(("o_proj.weight", "down_proj.weight")):
                    expected, dim = _slice_of_rank(whole, rank, tp, 1), 1
                elif name.endswith(("embed_tokens.weight", "lm_head.weight")):
                    per_rank = shape.padded_vocab_size // tp
                    lo, hi = min(rank * per_rank, s["vocab"]), min((rank + 1) * per_rank, s["vocab"])
                    expected, dim = whole[lo:hi], 0
                else:  # norms: whole on every rank
                    expected, dim = whole, None
                assert shard.dim == dim, name
                assert torch.equal(shard.tensor, expected), name
                assert shard.full_shape == tuple(whole.shape), name
                if dim is not None:
                    assert torch.equal(whole.narrow(dim, shard.start, shard.tensor.shape[dim]), shard.tensor), name
                covered[name].append(shard)
        for name, shards in covered.items():
            if shards[0].dim is None:
                continue
            # Together the ranks hold every row / column exactly once, in rank order.
            ordered = sorted(shards, key=lambda sh: sh.start)
            assert torch.equal(torch.cat([sh.tensor for sh in ordered], dim=ordered[0].dim), full[name]), name


def test_vocab_shard_of_a_rank_holding_only_padding_is_empty():
    """Vocab 100 padded to 512 at TP=4: rank 1 holds rows 128..255, all padding -> an empty slice."""
    from megatron_dapo.model.arch_tables import EMBEDDING

    shape = ModelShape(8, 4, 4, 100, padded_vocab_size(100, 4))
    full = torch.randn(100, 16)
    shards = [engine_shards(EMBEDDING, None, EMBEDDING.to_megatron_shard([full], r, 4, shape), r, 4, shape)[0] for r in range(4)]
    assert [sh.tensor.shape[0] for sh in shards] == [100, 0, 0, 0]
    assert torch.equal(shards[0].tensor, full)
