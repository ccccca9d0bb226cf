"""Worker for the actor tests (run through tests/torchrun_utils.py, not collected by pytest).

Both entry points load the same tiny HF model (Qwen2 with tied embeddings, so the PP embedding
all-reduce is exercised), build the same global batch of 7 sequences, and save full HF-named
tensors (gradients after finalize, weights after the optimizer steps) with torch.save; the
assertions live in test_actor_parallel.py.

* `run_single` (1 process): the reference run (one micro-batch), the same run with 2 and 4
  micro-batches, an independent gradient from HF transformers with a hand-written loss, the LR
  schedule and gradient clipping.
* `run_layouts` (4 processes): the same steps under several TP / PP / VPP / CP / DP layouts (and
  sequence parallelism) in one launch, each data-parallel rank holding an uneven share of the batch
  (one holds none).
* `run_cp_architectures` (2 processes): Qwen2, Llama 3 and Qwen3 at CP=2 against HF and CP=1.
"""

from __future__ import annotations

import math
import time
from pathlib import Path

import torch

from torchrun_utils import reporting

NUM_SEQUENCES = 7
PROMPT_RANGE = (2, 9)
RESPONSE_RANGE = (1, 15)
# Uneven data-parallel shares of the 7 sequences (a rank with none at DP=4).
DP_SHARES = {1: [list(range(7))], 2: [[0, 1, 2, 3, 4], [5, 6]], 4: [[0, 1, 2, 3], [], [4, 5], [6]]}
LAYOUT_BUDGET = 24  # tokens per training micro-batch in the layouts: several, different per rank


# ---------------------------------------------------------------------------------------------
# Data and configuration
# ---------------------------------------------------------------------------------------------


def make_config(**sections):
    """A Config for the tests: float32 tiny model, every loss term on, no warm-up unless asked."""
    from megatron_dapo.config import Config

    cfg = Config()
    cfg.optimizer.lr = 1e-3
    cfg.optimizer.warmup_steps = 0
    cfg.optimizer.grad_clip = 1.0
    # Adam's first steps are ~lr * sign(grad): an element whose gradient is ~0 flips by 2 * lr under
    # a 1e-7 change of summation order. A larger epsilon keeps the update smooth in the gradient so
    # that weights of different layouts can be compared tightly (the optimizer code is unchanged).
    cfg.optimizer.adam_eps = 1e-4
    cfg.algorithm.entropy_coeff = 0.01
    cfg.algorithm.kl.use_kl_loss = True
    cfg.algorithm.kl.coef = 0.05
    cfg.algorithm.kl.type = "low_var_kl"
    cfg.algorithm.tis_cap = 1.5
    cfg.rollout.max_response_length = RESPONSE_RANGE[1]
    cfg.trainer.micro_batch_size = NUM_SEQUENCES
    cfg.trainer.max_tokens_per_micro_batch = 0
    cfg.trainer.total_steps = 20
    for section, values in sections.items():
        for key, value in values.items():
            setattr(getattr(cfg, section), key, value)
    return cfg


def hf_response_log_probs(hf_model, batch, requires_grad: bool = False, temperature: float = 1.0):
    """[n, R] log-probs and entropies of the response tokens under the HF model, one sequence at a time."""
    n, width = batch.num_sequences, batch.response_width
    rows_lp, rows_h = [], []
    for i in range(n):
        tokens = batch.tokens_of(i)
        p, r = int(batch.prompt_lengths[i]), int(batch.response_lengths[i])
        with torch.set_grad_enabled(requires_grad):
            log_softmax = (hf_model(input_ids=tokens[None]).logits[0].float() / temperature).log_softmax(-1)
            picked = log_softmax[p - 1 : p - 1 + r].gather(-1, tokens[p : p + r, None])[:, 0]
            entropy = -(log_softmax[p - 1 : p - 1 + r].exp() * log_softmax[p - 1 : p - 1 + r]).sum(-1)
        pad = torch.zeros(width - r)
        rows_lp.append(torch.cat([picked, pad]))
        rows_h.append(torch.cat([entropy, pad]))
    return torch.stack(rows_lp), torch.stack(rows_h)


