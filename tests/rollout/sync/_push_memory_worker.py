"""Worker of test_push_memory.py: what a weight push allocates between the actor's export and vLLM's loader.

Two ranks, a TP=2 actor of a Qwen2 model many times larger than a bucket. Each push runs under
`weight_path_ledger` (tests/support/storage_ledger.py): the export stream and the engine's own loading (vLLM's loaders,
layer-wise reload and commit) paused, so the ledger counts exactly what the weight path between
them allocates: bucket copies, full-shape buffers, staging. Pushes:

1. spmd placement, TP=2 engine in the ranks' own processes, mode tp_shards (each rank its slices);
2. the same engine, mode gather (full tensors, every rank);
3. leader placement: rank 0's engine (one vLLM worker process), mode gather (bucket files in /dev/shm)
   and mode shared_memory (each TP rank writes its slices into the file).

After every push the engine's weights must equal the actor's HF export bit for bit (the path that
allocates nothing must still deliver).

Then, in the same launch, the export itself at EP=2 (`_moe_export`): a Qwen3-MoE whose experts per
rank and layer are several buckets large, exported through `gather.iter_weight_buckets` with a small
bucket under a ledger that pauses nothing, each bucket dropped once read. The experts cross the EP
group packed (`model.expert_groups`); what the export and the bucket hold together is measured, the
broadcasts are counted, and every tensor is compared with the saved checkpoint in the table's order.
Results (JSON) come back through `write_rank_result`.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from tests.support.torchrun_utils import reporting

BUCKET_MB = 0.05
MOE_BUCKET_MB = 192 / 1024  # two experts' tensors of the MoE test model (48 KiB each): buffers of one bucket's half


def _engine_kwargs() -> dict:
    return dict(dtype="float32", max_model_len=64, enforce_eager=True, kv_cache_memory_bytes=16 << 20, weight_bucket_mb=BUCKET_MB)


def _scale(models, factor: float) -> None:
    with torch.no_grad():
        for model in models:
            for param in model.parameters():
                param.mul_(factor)


def _differ(engine, expected: dict) -> list[str]:
    state = dict(engine.named_weights())
    return sorted(n for n, t in expected.items() if n not in state or not torch.equal(state[n], t))


def _measured(push) -> tuple[dict, object]:
    """Run `push` under a ledger with the export and the engine's own loading paused."""
    from tests.support.storage_ledger import weight_path_ledger

    with weight_path_ledger() as ledger:
        stats = push()
    return ledger.summary(), stats


def _moe_export(moe_dir: str) -> dict:
    """The EP=2 export of the MoE at `moe_dir` through buckets of MOE_BUCKET_MB (see the module doc)."""
    import torch.distributed as dist
    from safetensors.torch import load_file

    from megatron_dapo.distributed import ParallelLayout, init_distributed, teardown
    from megatron_dapo.model.arch_tables import mapping_for
    from megatron_dapo.model.builder import build_gpt_models
    from megatron_dapo.model.hf_config import read_hf_config
    from megatron_dapo.model.load import load_hf_into_megatron
    from megatron_dapo.rollout.sync.gather import iter_weight_buckets
    from tests.support.storage_ledger import StorageLedger

    teardown(keep_process_group=True)
    ctx = init_distributed(ParallelLayout(ep=2), timeout_s=300, seed=3)
    cfg = read_hf_config(moe_dir)
    models = build_gpt_models(cfg, ctx.layout, torch.float32, transformer_engine="off", init_weights=False,
                              moe_token_dispatcher="alltoall")  # fmt: skip
    load_hf_into_megatron(models, moe_dir, cfg)
    saved = {}
    for file in sorted(Path(moe_dir).glob("*.safetensors")):
        saved.update(load_file(str(file)))

    broadcast, broadcasts = dist.broadcast, []

    def counted_broadcast(tensor, *args, **kwargs):  # the real broadcast, counted
        broadcasts.append(tensor.numel() * tensor.element_size())
        return broadcast(tensor, *args, **kwargs)

    names, differ = [], []
    dist.broadcast = counted_broadcast
    try:
        with StorageLedger() as ledger:
            for bucket in iter_weight_buckets(models, cfg, bucket_mb=MOE_BUCKET_MB):
                with ledger.paused():
                    for name, tensor in bucket:
                        names.append(name)
                        if name not in saved or not torch.equal(tensor, saved[name]):
                            differ.append(name)
                del bucket, name, tensor  # read: the consumer lets it go before the next one is filled
    finally:
        dist.broadcast = broadcast
    per_expert_tensors = [n for n in names if ".mlp.experts." in n]
    return {
        **ledger.summary(),
        "bucket_bytes": int(MOE_BUCKET_MB * 2**20),
        "largest_tensor_bytes": max(t.numel() * t.element_size() for t in saved.values()),
        "rank_layer_expert_bytes": sum(saved[n].nbytes for n in per_expert_tensors if ".layers.0." in n) // 2,
        "num_layers": cfg.num_layers,
        "expert_tensors": len(per_expert_tensors),
        "broadcasts": len(broadcasts),
        "largest_broadcast_bytes": max(broadcasts, default=0),
        "in_table_order": names == mapping_for(cfg).hf_names(cfg.num_layers),
        "differ": differ,
    }


