"""Mapping transforms (bit-exact round trips over TP shards, Megatron's layouts), tables, layer placement."""

from __future__ import annotations

import pytest
import torch

from megatron_dapo.distributed.layout import ParallelLayout
from megatron_dapo.model.arch_tables import ARCH_TABLES, mapping_for
from megatron_dapo.model.hf_config import read_hf_config
from megatron_dapo.model.hf_weights import HFWeightReader
from megatron_dapo.model.mapping import (
    GATE_UP,
    QKV_INTERLEAVED,
    REPLICATED,
    TP_SPLIT,
    VOCAB_PAD,
    Map,
    MappingTable,
    ModelShape,
    expand_experts,
    expert_location,
    global_expert_index,
    global_layer_index,
    layer_location,
    padded_vocab_size,
)

TP_SIZES = (1, 2, 4)


def _shape(heads=8, groups=4, head_dim=16, vocab=300, tp=1):
    return ModelShape(heads, groups, head_dim, vocab, padded_vocab_size(vocab, tp))


def _round_trip(transform, hf, shape, tp, tp_dim):
    shards = [transform.to_megatron_shard(hf, r, tp, shape, tp_dim) for r in range(tp)]
    return shards, transform.to_hf(shards, shape, tp_dim)


def _reference_fused_qkv(q, k, v, shape):
    """Megatron's fused QKV built row by row: per group, its query heads, then its key, then its value."""
    d, hpg = shape.head_dim, shape.heads_per_group
    rows = []
    for group in range(shape.num_query_groups):
        for head in range(group * hpg, (group + 1) * hpg):
            rows.append(q[head * d : (head + 1) * d])
        rows.append(k[group * d : (group + 1) * d])
        rows.append(v[group * d : (group + 1) * d])
    return torch.cat(rows, dim=0)


# GQA (8 heads, 4 groups), MHA (8, 8), MQA (8, 1; TP=1 only: groups must divide over TP).
QKV_CASES = [(tp, h, g) for tp in TP_SIZES for h, g in [(8, 4), (8, 8), (8, 1), (16, 4)] if g % tp == 0]


@pytest.mark.parametrize("tp,heads,groups", QKV_CASES)
@pytest.mark.parametrize("kind", ["weight", "bias"])
def test_qkv_interleaved(tp, heads, groups, kind):
    shape = _shape(heads, groups, head_dim=8)
    hidden = 32
    with pytest.raises(ValueError, match="num_query_groups"):
        QKV_INTERLEAVED.to_megatron_shard((torch.zeros(heads * 8), torch.zeros(groups * 8), torch.zeros(groups * 8)), 0, 3, shape, 0)
    tail = (hidden,) if kind == "weight" else ()
    q = torch.randn(heads * 8, *tail)
    k = torch.randn(groups * 8, *tail)
    v = torch.randn(groups * 8, *tail)
    shards, back = _round_trip(QKV_INTERLEAVED, (q, k, v), shape, tp, 0)
    # ColumnParallelLinear holds an even dim-0 split of the full fused tensor.
    reference = _reference_fused_qkv(q, k, v, shape)
    for rank, shard in enumerate(shards):
        assert torch.equal(shard, reference.chunk(tp, dim=0)[rank])
    assert all(torch.equal(a, b) for a, b in zip(back, (q, k, v)))


@pytest.mark.parametrize("tp", TP_SIZES)
def test_gate_up_shards_compute_the_right_slice_of_the_mlp(tp):
    hidden, ffn = 16, 64
    gate, up = torch.randn(ffn, hidden, dtype=torch.float64), torch.randn(ffn, hidden, dtype=torch.float64)
    x = torch.randn(5, hidden, dtype=torch.float64)
    shards, back = _round_trip(GATE_UP, (gate, up), _shape(), tp, 0)
    assert torch.equal(back[0], gate) and torch.equal(back[1], up)
    full = torch.nn.functional.silu(x @ gate.T) * (x @ up.T)
    for rank, shard in enumerate(shards):
        # Megatron's SwiGLU splits the local fc1 output in two halves: [gate part, up part].
        local_gate, local_up = torch.chunk(x @ shard.T, 2, dim=-1)
        local = torch.nn.functional.silu(local_gate) * local_up
        width = ffn // tp
        assert torch.allclose(local, full[:, rank * width : (rank + 1) * width])


