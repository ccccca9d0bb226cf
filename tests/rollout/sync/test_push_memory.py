"""Memory of a weight push: the path between the actor's export and the engine's loader holds a bucket, not the model.

Pure and cheap: the `StorageLedger` that measures it (tests/support/storage_ledger.py: counts new
storages and the peak alive, not views, in-place results or memory-mapped files), and the
bucket-device rule (`bucketing.bucket_device`).

The real engine (one torchrun launch of 2 ranks, _push_memory_worker.py): a TP=2 actor of a Qwen2
model ~50 times the size of a bucket (and of its largest tensor) pushes its weights into vLLM's CPU
engine in every mode: spmd tp_shards and gather (the engine in the ranks' own processes), leader
gather and shared_memory (rank 0's engine, fed through /dev/shm files). With the export and vLLM's own
loader paused, what the ledger counts is what the weight path itself allocates. On a GPU every such
byte of the spmd path was a copy through pageable host memory (`iter_buckets(device="cpu")`), and
tp_shards first expanded each slice into a full-shape buffer: the whole model per rank per sync.
Now the bytes are bounded by one bucket (tp_shards: only the vocabulary rows an engine rank needs
from its neighbour), and every push still leaves the engine equal to the export bit for bit.

In the same launch, the export itself at EP=2 (a Qwen3-MoE whose experts per rank and layer are two
buckets large): it moves a rank's experts in packed buffers, a few broadcasts per layer instead of
one per expert tensor, and holds at most one bucket beyond the bucket being filled.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from megatron_dapo.model.bucketing import write_safetensors
from tests.support.storage_ledger import StorageLedger
from tests.support.tiny_models import build_random_model
from tests.support.torchrun_utils import run_torchrun_script

WORKER = Path(__file__).parent / "_push_memory_worker.py"


# --------------------------------------------------------------------------------------------------
# Pure parts
# --------------------------------------------------------------------------------------------------


def test_ledger_counts_new_storages_not_views_and_tracks_the_peak():
    base = torch.zeros(1000)  # before the ledger: not counted
    with StorageLedger() as ledger:
        view = base[10:30:2].unsqueeze(0)  # views (here a strided one): nothing new
        base.add_(1)  # in place: nothing new
        first = torch.empty(250)  # 1000 bytes
        second = base * 2  # 4000 bytes
        del first, second  # both freed: the live total drops
        third = torch.ones(100, dtype=torch.float64)  # 800 bytes
        with ledger.paused():
            hidden = torch.empty(10_000)  # not counted
        ones = list(ledger.paused_iter(torch.ones(3) for _ in range(2)))  # produced paused: not counted
        copied = view.contiguous()  # a copy of a non-contiguous view: 40 bytes
    assert ledger.allocated_bytes == 1000 + 4000 + 800 + 40 and ledger.allocations == 4
    assert ledger.peak_live_bytes == 5000  # first and second together; third came after they died
    assert dict(ledger.top_ops())["aten.mul.Tensor"] == 4000
    del hidden, ones, third, copied


def test_ledger_ignores_memory_mapped_file_writes(tmp_path):
    """The leader's bucket file is written through a memory map: the file is host memory, not an allocation."""
    fused = torch.randn(64, 32)
    tensors = [("a", fused[:, :16]), ("b", fused[:, 16:]), ("c", fused.t())]  # non-contiguous views
    with StorageLedger() as ledger:
        write_safetensors(tmp_path / "bucket.safetensors", tensors)
    assert ledger.allocated_bytes == 0, ledger.summary()
    from safetensors.torch import load_file

    loaded = load_file(str(tmp_path / "bucket.safetensors"))
    assert all(torch.equal(loaded[name], tensor) for name, tensor in tensors)


def test_bucket_device():
    """In-process engines take buckets where their parameters are (a GPU push never touches the host);
    a bucket file is written straight from each tensor's own device (the file is the one host copy)."""
    from megatron_dapo.model.bucketing import bucket_device

    cuda, cpu = torch.device("cuda", 3), torch.device("cpu")
    assert bucket_device(in_process=True, engine_device=cuda) == cuda
    assert bucket_device(in_process=True, engine_device=cpu) == cpu
    assert bucket_device(in_process=False, engine_device=cuda) is None
    assert bucket_device(in_process=False, engine_device=None) is None
    with pytest.raises(ValueError, match="in-process engine"):
        bucket_device(in_process=True, engine_device=None)


