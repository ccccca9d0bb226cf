"""Worker for the weight-sync tests (run through tests/support/torchrun_utils.py, not collected by pytest).

`run_layouts` runs in one launch of 4 processes and goes through several actor layouts (TP / PP /
VPP; the remaining ranks are data-parallel replicas). One rollout engine lives on rank 0 for the
whole launch; the other ranks own none but take part in every collective. Per layout:

1. build the Megatron actor from the tiny HF checkpoint and scale its weights by a layout-specific
   factor, so that the engine (holding the checkpoint or the previous layout) is stale everywhere;
2. sync with small buckets through `RolloutGroup.sync_weights` (the trainer's path) in the layout's
   `sync_mode` ("gather", or "shared_memory": each TP rank hands its own slices over through
   /dev/shm); the engine's tensors must equal the actor's HF export bit for bit (and every one must
   have been stale before);
3. every rank checks its TP-shard stream (`iter_weight_shard_buckets`) against the export;
4. the engine samples responses; the actor's forward-only log-probs of them are compared with the
   engine's (the training / inference mismatch);
5. one real `actor.update` on those responses, sync, bit equality again, mismatch again;
6. `rounds` cheap update + sync rounds (in buckets of `rounds_bucket_mb`): every parameter is multiplied in place by a factor that
   changes every round, and an HF-named mirror on rank 0 is multiplied by the same factor (elementwise
   float32 products are bitwise the same on shards and on full tensors, so the mirror is an
   independent reference, not the export). After each sync the engine's per-tensor checksums must
   equal the mirror's, and every tensor's checksum must differ from the previous round's.

Results (JSON) come back through `write_rank_result`; the assertions live in test_weight_sync.py.
Run as a script (`python _sync_worker.py '{"model_dir": ..., "layouts": [...]}'` under torchrun):
vLLM starts its engine core with the spawn method, which re-imports the main module, so the entry
point must sit behind a `__main__` guard.
"""

from __future__ import annotations

import hashlib
import json
import sys
import time
import traceback
import weakref

import torch

NUM_PROMPTS = 4
RESPONSES_PER_PROMPT = 2
MAX_NEW_TOKENS = 10
TEMPERATURE = 0.8


# ---------------------------------------------------------------------------------------------
# Helpers
# ---------------------------------------------------------------------------------------------


def digest(tensor: torch.Tensor) -> str:
    """A checksum of a tensor's exact bytes (dtype and shape included)."""
    data = tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()
    h = hashlib.blake2b(data, digest_size=16)
    h.update(f"{tensor.dtype}{tuple(tensor.shape)}".encode())
    return h.hexdigest()


def scale_parameters(models, factor: float) -> None:
    """Multiply every parameter of this rank's chunks in place (tied copies stay bitwise equal)."""
    with torch.no_grad():
        for model in models:
            for param in model.parameters():
                param.mul_(factor)


def round_factor(round_index: int) -> float:
    """1 +- 2^-8, alternating: every nonzero float32 changes, values stay bounded over many rounds."""
    return 1.0 + (2.0**-8 if round_index % 2 == 0 else -(2.0**-8))


def export_clone(models, hf_cfg) -> dict[str, torch.Tensor]:
    from megatron_dapo.model.load import export_megatron_to_hf

    return {name: tensor.clone() for name, tensor in export_megatron_to_hf(models, hf_cfg)}


def make_engine(kind: str, model_dir: str, engine_tp: int = 1):
    if kind == "embedded":
        from megatron_dapo.rollout.engines.embedded import EmbeddedEngine

        return EmbeddedEngine(model_dir, dtype=torch.float32, device="cpu")
    if kind == "vllm":
        from megatron_dapo.rollout.engines.vllm.engine import VLLMEngine

        # float32 like the actor, so that weights compare bit for bit; a small KV cache (CPU RAM).
        return VLLMEngine(model_dir, tensor_parallel_size=engine_tp, dtype="float32", max_model_len=256, kv_cache_memory_bytes=64 << 20)
    raise ValueError(kind)


def engine_state(engine) -> dict[str, torch.Tensor]:
    return {name: tensor for name, tensor in engine.named_weights()}


def compare_engine(engine, expected: dict[str, torch.Tensor]) -> dict:
    """Bit equality of the engine's tensors with `expected`: names, differing tensors, max |diff|."""
    state = engine_state(engine)
    differ = []
    max_diff = 0.0
    for name, want in expected.items():
        have = state.get(name)
        if have is None:
            continue
        have = have.detach().cpu()
        if have.dtype != want.dtype or have.shape != want.shape or not torch.equal(have, want):
            differ.append(name)
            if have.shape == want.shape:
                max_diff = max(max_diff, float((have.double() - want.double()).abs().max()))
    return {
        "missing": sorted(set(expected) - set(state)),
        "extra": sorted(set(state) - set(expected)),
        "differ": differ,
        "max_abs_diff": max_diff,
        "num_compared": len(expected),
    }