def global_batch(hf_model):
    """The 7-sequence batch every test uses, with old / ref / rollout log-probs and advantages."""
    from megatron_dapo.actor import PolicyBatch

    g = torch.Generator().manual_seed(2024)
    prompts = [torch.randint(0, 300, (int(torch.randint(*PROMPT_RANGE, (1,), generator=g)),), generator=g) for _ in range(NUM_SEQUENCES)]
    responses = [torch.randint(0, 300, (int(torch.randint(*RESPONSE_RANGE, (1,), generator=g)),), generator=g) for _ in range(NUM_SEQUENCES)]
    batch = PolicyBatch.from_token_lists(prompts, responses, response_width=RESPONSE_RANGE[1] - 1)
    base, _ = hf_response_log_probs(hf_model, batch)
    valid = batch.response_valid_mask()
    noise = lambda scale: torch.where(valid, scale * torch.randn(base.shape, generator=g), 0.0)  # noqa: E731
    batch.old_log_probs = base + noise(0.3)  # ratios away from 1: the clips are active on some tokens
    batch.ref_log_probs = base + noise(0.2)
    batch.rollout_log_probs = batch.old_log_probs + noise(0.5)  # some truncated-IS weights hit the cap
    batch.advantages = torch.randn(NUM_SEQUENCES, generator=g)
    mask = valid.clone()
    mask[3] = False  # an overlong-filtered response: no loss token, not counted as a sequence
    batch.response_mask = mask
    return batch


# ---------------------------------------------------------------------------------------------
# Model, actor, exports
# ---------------------------------------------------------------------------------------------


def build_actor_for(model_dir: str, layout, cfg, sequence_parallel: bool = False):
    from megatron_dapo.actor import build_actor
    from megatron_dapo.model.builder import build_gpt_models
    from megatron_dapo.model.hf_config import read_hf_config
    from megatron_dapo.model.load import load_hf_into_megatron

    hf_cfg = read_hf_config(model_dir)
    models = build_gpt_models(
        hf_cfg, layout, torch.float32, transformer_engine="off", init_weights=False, sequence_parallel=sequence_parallel
    )
    load_hf_into_megatron(models, model_dir, hf_cfg)
    return build_actor(cfg, models, vocab_size=hf_cfg.vocab_size), hf_cfg


def export_weights(actor, hf_cfg) -> dict[str, torch.Tensor]:
    from megatron_dapo.model.load import export_megatron_to_hf

    return {name: tensor.clone() for name, tensor in export_megatron_to_hf(actor.gpt_models, hf_cfg)}


def export_grads(actor, hf_cfg) -> dict[str, torch.Tensor]:
    """Full HF-named gradients (the DDP main_grad buffers), via the weight export's mapping.

    Valid only without the distributed optimizer (it reduce-scatters: each rank keeps a shard).
    """
    params = [p for model in actor.gpt_models for p in model.parameters()]
    saved = [p.data for p in params]
    try:
        for p in params:
            p.data = p.main_grad
        return export_weights(actor, hf_cfg)
    finally:
        for p, data in zip(params, saved):
            p.data = data


def main_grad_norm(actor) -> float:
    """Norm of the gradients as they are now (after clipping); single process only."""
    return math.sqrt(sum(float(p.main_grad.double().square().sum()) for m in actor.gpt_models for p in m.parameters()))


def _tensor_list(t: torch.Tensor) -> list:
    return t.double().tolist()


def run_steps(actor, hf_cfg, share, save_grads: bool) -> tuple[dict, dict]:
    """compute_log_probs; step 1 by hand (gradients exported between backward and step); step 2 via update()."""
    from megatron_dapo.actor import summarise

    result: dict = {}
    tensors: dict = {}
    started = time.perf_counter()
    log_probs, entropy = actor.compute_log_probs(share, with_entropy=True)
    result["log_probs"] = _tensor_list(log_probs)
    result["entropy"] = _tensor_list(entropy)
    local_plan = actor.plan(share, actor.settings.max_tokens_per_micro_batch)
    result["local_micro_batches"] = len(local_plan)
    result["synchronised_micro_batches"] = len(actor.synchronised_plan(share))
    sums = actor.compute_gradients(share)
    result["step1"] = summarise(sums[: -2])
    if save_grads:
        tensors["grads"] = export_grads(actor, hf_cfg)
    result["step1"].update(actor.apply_gradients())
    result["step2"] = actor.update([share])
    tensors["weights"] = export_weights(actor, hf_cfg)
    result["seconds"] = time.perf_counter() - started
    return result, tensors


