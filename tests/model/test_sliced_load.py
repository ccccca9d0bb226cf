"""Loading an HF checkpoint reads only each rank's part of every tensor (safetensors `get_slice`).

* In one process, for every tiny architecture, mapping row and TP rank (TP=2, and TP up to 8 for the
  vocabulary rows, where whole ranks hold only padding): the shard built from the sliced reads is
  bit-identical to the one built from whole tensors, and the bytes read are the rank's 1/TP.
* Under torchrun at TP=2 x PP=2 with real Megatron-Core: `load_hf_into_megatron` fills every
  parameter bit for bit as the whole-tensor load does, reading per rank about 1/TP of what that
  load reads (exactly 1/TP of every split tensor but the vocabulary, whose rows split 256 / 44).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from megatron_dapo.model.arch_tables import mapping_for
from megatron_dapo.model.hf_config import read_hf_config
from megatron_dapo.model.load import rank_slices, read_rank_shard
from megatron_dapo.model.mapping import ModelShape, padded_vocab_size
from tests.support.counting_reader import CountingReader
from tests.support.tiny_models import ARCHS
from tests.support.torchrun_utils import run_torchrun_function

WORKER = Path(__file__).parent / "_sliced_load_worker.py"


def _rows(cfg):
    table = mapping_for(cfg)
    rows = list(table.ordered(cfg.num_layers))
    if cfg.tie_word_embeddings:
        rows.append((table.tied_output_row(), None))  # the last pipeline stage's copy of the embedding
    return rows


@pytest.mark.parametrize("arch", ARCHS)
def test_sliced_shards_equal_whole_tensor_shards_and_read_one_tp_share(tiny_model_dirs, arch):
    cfg = read_hf_config(tiny_model_dirs[arch])
    reader = CountingReader(tiny_model_dirs[arch])
    with reader:
        for row, layer in _rows(cfg):
            names = row.hf_names(layer)
            whole = [reader.get(n) for n in names]
            full_bytes = {n: t.numel() * t.element_size() for n, t in zip(names, whole)}
            vocabulary = row.transform.name == "VOCAB_PAD"
            for tp in (1, 2, 3, 4, 8) if vocabulary else (1, 2):
                shape = ModelShape.from_hf(cfg, tp)
                per_rank_rows = padded_vocab_size(cfg.vocab_size, tp) // tp
                for tp_rank in range(tp):
                    reader.whole.clear(), reader.part.clear()
                    sliced = read_rank_shard(reader, row, names, tp_rank, tp, shape)
                    expected = row.to_megatron_shard(whole, tp_rank, tp, shape)
                    assert sliced.dtype == expected.dtype and torch.equal(sliced, expected), (row.megatron, layer, tp, tp_rank)
                    split = tp > 1 and row.tp_dim is not None
                    assert sorted(reader.part if split else reader.whole) == sorted(names)  # whole reads only when needed
                    for n in names:
                        if not split:
                            assert reader.whole[n] == full_bytes[n]
                        elif vocabulary:  # the rank's rows that exist in the checkpoint
                            real = max(0, min((tp_rank + 1) * per_rank_rows, cfg.vocab_size) - tp_rank * per_rank_rows)
                            assert reader.part[n] == real * full_bytes[n] // cfg.vocab_size
                        else:
                            assert reader.part[n] * tp == full_bytes[n], (n, tp)


def test_rank_slices_plan_from_shapes_alone():
    cfg = read_hf_config({"architectures": ["Qwen2ForCausalLM"], "hidden_size": 3584, "intermediate_size": 18944,
                          "num_hidden_layers": 28, "num_attention_heads": 28, "num_key_value_heads": 4,
                          "vocab_size": 152064, "max_position_embeddings": 32768, "tie_word_embeddings": False})  # fmt: skip
    table = mapping_for(cfg)
    shape = ModelShape.from_hf(cfg, 4)
    qkv = table.row_for_megatron("decoder.layers.{i}.self_attention.linear_qkv.weight")
    (q, k, v), part = rank_slices(qkv, [(3584, 3584), (512, 3584), (512, 3584)], 3, 4, shape)
    assert (q, k, v) == ((slice(2688, 3584),), (slice(384, 512),), (slice(384, 512),))  # query group 3 of 4
    assert (part.num_query_groups, part.num_attention_heads) == (1, 7)
    down = table.row_for_megatron("decoder.layers.{i}.mlp.linear_fc2.weight")
    assert rank_slices(down, [(3584, 18944)], 1, 4, shape)[0] == [(slice(None), slice(4736, 9472))]
    embedding = table.row_for_megatron("embedding.word_embeddings.weight")
    ((rows,),), part = rank_slices(embedding, [(152064, 3584)], 3, 4, shape)
    assert rows == slice(114048, 152064) and (part.vocab_size, part.padded_vocab_size) == (38016, 38016)
    norm = table.row_for_megatron("decoder.final_layernorm.weight")
    assert rank_slices(norm, [(3584,)], 0, 4, shape) is None and rank_slices(qkv, [], 0, 1, shape) is None
    with pytest.raises(ValueError, match="num_query_groups of size 4 cannot be split over 8"):
        rank_slices(qkv, [(3584, 3584), (512, 3584), (512, 3584)], 0, 8, ModelShape.from_hf(cfg, 8))
    with pytest.raises(ValueError, match="vocabulary tensor has 10 rows"):
        rank_slices(embedding, [(10, 3584)], 0, 4, shape)


@pytest.mark.timeout(400)
def test_tp2_pp2_load_is_bit_identical_to_whole_reads_and_reads_half(tiny_model_dirs):
    kwargs = {"model_dirs": {arch: str(path) for arch, path in tiny_model_dirs.items()}}
    result = run_torchrun_function(WORKER, "run", nproc=4, kwargs=kwargs, timeout=380)
    result.check()
    ranks = result.rank_results
    assert sorted((r["pp_rank"], r["tp_rank"]) for r in ranks) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    for arch in ARCHS:
        cfg = read_hf_config(tiny_model_dirs[arch])
        for r in ranks:
            entry = r["archs"][arch]
            assert entry["bit_identical"] and entry["sliced"]["written"] == entry["full"]["written"] == entry["params"]
            assert not entry["full"]["part"]  # the reference reads whole tensors only
        for pp_rank in (0, 1):
            pair = [r["archs"][arch] for r in ranks if r["pp_rank"] == pp_rank]
            full = pair[0]["full"]["whole"]
            assert full == pair[1]["full"]["whole"]  # both TP ranks of a stage read the same whole tensors
            split = set(pair[0]["sliced"]["part"])
            assert pair[0]["sliced"]["whole"] == pair[1]["sliced"]["whole"]  # replicated norms: whole on both
            assert split | set(pair[0]["sliced"]["whole"]) == set(full)
            for name in split:
                parts = [p["sliced"]["part"][name] for p in pair]
                assert sum(parts) == full[name], name  # the two TP ranks together read each split tensor once
                if name not in ("model.embed_tokens.weight", "lm_head.weight"):
                    assert parts[0] == parts[1], name  # ... half each
            for p in pair:  # about 1/TP of what the whole-tensor load reads
                assert p["sliced"]["total"] < 0.62 * p["full"]["total"], (arch, pp_rank, p["sliced"]["total"], p["full"]["total"])
        assert cfg.num_layers == 4