@pytest.mark.parametrize("tp", TP_SIZES)
def test_vocab_pad(tp):
    vocab, hidden = 300, 8
    shape = _shape(vocab=vocab, tp=tp)
    assert shape.padded_vocab_size == {1: 384, 2: 512, 4: 512}[tp]
    embedding = torch.randn(vocab, hidden)
    shards, (back,) = _round_trip(VOCAB_PAD, (embedding,), shape, tp, 0)
    assert torch.equal(back, embedding)
    full = torch.cat(shards)
    assert full.shape == (shape.padded_vocab_size, hidden)
    assert torch.equal(full[:vocab], embedding) and not full[vocab:].any()
    with pytest.raises(ValueError, match="vocab_size=300"):
        VOCAB_PAD.to_megatron_shard((torch.randn(299, hidden),), 0, tp, shape, 0)


@pytest.mark.parametrize("tp", TP_SIZES)
def test_row_parallel_split_sums_to_the_full_product(tp):
    weight = torch.randn(16, 32, dtype=torch.float64)
    x = torch.randn(3, 32, dtype=torch.float64)
    shards, (back,) = _round_trip(TP_SPLIT, (weight,), _shape(), tp, 1)
    assert torch.equal(back, weight)
    partial = sum(x.chunk(tp, dim=-1)[r] @ shards[r].T for r in range(tp))  # RowParallelLinear's all-reduce
    assert torch.allclose(partial, x @ weight.T)


def test_replicated_and_uneven_split():
    norm = torch.randn(16)
    shards, (back,) = _round_trip(REPLICATED, (norm,), _shape(), 4, None)
    assert all(torch.equal(s, norm) for s in shards) and torch.equal(back, norm)
    with pytest.raises(ValueError, match="cannot be split over 4"):
        TP_SPLIT.to_megatron_shard((torch.randn(6, 6),), 0, 4, _shape(), 1)


def test_padded_vocab_size():
    assert padded_vocab_size(151936, 1) == 151936  # Qwen2.5 is already a multiple of 128
    assert padded_vocab_size(151936, 8) == 152576
    assert padded_vocab_size(128256, 4) == 128512
    assert padded_vocab_size(300, 2) == 512


def test_map_rows_are_checked_and_named_per_spec():
    with pytest.raises(ValueError, match="takes 3 HF tensors"):
        Map(hf=("a",), megatron="b", transform=QKV_INTERLEAVED)
    with pytest.raises(ValueError, match="must appear in all names"):
        Map(hf=("model.layers.{i}.x",), megatron="decoder.final", transform=REPLICATED)
    table = mapping_for(read_hf_config({"architectures": ["Qwen3ForCausalLM"], "hidden_size": 64, "num_attention_heads": 4,
                                        "num_hidden_layers": 2, "intermediate_size": 128, "vocab_size": 300,
                                        "max_position_embeddings": 256, "head_dim": 32}))  # fmt: skip
    row = table.row_for_megatron("decoder.layers.{i}.input_layernorm.weight")
    assert row.megatron_name("local", 3) == "decoder.layers.3.input_layernorm.weight"
    assert row.megatron_name("te", 3) == "decoder.layers.3.self_attention.linear_qkv.layer_norm_weight"
    assert row.hf_names(7) == ("model.layers.7.input_layernorm.weight",)
    post = table.row_for_megatron("decoder.layers.{i}.pre_mlp_layernorm.weight")
    assert post.megatron_name("te", 0) == "decoder.layers.0.mlp.linear_fc1.layer_norm_weight"
    qkv = table.row_for_megatron("decoder.layers.{i}.self_attention.linear_qkv.weight")
    assert qkv.megatron_name("te", 1) == qkv.megatron_name("local", 1)
    assert table.row_for_megatron("decoder.layers.{i}.self_attention.q_layernorm.weight").transform is REPLICATED
    with pytest.raises(ValueError, match="unknown layer spec"):
        row.megatron_name("apex", 0)


def test_tables_cover_exactly_the_hf_checkpoints(tiny_model_dirs):
    for arch, path in tiny_model_dirs.items():
        cfg = read_hf_config(path)
        table = mapping_for(cfg)
        with HFWeightReader(path) as reader:
            assert sorted(table.hf_names(cfg.num_layers)) == reader.names(), arch
        has_output = any(r.megatron == "output_layer.weight" for r in table.rows)
        assert has_output != cfg.tie_word_embeddings
        assert table.tied_output_row().hf == ("model.embed_tokens.weight",)


def test_every_architecture_has_a_table():
    assert set(ARCH_TABLES) == {"Qwen2ForCausalLM", "LlamaForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM", "Qwen2MoeForCausalLM"}


