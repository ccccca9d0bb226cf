"""TP shards -> engine through a shared bucket file in /dev/shm (`rollout.shard_handover`), no gather.

One process: every rank's slices (from the architecture tables' own Megatron shards, at TP 2 and 4,
vocabulary padding included) written into one bucket file in any rank order read back as exactly
the full HF tensors; the choice between gather and shared memory. Two gloo processes: the
collective hand-over into an engine on rank 0, including a load that fails on the owner and a
/dev/shm that is full on another rank (every rank must raise, no file may stay behind). The real Megatron actor -> embedded / vLLM engines
(bit-exact tensors, log-prob mismatch, 100 update rounds) run in test_weight_sync.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from megatron_dapo.model.arch_tables import ARCH_TABLES
from megatron_dapo.model.mapping import MappingTable, ModelShape, expand_experts, padded_vocab_size
from megatron_dapo.rollout.group import choose_sync_mode
from megatron_dapo.rollout.sync.shared_memory import iter_safetensors, write_shards_into_bucket_file
from megatron_dapo.rollout.sync.dispatch import bucket_stream, engine_shards
from shard_shapes import SHARD_SHAPE, hf_tensor
from torchrun_utils import run_torchrun_function

WORKER = Path(__file__).parent / "_handover_worker.py"
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
    from megatron_dapo.rollout.sync.dispatch import EngineShard

    full = torch.randn(4, 3) + 10
    path = tmp_path / "b.safetensors"
    write_shards_into_bucket_file(path, [EngineShard("w", full[:2].clone(), 0, 0, 4)], 0)
    (name, tensor), = list(iter_safetensors(path))
    assert torch.equal(tensor[:2], full[:2]) and torch.equal(tensor[2:], torch.zeros(2, 3))


def test_sync_mode_choice():
    one, two = ["node1", "node1"], ["node1", "node2"]
    assert choose_sync_mode("auto", 2, one, "vllm", "cuda") == "shared_memory"
    assert choose_sync_mode("auto", 2, one, "embedded", "cpu") == "shared_memory"
    assert choose_sync_mode("auto", 2, one, "embedded", "cuda") == "gather"  # NCCL gather lands on the GPU
    assert choose_sync_mode("auto", 1, ["node1"], "vllm", "cpu") == "gather"  # nothing to gather at TP=1
    assert choose_sync_mode("auto", 2, two, "vllm", "cuda") == "gather"
    assert choose_sync_mode("gather", 2, one, "vllm", "cpu") == "gather"
    assert choose_sync_mode("shared_memory", 1, ["node1"], "embedded", "cpu") == "shared_memory"
    with pytest.raises(ValueError, match="one node"):
        choose_sync_mode("shared_memory", 2, two, "vllm", "cuda")
    with pytest.raises(ValueError, match="weight_sync_mode"):
        choose_sync_mode("nccl", 2, one, "vllm", "cuda")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_two_ranks_hand_their_slices_to_the_engine(dtype):
    result = run_torchrun_function(WORKER, "main", nproc=2, kwargs={"dtype": dtype}, timeout=120)
    result.check()
    owner, other = result.rank_results
    assert owner["error"] is None and other["error"] is None
    assert owner["equal"] == {"q_proj.weight": True, "o_proj.weight": True, "norm.weight": True, "embed_tokens.weight": True}
    assert owner["commits"] == 1
    assert owner["files_left"] == [] and owner["directory"] == other["directory"]
    assert owner["directory_removed"]


def test_a_failed_load_fails_every_rank_and_leaves_no_file():
    result = run_torchrun_function(WORKER, "main", nproc=2, kwargs={"fail_on": "o_proj.weight"}, timeout=120)
    result.check()
    for rank_result in result.rank_results:
        assert "could not load a weight bucket" in rank_result["error"] and "o_proj.weight" in rank_result["error"]
        assert rank_result["files_left"] == []


def test_full_shared_memory_on_one_rank_fails_every_rank_with_what_to_change():
    """ENOSPC while reserving the bucket (docker's default 64 MB /dev/shm) is an error on every rank, not a SIGBUS or a hang."""
    result = run_torchrun_function(WORKER, "main", nproc=2, kwargs={"full_shm_on_rank": 1}, timeout=120)
    result.check()
    for rank_result in result.rank_results:
        error = rank_result["error"]
        assert "could not write a weight bucket to shared memory: TP rank 1" in error, error
        assert "rollout.weight_sync_bucket_mb" in error and "--shm-size" in error and "weight_sync_mode=gather" in error
        assert rank_result["files_left"] == []
