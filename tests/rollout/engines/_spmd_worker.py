"""Worker of test_spmd_vllm.py: a TP=2 actor feeding a TP=2 SPMD vLLM engine (run under torchrun, 2 ranks).

Per model (untied, then tied; both with a vocabulary whose Megatron and vLLM split points differ):

1. every rank builds the Megatron actor (TP=2) from the HF checkpoint and scales its weights; every
   rank builds its SPMD engine with the trainer's default (`RolloutGroup.create`'s path:
   `make_engine(..., placement="spmd")`): vLLM's dummy weights, no checkpoint read (its weight file
   is hidden while the engines start), so the engine is stale everywhere; and records what vLLM's
   in-process start left of the process-wide state (threads, thread setter, RNG, environment);
2. sync through `RolloutGroup.sync_weights` in mode "auto" (-> "tp_shards": each rank loads its own
   slices into its own engine); the engine's tensors, read back through the kernels and gathered
   over the TP group, must equal the actor's HF export (the gather path) bit for bit;
3. generation: both ranks generate together; rank 0 gets the output, rank 1 None; both ranks'
   engine outputs are identical; the actor's log-probs of the responses match the engine's;
4. scale again and sync in mode "gather" (every rank loads full tensors): bit-exact again;
5. after shutting the SPMD engine down, rank 0 starts a leader-placement engine (vLLM workers in
   their own processes, TP=2) on the same weights and generates with the same seed, for comparison.

Results (JSON) come back through `write_rank_result`; assertions live in test_spmd_vllm.py.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import torch

from tests.support.torchrun_utils import reporting

PROMPTS = [[17, 3, 250, 41, 99, 8, 120], [5, 6], [200, 201, 202, 13, 77, 31, 64, 2, 9], [66, 67, 68]]
SAMPLES_PER_PROMPT = 2
MAX_NEW_TOKENS = 8


def _engine_kwargs() -> dict:
    # float32 like the actor (bit-exact comparison); small KV cache on CPU.
    return dict(dtype="float32", max_model_len=128, enforce_eager=True, kv_cache_memory_bytes=32 << 20, weight_bucket_mb=0.05)


def _compare(engine, expected: dict) -> dict:
    state = dict(engine.named_weights())
    differ = [n for n, t in expected.items() if n in state and not (state[n].dtype == t.dtype and state[n].shape == t.shape and torch.equal(state[n], t))]
    return {"missing": sorted(set(expected) - set(state)), "differ": differ, "compared": len(expected)}


def _generation(out) -> dict:
    return {"prompt_index": out.prompt_index, "responses": out.response_ids, "log_probs": [lp.tolist() for lp in out.log_probs]}


def _process_state() -> dict:
    return {
        "threads": torch.get_num_threads(),
        "set_num_threads": f"{torch.set_num_threads.__module__}.{torch.set_num_threads.__qualname__}",
        "rng": torch.get_rng_state().sum().item(),
        "env": {k: os.environ.get(k) for k in ("LOCAL_WORLD_SIZE", "LD_PRELOAD", "VLLM_ENABLE_V1_MULTIPROCESSING", "RANK", "LOCAL_RANK")},
    }


def run_model(model_dir: str, index: int) -> dict:
    import torch.distributed as dist

    from megatron_dapo.actor import PolicyBatch, build_actor
    from megatron_dapo.config import Config
    from megatron_dapo.distributed import ParallelLayout, init_distributed, teardown
    from megatron_dapo.model.builder import build_gpt_models
    from megatron_dapo.model.hf_config import read_hf_config
    from megatron_dapo.model.load import export_megatron_to_hf, load_hf_into_megatron
    from megatron_dapo.rollout.base import SamplingParams
    from megatron_dapo.rollout.group import RolloutGroup
    from megatron_dapo.algorithm.mismatch import log_prob_mismatch
    from megatron_dapo.distributed.placement import SpmdSlot
    from megatron_dapo.rollout.engines.vllm.engine import VLLMEngine

    result: dict = {}
    ctx = init_distributed(ParallelLayout(tp=2, pp=1), timeout_s=300, seed=11)
    hf_cfg = read_hf_config(model_dir)
    models = build_gpt_models(hf_cfg, ctx.layout, torch.float32, transformer_engine="off", init_weights=False)
    load_hf_into_megatron(models, model_dir, hf_cfg)
    cfg = Config()
    cfg.trainer.micro_batch_size = 4
    actor = build_actor(cfg, models, vocab_size=hf_cfg.vocab_size)
    gpt = actor.gpt_models
    with torch.no_grad():
        for model in gpt:
            for param in model.parameters():
                param.mul_(1.0 + 2.0**-5)

    before = _process_state()
    # The trainer pushes before it generates: the engine must start without reading the weights.
    weights, hidden = Path(model_dir) / "model.safetensors", Path(model_dir) / "model.safetensors.hidden"
    dist.barrier()
    if dist.get_rank() == 0:
        weights.rename(hidden)
    dist.barrier()
    try:
        started = time.perf_counter()
        engine = VLLMEngine(model_dir, tensor_parallel_size=2, placement="spmd", **_engine_kwargs())
        result["engine_start_seconds"] = time.perf_counter() - started
    finally:
        dist.barrier()
        if dist.get_rank() == 0:
            hidden.rename(weights)
    result["loads_checkpoint"] = engine.loads_checkpoint
    result["vllm_load_format"] = str(engine._llm.llm_engine.vllm_config.load_config.load_format)
    result["process_state"] = {"before": before, "after": _process_state()}
    rollout = RolloutGroup(engine, sync_mode="auto", engine_kind="vllm", spmd=SpmdSlot(dist.get_rank(), dist.get_world_size(), 2))
    try:
        result["engine_tp_ranks"] = engine.tensor_parallel_ranks()
        expected = {name: tensor.clone() for name, tensor in export_megatron_to_hf(gpt, hf_cfg)}
        result["stale_before"] = len(_compare(engine, expected)["differ"])
        stats = rollout.sync_weights(gpt, hf_cfg, bucket_mb=0.05)
        result["sync_mode"] = rollout.sync_mode
        result["sync"] = {"bytes": stats.bytes, "buckets": stats.num_buckets, "seconds": stats.seconds,
                          "full_bytes": sum(t.numel() * t.element_size() for t in expected.values())}  # fmt: skip
        result["exchanged_vocab"] = rollout.transport.target.exchanged_vocab
        result["vocab_rows"] = {k: list(v) for k, v in engine.vocab_rows().items()}
        result["after_tp_shards"] = _compare(engine, expected)

        params = SamplingParams(n=SAMPLES_PER_PROMPT, temperature=1.0, max_new_tokens=MAX_NEW_TOKENS, seed=5 + index)
        handed_on = rollout.generate(PROMPTS, params)
        result["hands_on"] = handed_on is not None
        generated = engine.generate(PROMPTS, params)  # the same call again, on this rank's engine
        result["generation"] = _generation(generated)
        result["repeat_equal"] = handed_on is None or _generation(handed_on) == result["generation"]
        after = _process_state()
        result["process_state"]["after_generate"] = {k: v for k, v in after.items() if k != "rng"}  # sampling uses seeded generators
        batch = PolicyBatch.from_token_lists([PROMPTS[i] for i in generated.prompt_index], generated.response_ids)
        trainer = actor.compute_log_probs(batch)
        engine_lp = torch.zeros_like(trainer)
        for row, values in enumerate(generated.log_probs):
            engine_lp[row, : len(values)] = values
        stats = log_prob_mismatch(engine_lp, trainer, batch.response_valid_mask())
        result["mismatch"] = {"mean_abs": stats.mean_abs_diff, "max_abs": stats.max_abs_diff}

        with torch.no_grad():
            for model in gpt:
                for param in model.parameters():
                    param.mul_(1.0 - 2.0**-6)
        expected = {name: tensor.clone() for name, tensor in export_megatron_to_hf(gpt, hf_cfg)}
        gather = RolloutGroup(engine, sync_mode="gather", engine_kind="vllm", spmd=SpmdSlot(dist.get_rank(), dist.get_world_size(), 2))
        gather.sync_weights(gpt, hf_cfg, bucket_mb=0.05)
        result["gather_sync_mode"] = gather.sync_mode
        result["after_gather"] = _compare(engine, expected)
        result["spmd_generation_final"] = _generation(engine.generate(PROMPTS, params))
        final_weights = expected
    finally:
        rollout.shutdown()

    # 5: the leader placement on the same weights (rank 0 only; vLLM's workers in their own processes).
    if dist.get_rank() == 0:
        leader = VLLMEngine(model_dir, tensor_parallel_size=2, placement="leader", **_engine_kwargs())
        try:
            leader.load_weights(final_weights.items())
            result["leader_generation"] = _generation(leader.generate(PROMPTS, params))
        finally:
            leader.shutdown()
    dist.barrier()
    teardown(keep_process_group=True)
    return result


def main(model_dirs: list) -> None:
    out: dict = {"models": []}
    with reporting(out):
        for index, model_dir in enumerate(model_dirs):
            out["models"].append(run_model(model_dir, index))


if __name__ == "__main__":
    main(**json.loads(sys.argv[1]))
