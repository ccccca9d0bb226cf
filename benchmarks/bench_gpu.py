"""GPU checks on one GPU for a ~0.5B Qwen2-shaped model: logits vs HF, update-step MFU, weight sync.

A randomly initialised model with the exact shape of Qwen2.5-0.5B (hidden 896, 24 layers, 14 heads /
2 KV heads, FFN 4864, vocabulary 151936, tied embeddings, QKV bias; 494M parameters) is saved as an
HF checkpoint (no download) and loaded into Megatron-Core on the GPU (local layer spec: Transformer
Engine is not installed there). Three measurements, each in its own section of the JSON written to
`--out` (and printed):

* logits: Megatron vs HF transformers on the same weights and tokens, float32 with TF32 off
  (max |diff| of logits, and the first diverging block if any), and bfloat16 (both sides against
  the float32 reference, so the Megatron bf16 error is shown next to HF's own bf16 error);
* update: the bf16 actor's update step (Megatron DDP + distributed optimizer, the DAPO policy loss
  with clip-higher, global token-mean) and forward-only log-probs: tokens/s (median of `--iters`
  after a warm-up) and MFU = model FLOPs / (seconds x peak bf16 FLOP/s), model FLOPs per token
  = 6 x (matmul parameters: layers + output layer) + 12 x layers x hidden x seq (attention scores
  and values, the PaLM paper's convention, which counts full rather than causal attention);
  forward-only counts a third of that;
* sync: `sync_weights` from the bf16 actor into an embedded HF engine on the same GPU (bucketed,
  mapping-table export), seconds and GB/s next to a plain device-to-device copy of the same bytes,
  and a bit-exact check of every engine tensor against the HF export.

    python benchmarks/bench_gpu.py --out gpu.json [--batch 8 --seq 2048 --iters 5 --peak-tflops 989]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron_dapo.actor import PolicyBatch, build_actor  # noqa: E402
from megatron_dapo.config import Config  # noqa: E402
from megatron_dapo.distributed import ParallelLayout, init_distributed, teardown  # noqa: E402

QWEN25_05B = dict(hidden=896, layers=24, heads=14, kv_heads=2, ffn=4864, vocab=151936)


def save_model(path: Path, args) -> None:
    from transformers import AutoModelForCausalLM, Qwen2Config

    cfg = Qwen2Config(
        hidden_size=args.hidden, num_hidden_layers=args.layers, num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads, intermediate_size=args.ffn, vocab_size=args.vocab,
        max_position_embeddings=32768, rope_theta=1e6, rms_norm_eps=1e-6, tie_word_embeddings=True,
    )  # fmt: skip
    cfg.architectures = ["Qwen2ForCausalLM"]
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).save_pretrained(path)


def build_megatron(model_dir: Path, layout, dtype):
    from megatron_dapo.model.builder import build_gpt_models
    from megatron_dapo.model.hf_config import read_hf_config
    from megatron_dapo.model.load import load_hf_into_megatron

    hf_cfg = read_hf_config(model_dir)
    models = build_gpt_models(hf_cfg, layout, dtype, transformer_engine="off", init_weights=False)
    load_hf_into_megatron(models, model_dir, hf_cfg)
    return hf_cfg, models


DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # CPU only for a smoke run with tiny shapes


def sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def check_logits(args, model_dir: Path, layout) -> dict:
    from transformers import AutoModelForCausalLM

    from megatron_dapo.model.debug import compare_with_hf, megatron_logits

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    g = torch.Generator().manual_seed(3)
    input_ids = torch.randint(0, args.vocab, (2, 256), generator=g).to(DEVICE)
    result = {}
    hf32 = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager").to(DEVICE)
    hf_cfg, meg32 = build_megatron(model_dir, layout, torch.float32)
    report = compare_with_hf(meg32, hf32, input_ids, tol=1e-5, vocab_size=args.vocab)
    result["float32"] = {"report": str(report)}
    with torch.no_grad():
        ref = hf32(input_ids=input_ids).logits.float()
        meg = megatron_logits(meg32, input_ids, vocab_size=args.vocab).float()
    result["float32"]["max_abs_diff"] = float((meg - ref).abs().max())
    result["float32"]["max_abs_logit"] = float(ref.abs().max())
    del meg32
    hf16 = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).to(DEVICE)  # sdpa, as users run it
    _, meg16 = build_megatron(model_dir, layout, torch.bfloat16)
    with torch.no_grad():
        hf_bf16 = hf16(input_ids=input_ids).logits.float()
        meg_bf16 = megatron_logits(meg16, input_ids, vocab_size=args.vocab).float()
    ref_lp = ref.log_softmax(-1)
    result["bfloat16"] = {
        "megatron_vs_fp32_max": float((meg_bf16 - ref).abs().max()),
        "hf_vs_fp32_max": float((hf_bf16 - ref).abs().max()),
        "megatron_vs_hf_bf16_max": float((meg_bf16 - hf_bf16).abs().max()),
        "megatron_logprob_vs_fp32_mean": float((meg_bf16.log_softmax(-1) - ref_lp).abs().mean()),
        "hf_logprob_vs_fp32_mean": float((hf_bf16.log_softmax(-1) - ref_lp).abs().mean()),
    }
    del hf32, hf16, meg16
    torch.backends.cuda.matmul.allow_tf32 = True
    if DEVICE == "cuda":
        torch.cuda.empty_cache()
    return result


def make_batch(args) -> PolicyBatch:
    g = torch.Generator().manual_seed(1)
    response_length = args.seq - args.prompt
    prompts = [torch.randint(0, args.vocab, (args.prompt,), generator=g) for _ in range(args.batch)]
    responses = [torch.randint(0, args.vocab, (response_length,), generator=g) for _ in range(args.batch)]
    batch = PolicyBatch.from_token_lists(prompts, responses, response_width=response_length)
    valid = batch.response_valid_mask()
    batch.old_log_probs = torch.where(valid, -12.0 + 0.3 * torch.randn(valid.shape, generator=g), 0.0)
    batch.advantages = torch.randn(args.batch, generator=g)
    return batch


def model_flops_per_token(args, hf_cfg) -> float:
    """Training FLOPs per token (forward + backward), Megatron's convention (no recompute)."""
    h, layers, seq = args.hidden, args.layers, args.seq
    kv = args.kv_heads * (h // args.heads)
    per_layer = h * (h + 2 * kv) + h * h + 3 * h * args.ffn  # QKV, output projection, SwiGLU MLP
    matmul_params = layers * per_layer + h * args.vocab  # + the output layer (tied or not, it is a matmul)
    return 6 * matmul_params + 12 * layers * h * seq  # PaLM convention: full (not causal) attention


def timed(fn, iters: int) -> tuple[float, object]:
    first = fn()
    sync()
    times = []
    for _ in range(iters):
        sync()
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times), first


