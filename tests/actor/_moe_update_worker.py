"""Worker for test_moe_update.py (run through tests/support/torchrun_utils.py, not collected by pytest).

The actor's update on the tiny Qwen3-MoE (4 experts, top-2, 2 layers; tests/support/tiny_models.py) with the
batch of the dense actor tests (`actor_steps.global_batch`: every loss term on) and the router's
load-balancing loss and z-loss on.

* `run_aux_reference` (1 process): the auxiliary losses alone (advantages 0, no entropy or KL term,
  so the policy loss has no gradient): Megatron's own definition of their gradient on a plain
  forward/backward of the GPTModel (no schedule, no actor: the router in Megatron's default mode,
  backward scale 1) against the actor's update with 1 micro-batch, and with the batch given twice in
  2 micro-batches (the mean over micro-batches is the same loss); coefficients 0 give no gradient.
* `run_layouts` (2 or 4 processes): one update per layout (EP, dispatcher, TP x SP) of the same data
  shares; gradients, weights after the step, and the metrics.
"""

from __future__ import annotations

from pathlib import Path

import torch

from tests.support.actor_steps import DP_SHARES, export_grads, export_weights, global_batch, make_config
from tests.support.torchrun_utils import reporting

AUX_COEFF = 0.01
Z_COEFF = 0.001
METRICS = ("grad_norm", "loss", "pg_loss", "moe_aux_loss", "moe_z_loss", "moe_load_ratio_mean", "moe_load_ratio_max", "tokens")


def moe_config(aux_only: bool = False, **sections):
    """`make_config` with both auxiliary losses on; `aux_only`: no entropy or KL term either."""
    sections["moe"] = {"aux_loss_coeff": AUX_COEFF, "z_loss_coeff": Z_COEFF, **sections.get("moe", {})}
    cfg = make_config(**sections)
    cfg.trainer.micro_batch_size = 7
    if aux_only:
        cfg.algorithm.entropy_coeff = 0.0
        cfg.algorithm.kl.use_kl_loss = False
    return cfg


def _build(model_dir: str, layout, cfg, sequence_parallel: bool = False):
    """`actor_steps.build_actor_for` with the config's MoE settings in the model."""
    from megatron_dapo.actor import build_actor
    from megatron_dapo.model.builder import build_gpt_models
    from megatron_dapo.model.hf_config import read_hf_config
    from megatron_dapo.model.load import load_hf_into_megatron

    hf_cfg = read_hf_config(model_dir)
    models = build_gpt_models(
        hf_cfg, layout, torch.float32, transformer_engine="off", init_weights=False, sequence_parallel=sequence_parallel,
        moe_token_dispatcher=cfg.moe.token_dispatcher, moe_aux_loss_coeff=cfg.moe.aux_loss_coeff,
        moe_z_loss_coeff=cfg.moe.z_loss_coeff,
    )  # fmt: skip
    load_hf_into_megatron(models, model_dir, hf_cfg)
    return build_actor(cfg, models, vocab_size=hf_cfg.vocab_size), hf_cfg


def _aux_only(batch):
    batch.advantages = torch.zeros_like(batch.advantages)
    return batch


def _megatron_reference_grads(model_dir: str, layout, batch) -> dict[str, torch.Tensor]:
    """d(aux_coeff * sum over layers of the load-balancing loss + z_coeff * z-loss)/dθ as Megatron
    defines it: one plain forward/backward of the whole batch as one micro-batch."""
    from megatron.core.transformer.moe.router import MoEAuxLossAutoScaler

    from megatron_dapo.actor.forward import model_forward

    cfg = moe_config(aux_only=True)
    actor, hf_cfg = _build(model_dir, layout, cfg)  # its routers are in Megatron's plain mode (actor.moe)
    (model,) = actor.models
    (micro_batch,) = actor.build_micro_batches(batch, actor.synchronised_plan(batch))
    model.train()
    model.zero_grad_buffer()
    MoEAuxLossAutoScaler.set_loss_scale(torch.ones(1))
    output = model_forward(model, micro_batch)
    (output.float().sum() * 0.0).backward()  # the main loss contributes nothing: only the routers' losses
    return export_grads(actor, hf_cfg)  # DDP's hooks put the gradients into its buffers (DP = 1)


def run_aux_reference(model_dir: str, out_dir: str) -> None:
    from tests.support.tiny_models import load_hf_model

    from megatron_dapo.distributed import ParallelLayout, init_distributed

    out: dict = {}
    with reporting(out):
        ctx = init_distributed(ParallelLayout(), timeout_s=240, seed=3)
        batch = _aux_only(global_batch(load_hf_model(Path(model_dir))))
        twice = batch.select(list(range(batch.num_sequences)) * 2)  # micro-batches of 7: the batch, then again
        saved = {"megatron": _megatron_reference_grads(model_dir, ctx.layout, batch)}
        runs = {"mb1": (batch, {}), "twice_mb2": (twice, {}),
                "zero_coeffs": (batch, {"moe": {"aux_loss_coeff": 0.0, "z_loss_coeff": 0.0}})}  # fmt: skip
        for name, (data, extra) in runs.items():
            cfg = moe_config(aux_only=True, **extra)
            actor, hf_cfg = _build(model_dir, ctx.layout, cfg)
            sums = actor.compute_gradients(data)
            saved[name] = export_grads(actor, hf_cfg)
            out[name] = {"micro_batches": actor._micro_batches_run, "tokens": float(sums[-2])}
        torch.save(saved, Path(out_dir) / "aux.pt")


def run_layouts(model_dir: str, out_dir: str, layouts: list) -> None:
    """For each layout {name, tp, ep, sp, dispatcher, dist_opt}: one update of this rank's DP share."""

    from tests.support.tiny_models import load_hf_model

    from megatron_dapo.distributed import ParallelLayout, init_distributed, teardown

    out: dict = {"layouts": {}}
    ctx = None
    with reporting(out):
        batch = global_batch(load_hf_model(Path(model_dir)))
        for spec in layouts:
            if ctx is not None:
                teardown(keep_process_group=True)
            parallel = ParallelLayout(tp=spec.get("tp", 1), ep=spec.get("ep", 1))
            ctx = init_distributed(parallel, timeout_s=240, seed=3)
            from megatron.core import parallel_state as ps

            dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
            share = batch.select(DP_SHARES[dp][dp_rank])
            cfg = moe_config(moe={"token_dispatcher": spec.get("dispatcher", "alltoall")},
                             parallel={"use_distributed_optimizer": spec.get("dist_opt", False), "ep": parallel.ep})  # fmt: skip
            actor, hf_cfg = _build(model_dir, ctx.layout, cfg, sequence_parallel=spec.get("sp", False))
            saved = {}
            sums = actor.compute_gradients(share)
            if not spec.get("dist_opt", False):
                saved["grads"] = export_grads(actor, hf_cfg)
            actor.optimizer.zero_grad()
            metrics = actor.update([share])
            saved["weights"] = export_weights(actor, hf_cfg)
            out["layouts"][spec["name"]] = {"metrics": {k: metrics.get(k) for k in METRICS}, "dp": dp, "tokens": float(sums[-2])}
            if ctx.rank == 0:
                torch.save(saved, Path(out_dir) / f"{spec['name']}.pt")