def make_prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(7)
    return [torch.randint(0, 300, (int(torch.randint(3, 9, (1,), generator=g)),), generator=g).tolist() for _ in range(NUM_PROMPTS)]


def sample_and_compare(engine, actor, prompts, seed: int) -> dict:
    """Rank 0's engine samples; every rank scores the responses with the actor; rank 0 compares."""
    import torch.distributed as dist

    from megatron_dapo.actor import PolicyBatch
    from megatron_dapo.rollout.base import SamplingParams
    from megatron_dapo.algorithm.mismatch import log_prob_mismatch

    payload = [None]
    if engine is not None:
        params = SamplingParams(n=RESPONSES_PER_PROMPT, temperature=TEMPERATURE, max_new_tokens=MAX_NEW_TOKENS, seed=seed)
        out = engine.generate(prompts, params)
        payload = [{"prompt_index": out.prompt_index, "responses": out.response_ids, "log_probs": [lp.tolist() for lp in out.log_probs]}]
    dist.broadcast_object_list(payload, src=0)
    gen = payload[0]
    batch = PolicyBatch.from_token_lists([prompts[i] for i in gen["prompt_index"]], gen["responses"])
    trainer = actor.compute_log_probs(batch)
    rollout = torch.zeros_like(trainer)
    for row, values in enumerate(gen["log_probs"]):
        rollout[row, : len(values)] = torch.tensor(values)
    stats = log_prob_mismatch(rollout, trainer, batch.response_valid_mask())
    return batch, trainer, {"mean_abs": stats.mean_abs_diff, "max_abs": stats.max_abs_diff, "k3": stats.k3_kl, "tokens": stats.num_tokens}


def check_shard_stream(models, hf_cfg, expected: dict[str, torch.Tensor], bucket_mb: float) -> dict:
    """This rank's TP-shard stream against narrow() of the full export."""
    from megatron.core import parallel_state as ps

    from megatron_dapo.rollout.sync.shards import iter_weight_shard_buckets

    bad, names = [], []
    covered: dict[str, int] = {}
    for bucket in iter_weight_shard_buckets(models, hf_cfg, bucket_mb):
        for shard in bucket:
            names.append(shard.name)
            full = expected[shard.name]
            if shard.dim is None:
                ok = torch.equal(shard.tensor, full)
            else:
                ok = shard.full_shape == tuple(full.shape) and torch.equal(
                    full.narrow(shard.dim, shard.start, shard.tensor.shape[shard.dim]), shard.tensor
                )
            if not ok:
                bad.append(shard.name)
            covered[shard.name] = shard.tensor.numel()
    return {
        "tp_rank": ps.get_tensor_model_parallel_rank(),
        "bad": bad,
        "names_in_order": names == list(expected),
        "elements": sum(covered.values()),
    }


def bucket_liveness(models, hf_cfg, bucket_mb: float) -> dict:
    """Consume the bucket stream as an engine would and track how many yielded bytes are still alive.

    Weak references to every yielded tensor: if the stream (or the export under it) kept earlier
    buckets alive, the live bytes would grow towards the whole model.
    """
    import gc

    from megatron_dapo.rollout.sync.gather import iter_weight_buckets

    refs: list = []
    peak_live = peak_bucket = total = 0
    for bucket in iter_weight_buckets(models, hf_cfg, bucket_mb):
        gc.collect()
        for name, tensor in bucket:
            refs.append((weakref.ref(tensor), tensor.numel() * tensor.element_size()))
        live = sum(size for ref, size in refs if ref() is not None)
        size = sum(t.numel() * t.element_size() for _, t in bucket)
        peak_live, peak_bucket, total = max(peak_live, live), max(peak_bucket, size), total + size
        del bucket, tensor
    return {"peak_live_bytes": peak_live, "peak_bucket_bytes": peak_bucket, "total_bytes": total}


# ---------------------------------------------------------------------------------------------
# Entry point
# ---------------------------------------------------------------------------------------------


def _config(layout_spec: dict):
    from megatron_dapo.config import Config

    cfg = Config()
    cfg.optimizer.lr = 1e-3
    cfg.optimizer.warmup_steps = 0
    cfg.rollout.temperature = TEMPERATURE
    cfg.trainer.micro_batch_size = 4
    cfg.parallel.use_distributed_optimizer = bool(layout_spec.get("dist_opt", True))
    return cfg