@pytest.mark.parametrize("num_layers,pp,vpp", [(8, 1, None), (8, 2, None), (8, 2, 2), (12, 4, None), (24, 2, 3), (16, 4, 2)])
def test_layer_placement_round_trip_and_matches_layout(num_layers, pp, vpp):
    layout = ParallelLayout(pp=pp, vpp=vpp)
    seen = set()
    for layer in range(num_layers):
        stage, chunk, local = layer_location(layer, num_layers, pp, vpp)
        assert global_layer_index(stage, chunk, local, num_layers, pp, vpp) == layer
        assert layer in layout.layers_of_stage(num_layers, stage, chunk)
        seen.add((stage, chunk, local))
    assert len(seen) == num_layers


def test_layer_placement_interleaved_example():
    # Megatron's interleaved split of 8 layers over pp=2, vpp=2: stage 0 holds layers 0-1 and 4-5.
    assert [layer_location(i, 8, 2, 2) for i in range(8)] == [
        (0, 0, 0), (0, 0, 1), (1, 0, 0), (1, 0, 1), (0, 1, 0), (0, 1, 1), (1, 1, 0), (1, 1, 1),
    ]  # fmt: skip
    with pytest.raises(ValueError):
        layer_location(8, 8, 2, 2)
    with pytest.raises(ValueError, match="cannot be split evenly"):
        layer_location(0, 10, 4)


# ---------------------------------------------------------------------------------------------
# Mixture-of-experts rows
# ---------------------------------------------------------------------------------------------


def _tiny_moe_table(arch: str = "qwen3_moe"):
    from tests.support.tiny_models import tiny_moe_config

    cfg = read_hf_config(tiny_moe_config(arch).to_dict())
    return cfg, mapping_for(cfg)


def test_moe_rows_are_named_per_spec_and_expert():
    cfg, table = _tiny_moe_table()
    assert table.num_experts == 4 and len(table.expert_rows) == 2 * 4
    router = table.row_for_megatron("decoder.layers.{i}.mlp.router.weight")
    assert router.hf_names(1) == ("model.layers.1.mlp.gate.weight",)
    assert router.transform is REPLICATED and router.tp_dim is None and not router.per_expert
    assert router.megatron_name("te", 1) == router.megatron_name("local", 1) == "decoder.layers.1.mlp.router.weight"
    fc1 = table.row_for_megatron("decoder.layers.{i}.mlp.experts.local_experts.{e}.linear_fc1.weight", expert=3)
    assert fc1.per_expert and fc1.expert == 3 and fc1.transform is GATE_UP and fc1.tp_dim == 0
    assert fc1.hf_names(1) == ("model.layers.1.mlp.experts.3.gate_proj.weight", "model.layers.1.mlp.experts.3.up_proj.weight")
    # Megatron names carry the local id: by default the global one (EP=1); under EP the caller's.
    assert fc1.megatron_name("local", 0) == "decoder.layers.0.mlp.experts.local_experts.3.linear_fc1.weight"
    assert fc1.megatron_name("local", 0, local_expert=1) == "decoder.layers.0.mlp.experts.local_experts.1.linear_fc1.weight"
    assert fc1.megatron_name("te", 0, local_expert=1) == "decoder.layers.0.mlp.experts.linear_fc1.weight1"  # TEGroupedMLP
    fc2 = table.row_for_megatron("decoder.layers.{i}.mlp.experts.linear_fc2.weight{e}", expert=0)
    assert fc2.transform is TP_SPLIT and fc2.tp_dim == 1
    assert fc2.hf_names(0) == ("model.layers.0.mlp.experts.0.down_proj.weight",)
    # An MoE layer keeps its pre-MLP norm under both specs (TE fuses it into linear_fc1 only for a dense MLP).
    norm = table.row_for_megatron("decoder.layers.{i}.pre_mlp_layernorm.weight")
    assert norm.megatron_name("te", 0) == norm.megatron_name("local", 0) == "decoder.layers.0.pre_mlp_layernorm.weight"
    with pytest.raises(KeyError, match="expert 4"):
        table.row_for_megatron("decoder.layers.{i}.mlp.experts.local_experts.{e}.linear_fc1.weight", expert=4)


def test_qwen2_moe_shared_expert_rows():
    _, table = _tiny_moe_table("qwen2_moe")
    shared = table.row_for_megatron("decoder.layers.{i}.mlp.shared_experts.linear_fc1.weight")
    assert shared.hf_names(0) == ("model.layers.0.mlp.shared_expert.gate_proj.weight", "model.layers.0.mlp.shared_expert.up_proj.weight")
    assert shared.transform is GATE_UP and not shared.per_expert  # split over the dense TP group
    gate = table.row_for_megatron("decoder.layers.{i}.mlp.shared_experts.gate_weight")
    assert gate.hf_names(1) == ("model.layers.1.mlp.shared_expert_gate.weight",) and gate.transform is REPLICATED
    assert table.row_for_megatron("decoder.layers.{i}.self_attention.linear_qkv.bias").transform is QKV_INTERLEAVED