# ---------------------------------------------------------------------------------------------
# Entry points
# ---------------------------------------------------------------------------------------------


def _hand_written_hf_gradients(hf_model, batch, cfg) -> dict[str, torch.Tensor]:
    """The gradient of the DAPO objective on the HF model, written out from the formulas."""
    a = cfg.algorithm
    hf_model.zero_grad(set_to_none=True)
    log_probs, entropy = hf_response_log_probs(hf_model, batch, requires_grad=True)
    mask = batch.loss_mask().double()
    lp, h = log_probs.double(), entropy.double()
    old, ref, rollout = batch.old_log_probs.double(), batch.ref_log_probs.double(), batch.rollout_log_probs.double()
    adv = batch.advantages.double()[:, None].expand_as(lp)
    ratio = torch.exp(lp - old)
    pg = torch.maximum(-adv * ratio, -adv * ratio.clamp(1 - a.clip_low, 1 + a.clip_high))
    pg = torch.where(adv < 0, torch.minimum(pg, -adv * a.clip_c), pg)
    pg = pg * torch.exp(old - rollout).clamp(max=a.tis_cap)
    kl = torch.exp(ref - lp) - (ref - lp) - 1  # k3 / low_var_kl
    tokens = mask.sum()
    loss = ((pg - a.entropy_coeff * h + a.kl.coef * kl) * mask).sum() / tokens
    loss.backward()
    return {name: p.grad.detach().clone() for name, p in hf_model.named_parameters()}


def run_single(model_dir: str, out_dir: str) -> dict:
    """The single-process reference, micro-batch invariance, HF gradient, LR schedule and clipping."""
    from tiny_models import load_hf_model

    from megatron_dapo.actor import split_mini_batches
    from megatron_dapo.distributed import ParallelLayout, init_distributed

    out: dict = {}
    with reporting(out):
        ctx = init_distributed(ParallelLayout(), timeout_s=240, seed=3)
        hf_model = load_hf_model(Path(model_dir))
        batch = global_batch(hf_model)
        hf_log_probs, hf_entropy = hf_response_log_probs(hf_model, batch)
        out["hf_log_probs"] = _tensor_list(hf_log_probs)
        out["hf_entropy"] = _tensor_list(hf_entropy)
        out["response_valid"] = batch.response_valid_mask().tolist()
        tensors = {"hf_grads": _hand_written_hf_gradients(hf_model, batch, make_config())}

        # Sampling temperature, and an empty batch (a rank whose sequences were all filtered out).
        actor, _ = build_actor_for(model_dir, ctx.layout, make_config(rollout={"temperature": 0.7}))
        hot, _ = hf_response_log_probs(hf_model, batch, temperature=0.7)
        out["temperature_max_diff"] = float((actor.compute_log_probs(batch) - hot).abs().max())
        out["empty_batch_shape"] = list(actor.compute_log_probs(batch.select([])).shape)

        # Gradients and grad norm with 1, 2 and 4 micro-batches (by count, then by a token budget).
        splits = {"mb1": {"micro_batch_size": 7}, "mb2": {"micro_batch_size": 4}, "mb4": {"micro_batch_size": 2},
                  "budget": {"max_tokens_per_micro_batch": 20}}  # fmt: skip
        for name, trainer in splits.items():
            actor, hf_cfg = build_actor_for(model_dir, ctx.layout, make_config(trainer=trainer))
            result, saved = run_steps(actor, hf_cfg, batch, save_grads=True)
            out[name] = result
            tensors[name] = saved

        # LR schedule: warm-up over 3 rollout steps, 2 mini-batches per step; clipping active.
        actor, _ = build_actor_for(model_dir, ctx.layout, make_config(optimizer={"warmup_steps": 3, "grad_clip": 1e-3}))
        out["schedule"] = []
        for _ in range(5):
            metrics = actor.update(split_mini_batches(batch, 2))
            groups = [{"lr": g["lr"], "weight_decay": g["weight_decay"], "wd_mult": g.get("wd_mult", 1.0)} for g in actor.optimizer.param_groups]
            out["schedule"].append({"metrics": metrics, "groups": groups, "post_clip_norm": main_grad_norm(actor)})
        # Clipping inactive when the norm is below the threshold.
        actor, _ = build_actor_for(model_dir, ctx.layout, make_config(optimizer={"grad_clip": 1e6}))
        metrics = actor.update([batch])
        out["no_clip"] = {"metrics": metrics, "post_clip_norm": main_grad_norm(actor)}
        torch.save(tensors, Path(out_dir) / "single.pt")
    return None