def run_layouts(
    model_dir: str, layouts: list, engine_kind: str = "embedded", bucket_mb: float = 0.03, engine_tp: int = 1, rounds_bucket_mb: float = 0.25
) -> None:
    import torch.distributed as dist

    from megatron_dapo.actor import build_actor
    from megatron_dapo.distributed import ParallelLayout, init_distributed, teardown
    from megatron_dapo.model.builder import build_gpt_models
    from megatron_dapo.model.hf_config import read_hf_config
    from megatron_dapo.model.load import load_hf_into_megatron
    from megatron_dapo.rollout.group import RolloutGroup

    out: dict = {"layouts": {}}
    ctx = None
    engine = None
    try:
        hf_cfg = read_hf_config(model_dir)
        prompts = make_prompts()
        for index, spec in enumerate(layouts):
            if ctx is not None:
                teardown(keep_process_group=True)
            ctx = init_distributed(ParallelLayout(tp=spec["tp"], pp=spec["pp"], vpp=spec.get("vpp")), timeout_s=300, seed=11)
            if engine is None and ctx.rank == 0:
                started = time.perf_counter()
                engine = make_engine(engine_kind, model_dir, engine_tp)
                out["engine_start_seconds"] = time.perf_counter() - started
            result: dict = {}
            started = time.perf_counter()
            # The trainer's sync path; rank 0 (TP 0, PP 0 of replica 0) holds the only engine.
            rollout = RolloutGroup(engine, sync_mode=spec.get("sync_mode", "gather"), engine_kind=engine_kind)
            models = build_gpt_models(hf_cfg, ctx.layout, torch.float32, transformer_engine="off", init_weights=False)
            load_hf_into_megatron(models, model_dir, hf_cfg)
            actor = build_actor(_config(spec), models, vocab_size=hf_cfg.vocab_size)
            gpt = actor.gpt_models
            scale_parameters(gpt, 1.0 + 2.0**-5 * (index + 1))

            # 1-2: the first sync, bucket by bucket, into an engine that is stale everywhere.
            expected = export_clone(gpt, hf_cfg)
            if engine is not None:
                before = compare_engine(engine, expected)
                result["stale_before_sync"] = len(before["differ"])
                if hasattr(engine, "reset_load_tracking"):
                    engine.reset_load_tracking()
            stats = rollout.sync_weights(gpt, hf_cfg, bucket_mb)
            result["sync_mode"] = rollout.sync_mode
            result["sync"] = {k: getattr(stats, k) for k in ("bytes", "num_tensors", "num_buckets", "peak_bucket_bytes", "seconds")}
            result["expected_bytes"] = sum(t.numel() * t.element_size() for t in expected.values())
            result["expected_tensors"] = len(expected)
            result["largest_tensor_bytes"] = max(t.numel() * t.element_size() for t in expected.values())
            if engine is not None:
                result["after_sync"] = compare_engine(engine, expected)
                if hasattr(engine, "missing_after_load"):
                    result["not_loaded"] = engine.missing_after_load()

            # 3: the TP-shard stream of this rank.
            result["shards"] = check_shard_stream(gpt, hf_cfg, expected, bucket_mb)
            if spec.get("liveness"):
                result["liveness"] = bucket_liveness(gpt, hf_cfg, bucket_mb)

            # 4: training / inference mismatch on sampled responses.
            batch, trainer_log_probs, result["mismatch"] = sample_and_compare(engine, actor, prompts, seed=100 + index)

            # 5: one real optimizer step on those responses, then sync and check again.
            g = torch.Generator().manual_seed(5 + index)
            batch.old_log_probs = trainer_log_probs
            batch.advantages = torch.randn(batch.num_sequences, generator=g)
            result["update"] = actor.update([batch])
            expected = export_clone(gpt, hf_cfg)
            rollout.sync_weights(gpt, hf_cfg, bucket_mb)
            if engine is not None:
                result["after_update_sync"] = compare_engine(engine, expected)
            _, _, result["mismatch_after_update"] = sample_and_compare(engine, actor, prompts, seed=200 + index)

            # 6: many cheap update + sync rounds against an independent mirror.
            mirror = expected if engine is not None else None
            rounds = []
            previous = {name: digest(t) for name, t in mirror.items()} if mirror is not None else None
            round_started = time.perf_counter()
            for r in range(spec.get("rounds", 0)):
                factor = round_factor(r)
                scale_parameters(gpt, factor)
                rollout.sync_weights(gpt, hf_cfg, rounds_bucket_mb)
                if engine is None:
                    continue
                for tensor in mirror.values():
                    tensor.mul_(factor)
                want = {name: digest(t) for name, t in mirror.items()}
                have = {name: digest(t) for name, t in engine_state(engine).items() if name in want}
                rounds.append(
                    {
                        "stale_or_wrong": sorted(n for n in want if have.get(n) != want[n]),
                        "unchanged_since_last_round": sorted(n for n in want if want[n] == previous[n]),
                    }
                )
                previous = want
            result["rounds"] = rounds
            result["rounds_seconds"] = time.perf_counter() - round_started
            result["seconds"] = time.perf_counter() - started
            out["layouts"][spec["name"]] = result
            rollout.close_weight_sync()
            dist.barrier()
    except Exception:
        out["error"] = traceback.format_exc()
        raise
    finally:
        from tests.support.torchrun_utils import write_rank_result

        write_rank_result(out)
        if engine is not None:
            engine.shutdown()
        teardown()
    return None


if __name__ == "__main__":
    run_layouts(**json.loads(sys.argv[1]))