# --------------------------------------------------------------------------------------------------
# The real engine
# --------------------------------------------------------------------------------------------------


def _save_model(out_dir: Path) -> Path:
    from transformers import Qwen2Config

    config = Qwen2Config(
        hidden_size=128, num_attention_heads=4, num_key_value_heads=2, intermediate_size=256, num_hidden_layers=12,
        vocab_size=300, max_position_embeddings=128, rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=False,
        eos_token_id=2, bos_token_id=None,
    )  # fmt: skip
    config.architectures = ["Qwen2ForCausalLM"]
    build_random_model(config, seed=7).save_pretrained(out_dir)
    return out_dir


def _save_moe_model(out_dir: Path) -> Path:
    """16 experts of 48 KiB (fc1 32 + fc2 16) per layer: 384 KiB per EP rank and layer, two buckets."""
    from transformers import Qwen3MoeConfig

    config = Qwen3MoeConfig(
        hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_hidden_layers=2, vocab_size=128,
        max_position_embeddings=128, rope_theta=1000000.0, tie_word_embeddings=False, num_experts=16,
        num_experts_per_tok=2, moe_intermediate_size=64, decoder_sparse_step=1, norm_topk_prob=True,
    )  # fmt: skip
    config.architectures = ["Qwen3MoeForCausalLM"]
    build_random_model(config, seed=11).save_pretrained(out_dir)
    return out_dir


@pytest.fixture(scope="module")
def push_results(require_vllm, tmp_path_factory):
    from tests.support.ci import skip_or_fail

    if len(os.sched_getaffinity(0)) < 2:
        skip_or_fail("the push-memory test runs two ranks with one vLLM shard each and needs 2 CPUs")
    root = tmp_path_factory.mktemp("push_memory")
    dirs = {"model_dir": str(_save_model(root / "model")), "moe_dir": str(_save_moe_model(root / "moe"))}
    result = run_torchrun_script(WORKER, nproc=2, args=[json.dumps(dirs)], timeout=840)
    result.check()
    assert all(r is not None and "error" not in r for r in result.rank_results), result.tail()
    return result.rank_results


@pytest.mark.parametrize("mode", ["tp_shards", "spmd_gather", "leader_gather", "leader_shared_memory"])
def test_a_push_allocates_a_bucket_not_the_model(push_results, mode):
    for rank, r in enumerate(push_results):
        bucket = max(r["bucket_bytes"], r["largest_tensor_bytes"])  # a tensor larger than a bucket travels alone
        assert r["model_bytes"] > 40 * bucket  # a model-sized copy could not pass for a bucket
        m = r[mode]
        print(f"\n[push memory] rank {rank} {mode}: allocated {m['allocated_bytes']} B in {m['allocations']} tensors, "
              f"peak {m['peak_live_bytes']} B (bucket {bucket} B, model {r['model_bytes']} B); top {m['top_ops']}")  # fmt: skip
        assert m["allocated_bytes"] <= 2 * bucket, (rank, mode, m)
        assert m["peak_live_bytes"] <= bucket, (rank, mode, m)
        if "differ" in m:
            assert m["differ"] == [], (rank, mode, m["differ"])


def test_tp_shards_allocates_only_the_exchanged_vocabulary_rows(push_results):
    """The one thing tp_shards allocates: the rows of the vocabulary an engine rank holds and its actor
    rank does not (vLLM and Megatron pad the vocabulary differently), received from the neighbour."""
    for r in push_results:
        assert r["exchanged_rows_bytes"] > 0
        assert r["tp_shards"]["allocated_bytes"] <= r["exchanged_rows_bytes"] + 4096, r["tp_shards"]
        assert r["tp_shards"]["num_buckets"] > 40


