"""Worker for the actor tests (run through tests/support/torchrun_utils.py, not collected by pytest).

Both entry points load the same tiny HF model (Qwen2 with tied embeddings, so the PP embedding
all-reduce is exercised), build the same global batch of 7 sequences, and save full HF-named
tensors (gradients after finalize, weights after the optimizer steps) with torch.save; the
assertions live in test_actor_parallel.py. The config, batch, actor and exports the actor workers
share: tests/support/actor_steps.py.

* `run_single` (1 process): the reference run (one micro-batch), the same run with 2 and 4
  micro-batches, an independent gradient from HF transformers with a hand-written loss, the LR
  schedule and gradient clipping.
* `run_layouts` (4 processes): the same steps under several TP / PP / VPP / CP / DP layouts (and
  sequence parallelism) in one launch, each data-parallel rank holding an uneven share of the batch
  (one holds none).
* `run_cp_architectures` (2 processes): Qwen2, Llama 3 and Qwen3 at CP=2 against HF and CP=1.
"""

from __future__ import annotations

from pathlib import Path

import torch

from tests.support.actor_steps import (
    DP_SHARES,
    LAYOUT_BUDGET,
    build_actor_for,
    export_grads,
    export_weights,
    global_batch,
    hf_response_log_probs,
    main_grad_norm,
    make_config,
    run_steps,
    tensor_list,
)
from tests.support.torchrun_utils import reporting


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
    from tests.support.tiny_models import load_hf_model

    from megatron_dapo.actor import split_mini_batches
    from megatron_dapo.distributed import ParallelLayout, init_distributed

    out: dict = {}
    with reporting(out):
        ctx = init_distributed(ParallelLayout(), timeout_s=240, seed=3)
        hf_model = load_hf_model(Path(model_dir))
        batch = global_batch(hf_model)
        hf_log_probs, hf_entropy = hf_response_log_probs(hf_model, batch)
        out["hf_log_probs"] = tensor_list(hf_log_probs)
        out["hf_entropy"] = tensor_list(hf_entropy)
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
    from tests.support.tiny_models import load_hf_model

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
    from tests.support.tiny_models import load_hf_model

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