def main(model_dir: str, moe_dir: str) -> None:
    import torch.distributed as dist

    from megatron_dapo.distributed import ParallelLayout, init_distributed
    from megatron_dapo.model.builder import build_gpt_models
    from megatron_dapo.model.hf_config import read_hf_config
    from megatron_dapo.model.load import export_megatron_to_hf, load_hf_into_megatron
    from megatron_dapo.rollout.group import RolloutGroup
    from megatron_dapo.distributed.placement import SpmdSlot
    from megatron_dapo.rollout.engines.vllm.engine import VLLMEngine

    out: dict = {}
    with reporting(out):
        ctx = init_distributed(ParallelLayout(tp=2, pp=1), timeout_s=300, seed=3)
        hf_cfg = read_hf_config(model_dir)
        models = build_gpt_models(hf_cfg, ctx.layout, torch.float32, transformer_engine="off", init_weights=False)
        load_hf_into_megatron(models, model_dir, hf_cfg)

        def expected_weights() -> dict:
            return {name: tensor.clone() for name, tensor in export_megatron_to_hf(models, hf_cfg)}

        _scale(models, 1.0 + 2.0**-5)
        expected = expected_weights()
        out["model_bytes"] = sum(t.numel() * t.element_size() for t in expected.values())
        out["largest_tensor_bytes"] = max(t.numel() * t.element_size() for t in expected.values())
        out["bucket_bytes"] = int(BUCKET_MB * 2**20)
        slot = SpmdSlot(dist.get_rank(), dist.get_world_size(), 2)

        engine = VLLMEngine(model_dir, tensor_parallel_size=2, placement="spmd", **_engine_kwargs())
        try:
            rollout = RolloutGroup(engine, sync_mode="tp_shards", engine_kind="vllm", spmd=slot)
            out["tp_shards"], stats = _measured(lambda: rollout.sync_weights(models, hf_cfg, bucket_mb=BUCKET_MB))
            out["tp_shards"]["num_buckets"] = stats.num_buckets
            out["tp_shards"]["differ"] = _differ(engine, expected)
            target = rollout.transport.target
            row_bytes = hf_cfg.hidden_size * 4
            out["exchanged_rows_bytes"] = sum(
                (end - first) * row_bytes for name, (first, end) in target.vocab_rows.items() if target.exchanged_vocab.get(name)
            )

            _scale(models, 1.0 - 2.0**-6)
            expected = expected_weights()
            gather = RolloutGroup(engine, sync_mode="gather", engine_kind="vllm", spmd=slot)
            out["spmd_gather"], _ = _measured(lambda: gather.sync_weights(models, hf_cfg, bucket_mb=BUCKET_MB))
            out["spmd_gather"]["differ"] = _differ(engine, expected)
        finally:
            engine.shutdown()

        leader = VLLMEngine(model_dir, tensor_parallel_size=1, placement="leader", **_engine_kwargs()) if dist.get_rank() == 0 else None
        try:
            for mode in ("gather", "shared_memory"):
                _scale(models, 1.0 + 2.0**-7)
                expected = expected_weights()
                group = RolloutGroup(leader, sync_mode=mode, engine_kind="vllm")
                out[f"leader_{mode}"], _ = _measured(lambda: group.sync_weights(models, hf_cfg, bucket_mb=BUCKET_MB))
                group.close_weight_sync()
                if leader is not None:
                    out[f"leader_{mode}"]["differ"] = _differ(leader, expected)
        finally:
            if leader is not None:
                leader.shutdown()
        dist.barrier()
        out["moe_export"] = _moe_export(moe_dir)


if __name__ == "__main__":
    main(**json.loads(sys.argv[1]))