def hf_baseline(args, model_dir: Path, batch: PolicyBatch) -> dict:
    """The same update (clipped token-mean loss, micro-batches, clip-norm, AdamW) on the HF model in
    plain PyTorch: bf16 weights, SDPA attention, fused AdamW, full-vocabulary fp32 log-softmax per
    micro-batch. Not mixed precision (no fp32 master weights), so it does less work per step."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16, attn_implementation="sdpa").to(DEVICE)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6, weight_decay=0.1, fused=DEVICE == "cuda")
    input_ids = torch.cat([batch.prompt_ids, batch.response_ids], dim=1).to(DEVICE)
    mask = batch.loss_mask().float().to(DEVICE)
    old, adv = batch.old_log_probs.to(DEVICE), batch.advantages.to(DEVICE)[:, None]
    prompt, width, mbs = batch.prompt_ids.shape[1], batch.response_width, args.micro_batch_size
    total = mask.sum()

    def step(forward_only: bool):
        optimizer.zero_grad(set_to_none=True)
        for start in range(0, batch.num_sequences, mbs):
            rows = slice(start, start + mbs)
            with torch.set_grad_enabled(not forward_only):
                logits = model(input_ids=input_ids[rows]).logits[:, prompt - 1 : prompt - 1 + width].float()
                log_probs = logits.log_softmax(-1).gather(-1, batch.response_ids[rows, :, None].to(DEVICE))[..., 0]
                if forward_only:
                    continue
                ratio = torch.exp(log_probs - old[rows])
                pg = torch.maximum(-adv[rows] * ratio, -adv[rows] * ratio.clamp(0.8, 1.28))
                ((pg * mask[rows]).sum() / total).backward()
        if not forward_only:
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()

    tokens = int(batch.prompt_lengths.sum() + batch.response_lengths.sum())
    upd_s, _ = timed(lambda: step(False), args.iters)
    fwd_s, _ = timed(lambda: step(True), args.iters)
    return {"update_tokens_per_s": tokens / upd_s, "forward_tokens_per_s": tokens / fwd_s}


def measure_update(args, model_dir: Path, layout) -> dict:
    hf_cfg, models = build_megatron(model_dir, layout, torch.bfloat16)
    cfg = Config()
    cfg.model.dtype = "bfloat16"
    cfg.optimizer.lr, cfg.optimizer.warmup_steps = 1e-6, 0
    cfg.parallel.use_distributed_optimizer = True
    cfg.trainer.micro_batch_size = args.micro_batch_size
    cfg.trainer.max_tokens_per_micro_batch = 0
    actor = build_actor(cfg, models, vocab_size=hf_cfg.vocab_size)
    batch = make_batch(args)
    tokens = int(batch.prompt_lengths.sum() + batch.response_lengths.sum())
    if DEVICE == "cuda":
        torch.cuda.reset_peak_memory_stats()
    fwd_s, log_probs = timed(lambda: actor.compute_log_probs(batch), args.iters)
    upd_s, metrics = timed(lambda: actor.update([batch]), args.iters)
    profile = None
    if args.profile:  # where an update step's time goes: the top kernels by GPU time
        from torch.profiler import ProfilerActivity, profile as torch_profile

        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if DEVICE == "cuda" else [])
        with torch_profile(activities=activities) as prof:
            actor.update([batch])
            sync()
        sort_key = "cuda_time_total" if DEVICE == "cuda" else "cpu_time_total"
        profile = prof.key_averages().table(sort_by=sort_key, row_limit=25, max_name_column_width=60)
        print(profile)
    flops = model_flops_per_token(args, hf_cfg)
    peak = args.peak_tflops * 1e12
    params = sum(p.numel() for m in models for p in m.parameters())
    baseline = hf_baseline(args, model_dir, batch) if args.hf_baseline else None
    return {
        "hf_baseline": baseline,
        "profile": profile,
        "update_vs_hf": None if baseline is None else (tokens / upd_s) / baseline["update_tokens_per_s"],
        "forward_vs_hf": None if baseline is None else (tokens / fwd_s) / baseline["forward_tokens_per_s"],
        "parameters": params,
        "tokens_per_step": tokens,
        "micro_batch_size": args.micro_batch_size,
        "update_s": upd_s,
        "update_tokens_per_s": tokens / upd_s,
        "update_mfu": tokens * flops / upd_s / peak,
        "forward_s": fwd_s,
        "forward_tokens_per_s": tokens / fwd_s,
        "forward_mfu": tokens * flops / 3 / fwd_s / peak,
        "model_tflop_per_token": flops / 1e12,
        "first_loss": float(metrics.get("loss", float("nan"))),
        "grad_norm": float(metrics.get("grad_norm", float("nan"))),
        "log_probs_finite": bool(torch.isfinite(log_probs).all()),
        "peak_memory_gib": torch.cuda.max_memory_allocated() / 2**30 if DEVICE == "cuda" else None,
        "_models": (hf_cfg, models),
    }


def measure_sync(args, model_dir: Path, hf_cfg, models) -> dict:
    from megatron_dapo.model.load import export_megatron_to_hf
    from megatron_dapo.rollout.engines.embedded import EmbeddedEngine
    from megatron_dapo.rollout.sync.dispatch import sync_weights

    engine = EmbeddedEngine(model_dir, dtype=torch.bfloat16, device=DEVICE)
    params = dict(engine.model.named_parameters())
    total_bytes = sum(p.numel() * p.element_size() for p in params.values())
    sources = {n: p.detach().clone() for n, p in params.items()}

    def plain_copy():
        for name, param in params.items():
            param.data.copy_(sources[name])

    result = {"model_gb": total_bytes / 1e9}
    for bucket_mb in args.bucket_mb:
        seconds, stats = timed(lambda: sync_weights(models, hf_cfg, engine, bucket_mb=bucket_mb), args.iters)
        result[f"sync_s_bucket{int(bucket_mb)}"] = seconds
        result[f"sync_gb_per_s_bucket{int(bucket_mb)}"] = total_bytes / 1e9 / seconds
    copy_s, _ = timed(plain_copy, args.iters)
    result["plain_copy_s"] = copy_s
    result["plain_copy_gb_per_s"] = total_bytes / 1e9 / copy_s
    sync_weights(models, hf_cfg, engine, bucket_mb=args.bucket_mb[0])
    mismatched = []
    exported = 0
    for name, tensor in export_megatron_to_hf(models, hf_cfg):
        exported += 1
        target = params.get(name)
        if target is None:
            if name == "lm_head.weight":  # tied: the engine holds one tensor for both
                target = params["model.embed_tokens.weight"]
            else:
                mismatched.append(f"{name}: missing in engine")
                continue
        if target.dtype != tensor.dtype or not torch.equal(target.detach(), tensor.to(target.device)):
            mismatched.append(f"{name}: engine {target.dtype}, export {tensor.dtype}")
    result["tensors_checked"] = exported
    result["tensors_differing"] = mismatched
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, args.vocab, (32,), generator=g).tolist() for _ in range(4)]
    from megatron_dapo.rollout.base import SamplingParams

    out = engine.generate(prompts, SamplingParams(n=2, temperature=1.0, max_new_tokens=32, seed=0))
    result["generated_rows"] = len(out)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    for key, value in QWEN25_05B.items():
        parser.add_argument(f"--{key.replace('_', '-')}", type=int, default=value)
    parser.add_argument("--batch", type=int, default=8, help="sequences per update step")
    parser.add_argument("--seq", type=int, default=2048, help="tokens per sequence (prompt + response)")
    parser.add_argument("--prompt", type=int, default=256)
    parser.add_argument("--micro-batch-size", type=int, default=2)
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--peak-tflops", type=float, default=989.0, help="dense bf16 peak of the GPU (H100 SXM: 989)")
    parser.add_argument("--bucket-mb", type=float, nargs="+", default=[256, 1024])
    parser.add_argument("--hf-baseline", action=argparse.BooleanOptionalAction, default=True,
                        help="also time the same update on the HF model in plain PyTorch (same run)")
    parser.add_argument("--profile", action="store_true", help="print the top kernels of one update step")
    parser.add_argument("--skip", nargs="*", default=[], choices=["logits", "update", "sync"])
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if DEVICE != "cuda":
        print("no CUDA GPU: a CPU smoke run (use tiny shapes); the figures mean nothing here", file=sys.stderr)

    ctx = init_distributed(ParallelLayout(), seed=0)
    results: dict = {"device": torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu", "torch": torch.__version__, "args": vars(args)}
    try:
        import megatron.core
        import transformers

        results["megatron_core"] = megatron.core.__version__
        results["transformers"] = transformers.__version__
    except Exception:  # noqa: BLE001 - versions are informative only
        pass

    def section(name, fn):
        if name in args.skip:
            return None
        try:
            start = time.perf_counter()
            value = fn()
            results[f"{name}_wall_s"] = time.perf_counter() - start
            return value
        except Exception:  # noqa: BLE001 - report and go on to the next section
            results[f"{name}_error"] = traceback.format_exc()
            print(results[f"{name}_error"], file=sys.stderr)
            return None

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(tmp) / "model"
        save_model(model_dir, args)
        results["logits"] = section("logits", lambda: check_logits(args, model_dir, ctx.layout))
        update = section("update", lambda: measure_update(args, model_dir, ctx.layout))
        if update is not None:
            hf_cfg, models = update.pop("_models")
            results["update"] = update
            results["sync"] = section("sync", lambda: measure_sync(args, model_dir, hf_cfg, models))
    text = json.dumps(results, indent=2, default=str)
    print(text)
    if args.out:
        Path(args.out).write_text(text)
    teardown()


if __name__ == "__main__":
    main()
