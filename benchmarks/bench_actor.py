"""Actor throughput: Megatron update step and forward-only log-probs vs a plain PyTorch reference.

One process, float32, on whatever device torch has (the CPU here). A randomly initialised Qwen2-style
model (default: hidden 256, 4 layers, 4 heads / 2 KV heads, FFN 1024, vocabulary 2048, untied) is saved
as an HF checkpoint and loaded twice from it, so both sides compute with identical weights:

* megatron: `MegatronActor` (Megatron-Core GPTModel, local layer spec, Megatron DDP + optimizer,
  pipeline schedule with one micro-batch, vocab-parallel chunked log-probs, the DAPO policy loss with
  clip-higher and dual-clip, global token-mean, entropy computed for logging);
* reference: the HF transformers model (eager attention), log-probs by `log_softmax` over the full
  vocabulary + gather, the same clipped token-mean loss written by hand, entropy under no_grad for
  logging, `torch.optim.AdamW` with the same hyper-parameters and `clip_grad_norm_`.

The batch: `--batch` sequences of `--seq` tokens (`--prompt` of them prompt), all of the same length
by default (no padding anywhere); `--variable` draws response lengths uniformly in [seq/4, seq] and
also reports the padding the actor computed. Throughput counts prompt + response tokens per second
of one update (one optimizer step) / of one forward-only pass; median of `--iters` timed runs after
one warm-up, the two sides alternating. Both sides also report their loss on the first step as a sanity check (same weights,
same data: the values agree to float32 precision).

    python benchmarks/bench_actor.py [--hidden 256 --layers 4 --vocab 2048 --batch 8 --seq 256 --iters 5]
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron_dapo.actor import PolicyBatch, build_actor  # noqa: E402
from megatron_dapo.config import Config  # noqa: E402
from megatron_dapo.distributed import ParallelLayout, init_distributed, teardown  # noqa: E402

CLIP_LOW, CLIP_HIGH, CLIP_C = 0.2, 0.28, 3.0
LR, WEIGHT_DECAY, GRAD_CLIP = 1e-6, 0.1, 1.0


def save_model(path: Path, args) -> None:
    from transformers import AutoModelForCausalLM, Qwen2Config

    cfg = Qwen2Config(
        hidden_size=args.hidden,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=4 * args.hidden,
        num_hidden_layers=args.layers,
        vocab_size=args.vocab,
        max_position_embeddings=max(2 * args.seq, 512),
        tie_word_embeddings=False,
    )
    cfg.architectures = ["Qwen2ForCausalLM"]
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).save_pretrained(path)


def make_batch(args) -> PolicyBatch:
    g = torch.Generator().manual_seed(1)
    response_length = args.seq - args.prompt
    prompts = [torch.randint(0, args.vocab, (args.prompt,), generator=g) for _ in range(args.batch)]
    if args.variable:
        lengths = torch.randint(max(1, args.seq // 4 - args.prompt), response_length + 1, (args.batch,), generator=g)
    else:
        lengths = torch.full((args.batch,), response_length)
    responses = [torch.randint(0, args.vocab, (int(n),), generator=g) for n in lengths]
    batch = PolicyBatch.from_token_lists(prompts, responses, response_width=response_length)
    valid = batch.response_valid_mask()
    batch.old_log_probs = torch.where(valid, -8.0 + 0.3 * torch.randn(valid.shape, generator=g), 0.0)
    batch.advantages = torch.randn(args.batch, generator=g)
    return batch


# ---------------------------------------------------------------------------------------------
# Plain PyTorch reference
# ---------------------------------------------------------------------------------------------


def reference_log_probs(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, batch: PolicyBatch):
    """[n, R] log-probs of the response tokens (and the full log-softmax) from one HF forward."""
    logits = model(input_ids=input_ids, attention_mask=attention_mask).logits.float()
    log_softmax = logits.log_softmax(-1)
    prompt = batch.prompt_ids.shape[1]  # left-padded prompts: responses start at column `prompt`
    width = batch.response_width
    response_log_softmax = log_softmax[:, prompt - 1 : prompt - 1 + width]
    picked = response_log_softmax.gather(-1, batch.response_ids[:, :, None])[..., 0]
    return picked, response_log_softmax


def reference_update(model, optimizer, batch: PolicyBatch, input_ids, attention_mask) -> float:
    optimizer.zero_grad(set_to_none=True)
    log_probs, response_log_softmax = reference_log_probs(model, input_ids, attention_mask, batch)
    mask = batch.loss_mask().float()
    ratio = torch.exp(log_probs - batch.old_log_probs)
    adv = batch.advantages[:, None]
    pg = torch.maximum(-adv * ratio, -adv * ratio.clamp(1 - CLIP_LOW, 1 + CLIP_HIGH))
    pg = torch.where(adv < 0, torch.minimum(pg, -adv * CLIP_C), pg)
    loss = (pg * mask).sum() / mask.sum()
    loss.backward()
    with torch.no_grad():  # entropy for logging, as the actor does
        _ = -((response_log_softmax.exp() * response_log_softmax).sum(-1) * mask).sum() / mask.sum()
    torch.nn.utils.clip_grad_norm_(model.parameters(), GRAD_CLIP)
    optimizer.step()
    return float(loss)


# ---------------------------------------------------------------------------------------------


def timed_pair(megatron_fn, reference_fn, iters: int) -> tuple[float, float, object, object]:
    """Median seconds of each, runs alternating (fair under a varying machine load), after one warm-up each."""
    megatron_first, reference_first = megatron_fn(), reference_fn()
    megatron_times, reference_times = [], []
    for _ in range(iters):
        for fn, times in ((megatron_fn, megatron_times), (reference_fn, reference_times)):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
    return statistics.median(megatron_times), statistics.median(reference_times), megatron_first, reference_first


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--prompt", type=int, default=32)
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--micro-batch-size", type=int, default=0, help="sequences per micro-batch (0: the whole batch)")
    parser.add_argument("--variable", action="store_true", help="variable response lengths (padding inside micro-batches)")
    args = parser.parse_args()

    ctx = init_distributed(ParallelLayout(), seed=0)
    from transformers import AutoModelForCausalLM

    from megatron_dapo.model.builder import build_gpt_models
    from megatron_dapo.model.hf_config import read_hf_config
    from megatron_dapo.model.load import load_hf_into_megatron

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(tmp) / "model"
        save_model(model_dir, args)
        hf_cfg = read_hf_config(model_dir)
        models = build_gpt_models(hf_cfg, ctx.layout, torch.float32, transformer_engine="off")
        load_hf_into_megatron(models, model_dir, hf_cfg)
        reference = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager")

    cfg = Config()
    cfg.optimizer.lr, cfg.optimizer.weight_decay, cfg.optimizer.grad_clip = LR, WEIGHT_DECAY, GRAD_CLIP
    cfg.optimizer.warmup_steps = 0
    cfg.algorithm.clip_low, cfg.algorithm.clip_high, cfg.algorithm.clip_c = CLIP_LOW, CLIP_HIGH, CLIP_C
    cfg.parallel.use_distributed_optimizer = False
    cfg.trainer.micro_batch_size = args.micro_batch_size or args.batch
    cfg.trainer.max_tokens_per_micro_batch = 0
    actor = build_actor(cfg, models, vocab_size=hf_cfg.vocab_size)
    optimizer = torch.optim.AdamW(reference.parameters(), lr=LR, weight_decay=WEIGHT_DECAY, betas=(0.9, 0.999), eps=1e-8)

    batch = make_batch(args)
    # The HF inputs: [left-padded prompt | right-padded response], padding masked out of attention.
    input_ids = torch.cat([batch.prompt_ids, batch.response_ids], dim=1)
    attention_mask = torch.cat([torch.ones_like(batch.prompt_ids), batch.response_valid_mask().long()], dim=1)
    tokens = int(batch.prompt_lengths.sum() + batch.response_lengths.sum())

    # Forward-only first, on the same (initial) weights, so that the log-probs can be compared.
    reference.eval()

    def ref_forward():
        with torch.no_grad():
            return reference_log_probs(reference, input_ids, attention_mask, batch)[0]

    meg_forward_s, ref_forward_s, meg_lp, ref_lp = timed_pair(lambda: actor.compute_log_probs(batch), ref_forward, args.iters)
    lp_diff = float((meg_lp - ref_lp).abs()[batch.response_valid_mask()].max())
    reference.train()
    meg_update_s, ref_update_s, metrics, ref_loss = timed_pair(
        lambda: actor.update([batch]),
        lambda: reference_update(reference, optimizer, batch, input_ids, attention_mask),
        args.iters,
    )

    print(f"device: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, torch threads {torch.get_num_threads()}, "
          f"torch {torch.__version__}")  # fmt: skip
    print(f"model: hidden {args.hidden}, {args.layers} layers, vocab {args.vocab}, float32; batch {args.batch} x {args.seq} "
          f"tokens ({tokens} real), {cfg.trainer.micro_batch_size} sequences per micro-batch, {args.iters} timed runs (median)")  # fmt: skip
    print(f"{'':<22}{'megatron tok/s':>16}{'reference tok/s':>17}{'meg/ref':>9}")
    for name, meg, ref in (("update step", meg_update_s, ref_update_s), ("forward log-probs", meg_forward_s, ref_forward_s)):
        print(f"{name:<22}{tokens / meg:>16.0f}{tokens / ref:>17.0f}{ref / meg:>9.2f}")
    print(f"first-step loss: megatron {metrics['loss']:.6f}, reference {ref_loss:.6f}; "
          f"log-prob max |diff| {lp_diff:.2e}; actor pad_fraction {metrics['pad_fraction']:.3f}")  # fmt: skip
    teardown()


if __name__ == "__main__":
    main()