def run_layouts(model_dir: str, out_dir: str, layouts: list) -> None:
    """For each layout {name, tp, pp, vpp, dist_opt}: the steps of `run_steps` on this rank's DP share."""
    from tiny_models import load_hf_model

    from megatron_dapo.distributed import ParallelLayout, init_distributed, teardown

    out: dict = {"layouts": {}}
    ctx = None
    with reporting(out):
        hf_model = load_hf_model(Path(model_dir))
        batch = global_batch(hf_model)
        for spec in layouts:
            if ctx is not None:
                teardown(keep_process_group=True)
            layout = ParallelLayout(tp=spec["tp"], pp=spec["pp"], vpp=spec.get("vpp"), cp=spec.get("cp", 1))
            ctx = init_distributed(layout, timeout_s=240, seed=3)
            from megatron.core import parallel_state as ps

            dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
            share_indices = DP_SHARES[dp][dp_rank]
            share = batch.select(share_indices)
            cfg = make_config(
                trainer={"max_tokens_per_micro_batch": LAYOUT_BUDGET},
                parallel={"use_distributed_optimizer": spec["dist_opt"]},
            )
            actor, hf_cfg = build_actor_for(model_dir, ctx.layout, cfg, sequence_parallel=spec.get("sp", False))
            result, saved = run_steps(actor, hf_cfg, share, save_grads=not spec["dist_opt"])
            result["pad_to_multiple_of"] = actor.pad_to_multiple_of
            result.update(dp=dp, dp_rank=dp_rank, share=share_indices)
            out["layouts"][spec["name"]] = result
            if ctx.rank == 0:
                torch.save(saved, Path(out_dir) / f"{spec['name']}.pt")
    return None


def run_cp_architectures(model_dirs: dict, out_dir: str) -> None:
    """Per architecture: CP=2 (2 processes, whole batch) and then CP=1 x DP=2 (uneven shares).

    Saved on rank 0 for the test: HF log-probs and the hand-written HF gradient (the independent
    reference), the CP=2 log-probs, DDP gradients and weights after one update, and the CP=1 weights
    after the same update.
    """
    from tiny_models import load_hf_model

    from megatron_dapo.actor import summarise
    from megatron_dapo.distributed import ParallelLayout, init_distributed, teardown

    out: dict = {"architectures": {}}
    ctx = None
    with reporting(out):
        for arch, model_dir in model_dirs.items():
            hf_model = load_hf_model(Path(model_dir))
            batch = global_batch(hf_model)
            hf_log_probs, hf_entropy = hf_response_log_probs(hf_model, batch)
            saved = {"hf_log_probs": hf_log_probs, "hf_entropy": hf_entropy,
                     "hf_grads": _hand_written_hf_gradients(hf_model, batch, make_config())}  # fmt: skip
            entry: dict = {"model_lengths": batch.model_lengths()}
            for cp in (2, 1):
                if ctx is not None:
                    teardown(keep_process_group=True)
                ctx = init_distributed(ParallelLayout(cp=cp), timeout_s=240, seed=3)
                from megatron.core import parallel_state as ps

                share = batch if cp == 2 else batch.select(DP_SHARES[2][ps.get_data_parallel_rank()])
                actor, hf_cfg = build_actor_for(model_dir, ctx.layout, make_config(parallel={"use_distributed_optimizer": False}))
                if cp == 2:
                    log_probs, entropy = actor.compute_log_probs(share, with_entropy=True)
                    saved.update(cp_log_probs=log_probs, cp_entropy=entropy)
                    entry["pad_to_multiple_of"] = actor.pad_to_multiple_of
                sums = actor.compute_gradients(share)
                if cp == 2:
                    saved["cp_grads"] = export_grads(actor, hf_cfg)
                stats = summarise(sums[:-2])
                stats.update(actor.apply_gradients())
                entry[f"cp{cp}_step"] = stats
                saved[f"cp{cp}_weights"] = export_weights(actor, hf_cfg)
            out["architectures"][arch] = entry
            if ctx.rank == 0:
                torch.save(saved, Path(out_dir) / f"{arch}.pt")
    return None