def test_ep2_export_moves_experts_in_few_broadcasts_and_holds_a_bucket_extra(push_results):
    """At EP=2 each rank's experts of a layer cross in buffers of half a bucket: here 2 buckets of a
    rank's experts per layer make 4 broadcasts per rank and layer (one per tensor would be 3 per
    expert), every rank yields the checkpoint's tensors in the table's order, and the export holds at
    most one bucket beyond the bucket the consumer fills (a rank's experts of a layer in one buffer
    would be two buckets; all of a layer's, four)."""
    from megatron_dapo.model.expert_groups import expert_group_limit

    for rank, m in enumerate(r["moe_export"] for r in push_results):
        bucket = max(m["bucket_bytes"], m["largest_tensor_bytes"])
        print(f"\n[push memory] rank {rank} EP=2 MoE export: {m['broadcasts']} broadcasts for {m['expert_tensors']} expert "
              f"tensors, peak {m['peak_live_bytes']} B, allocated {m['allocated_bytes']} B (bucket {bucket} B, a rank's "
              f"experts of a layer {m['rank_layer_expert_bytes']} B); top {m['top_ops']}")  # fmt: skip
        assert m["differ"] == [] and m["in_table_order"], m["differ"]
        assert m["rank_layer_expert_bytes"] >= 2 * bucket  # a layer's experts in one buffer could not pass
        buffers_per_rank_and_layer = -(-m["rank_layer_expert_bytes"] // expert_group_limit(m["bucket_bytes"]))
        assert m["broadcasts"] == m["num_layers"] * 2 * buffers_per_rank_and_layer == 16, m
        assert m["expert_tensors"] == m["num_layers"] * 16 * 3
        assert m["largest_broadcast_bytes"] <= expert_group_limit(m["bucket_bytes"])
        assert m["peak_live_bytes"] <= 2 * bucket, m


def test_placed_slice_serves_the_loaders_narrow_and_refuses_anything_else():
    """vLLM's loaders narrow the full tensor to their rank's rows; a PlacedSlice answers that from the
    slice alone (a view: nothing copied, no full-shape buffer) and refuses what would need the rest."""
    from megatron_dapo.rollout.sync.tp_shards import PlacedSlice

    piece = torch.arange(12.0).view(3, 4)
    with StorageLedger() as ledger:
        placed = PlacedSlice(piece, 0, 3, (8, 4))  # rows 3..6 of an 8 x 4 tensor
        assert placed.shape == (8, 4) and placed.numel() == 32 and placed.dtype == piece.dtype
        assert placed.narrow(0, 3, 3).data_ptr() == piece.data_ptr()  # the loader's cut: the slice itself
        assert torch.equal(placed[4:6], piece[1:3]) and placed.narrow(0, 6, 0).shape == (0, 4)
        columns = placed.detach()[:, 1:3]  # another dimension: still placed
        assert isinstance(columns, PlacedSlice) and columns.shape == (8, 2)
        assert torch.equal(columns.narrow(0, 3, 3), piece[:, 1:3])
    assert ledger.allocated_bytes == 0
    with pytest.raises(NotImplementedError, match=r"slice \[2:5:1\] of dim 0 .* holds only \[3:6\]"):
        placed.narrow(0, 2, 3)  # another rank's rows
    with pytest.raises(NotImplementedError, match="must only narrow it"):
        placed.sum()
    converted = placed.to(torch.float64)  # (a bucket moved to the engine's device): only the slice is copied
    assert isinstance(converted, PlacedSlice) and converted.dtype == torch.float64 and converted.shape == (8, 4)
    assert torch.equal(converted.narrow(0, 3, 3), piece.double())
    with pytest.raises(ValueError, match="cannot sit at 6"):
        PlacedSlice(piece, 0, 6, (8, 4))


def test_placed_slice_takes_vllms_expert_stacking():
    """vLLM's expert loader stacks one expert (`unsqueeze(0)`) and takes the stack apart (`unbind()`)
    before its weight loader narrows the expert to the rank's rows: still placed, nothing copied."""
    from megatron_dapo.rollout.sync.tp_shards import PlacedSlice

    piece = torch.arange(12.0).view(3, 4)
    with StorageLedger() as ledger:
        placed = PlacedSlice(piece, 0, 3, (8, 4))
        stacked = placed.unsqueeze(0)
        assert isinstance(stacked, PlacedSlice) and stacked.shape == (1, 8, 4)
        (expert,) = stacked.unbind()
        assert isinstance(expert, PlacedSlice) and expert.shape == (8, 4)
        assert expert.narrow(0, 3, 3).data_ptr() == piece.data_ptr() and torch.equal(expert[4:6], piece[1:3])
        columns = placed.unsqueeze(-1)  # a dimension after the placed one
        assert columns.shape == (8, 4, 1) and torch.equal(columns.narrow(0, 3, 3), piece[:, :, None])
    assert ledger.allocated_bytes == 0
    with pytest.raises(NotImplementedError, match="unbind along dim 0, the dimension a PlacedSlice holds only part of"):
        placed.unbind(0)