def test_expert_rows_are_expert_major_and_bound():
    _, table = _tiny_moe_table()
    layer = [r for r, layer in table.ordered(1) if r.per_expert]
    assert [(r.expert, r.megatron.rsplit(".", 2)[-2]) for r in layer] == [
        (e, fc) for e in range(4) for fc in ("linear_fc1", "linear_fc2")
    ]  # an expert's fc1 and fc2 are adjacent
    template = next(r for r in ARCH_TABLES["Qwen3MoeForCausalLM"] if r.per_expert)
    assert template.expert is None
    with pytest.raises(ValueError, match="bind it"):
        template.hf_names(0)
    with pytest.raises(ValueError, match="must be bound"):
        MappingTable("Qwen3MoeForCausalLM", ARCH_TABLES["Qwen3MoeForCausalLM"], False, 4)
    with pytest.raises(ValueError, match="need num_experts >= 1"):
        expand_experts(ARCH_TABLES["Qwen3MoeForCausalLM"], 0)
    assert expand_experts(ARCH_TABLES["Qwen3ForCausalLM"], 0) == ARCH_TABLES["Qwen3ForCausalLM"]
    with pytest.raises(ValueError, match="'{e}' must appear in all names"):
        Map(hf=("model.layers.{i}.mlp.experts.{e}.x",), megatron="decoder.layers.{i}.mlp.x", transform=REPLICATED)
    with pytest.raises(ValueError, match="'{e}' must appear in all names"):
        Map(hf=("model.layers.{i}.{e}",), megatron="decoder.layers.{i}.{e}", megatron_te="decoder.layers.{i}.x", transform=REPLICATED)
    with pytest.raises(ValueError, match="must be per layer"):
        Map(hf=("experts.{e}.x",), megatron="experts.{e}.x", transform=REPLICATED)
    with pytest.raises(ValueError, match="not per expert"):
        table.row_for_megatron("decoder.layers.{i}.mlp.router.weight").for_expert(0)


@pytest.mark.parametrize("num_experts,ep", [(4, 1), (4, 2), (4, 4), (128, 8), (60, 4)])
def test_expert_placement_round_trip(num_experts, ep):
    seen = set()
    for expert in range(num_experts):
        ep_rank, local = expert_location(expert, num_experts, ep)
        assert ep_rank == expert // (num_experts // ep)  # contiguous blocks, as Megatron's SequentialMLP
        assert global_expert_index(ep_rank, local, num_experts, ep) == expert
        seen.add((ep_rank, local))
    assert seen == {(r, e) for r in range(ep) for e in range(num_experts // ep)}
    with pytest.raises(ValueError, match="outside"):
        expert_location(num_experts, num_experts, ep)


def test_expert_placement_refuses_uneven_split():
    with pytest.raises(ValueError, match="cannot be split evenly over expert-parallel size 3"):
        expert_location(0, 4, 3)
    with pytest.raises(ValueError, match="outside"):
        global_expert_index(2, 0, 4, 2)


@pytest.mark.parametrize("tp", TP_SIZES)
def test_expert_rows_round_trip_over_expert_tp(tp):
    _, table = _tiny_moe_table()
    shape = _shape()
    g = torch.Generator().manual_seed(3)
    for row in table.expert_rows[:2]:
        hf = [torch.randn(32, 64, generator=g) for _ in row.hf] if row.transform is GATE_UP else [torch.randn(64, 32, generator=g)]
        shards = [row.to_megatron_shard(hf, r, tp, shape) for r in range(tp)]
        back = row.to_hf(shards, shape)
        assert all(torch.equal(a, b) for a, b in zip(back, hf))
        if row.transform is GATE_UP:  # each expert-TP rank holds [its gate rows; its up rows]
            assert torch.equal(shards[-1], torch.cat([hf[0].chunk(tp)[-1], hf[1].chunk(tp)[-1]]))


def test_moe_tables_cover_exactly_the_saved_checkpoints(tmp_path):
    from tests.support.tiny_models import MOE_ARCHS, save_tiny_model

    for arch in MOE_ARCHS:
        path = save_tiny_model(arch, tmp_path / arch)
        cfg = read_hf_config(path)
        with HFWeightReader(path) as reader:
            assert sorted(mapping_for(cfg).hf_names(cfg.num_layers)) == reader.names(), arch
