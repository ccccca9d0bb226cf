"""Worker for the checkpoint resume tests (run through tests/torchrun_utils.py, not by pytest).

A deliberately small training loop on real Megatron parts: GPTModel chunks wrapped in Megatron DDP,
`get_megatron_optimizer` (Adam; the distributed optimizer unless told otherwise), Megatron's
`OptimizerParamScheduler` (warm-up then linear decay, so the learning rate differs every step) and
the pipeline schedule from `get_forward_backward_func`. The loss is the mean next-token cross
entropy over a fixed global batch of 4 sequences per step, split over data-parallel ranks and
micro-batches so that every layout computes the same global loss. Dropout is 0, so the losses are
a deterministic function of weights, optimizer state, scheduler state and step.

Steps are numbered from 1: "step k" runs forward/backward on batch k (its reported loss comes from
the weights before update k), then updates. The assertions live in the pytest files.
"""

from __future__ import annotations

import os
import random

import torch

from torchrun_utils import reporting

GLOBAL_BATCH = 4
SEQ_LEN = 16
VOCAB = 300
LR = 3e-3


def _batch(step: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ_LEN + 1), generator=torch.Generator().manual_seed(1000 + step))


def setup(model_dir: str, layout_spec: dict, distributed_optimizer: bool = True, load_hf: bool = True):
    """(ctx, models, optimizer, scheduler) for one layout, weights from the HF checkpoint."""
    from megatron_dapo.distributed import ParallelLayout, init_distributed

    layout = ParallelLayout(tp=layout_spec["tp"], pp=layout_spec["pp"], vpp=layout_spec.get("vpp"))
    ctx = init_distributed(layout, timeout_s=240, seed=5)
    models, optimizer, scheduler = build_training(model_dir, ctx.layout, distributed_optimizer, load_hf)
    return ctx, models, optimizer, scheduler


def build_training(model_dir: str, layout, distributed_optimizer: bool = True, load_hf: bool = True):
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    from megatron_dapo.model.builder import build_gpt_models
    from megatron_dapo.model.hf_config import read_hf_config
    from megatron_dapo.model.load import load_hf_into_megatron

    cfg = read_hf_config(model_dir)
    models = build_gpt_models(cfg, layout, torch.float32, transformer_engine="off", init_weights=not load_hf)
    if load_hf:
        load_hf_into_megatron(models, model_dir, cfg)
    config = models[0].config
    config.finalize_model_grads_func = finalize_model_grads
    ddp_config = DistributedDataParallelConfig(use_distributed_optimizer=distributed_optimizer)
    models = [DistributedDataParallel(config, ddp_config, m, disable_bucketing=i > 0) for i, m in enumerate(models)]
    optimizer = get_megatron_optimizer(
        OptimizerConfig(
            optimizer="adam", lr=LR, min_lr=LR / 10, weight_decay=0.01, clip_grad=1.0,
            use_distributed_optimizer=distributed_optimizer, params_dtype=torch.float32, bf16=False, fp16=False,
        ),
        models,
    )  # fmt: skip
    scheduler = OptimizerParamScheduler(
        optimizer, init_lr=0.0, max_lr=LR, min_lr=LR / 10, lr_warmup_steps=2, lr_decay_steps=10,
        lr_decay_style="linear", start_wd=0.01, end_wd=0.01, wd_incr_steps=10, wd_incr_style="constant",
    )  # fmt: skip
    return models, optimizer, scheduler


def train_step(models, optimizer, scheduler, step: int) -> float:
    """One optimizer step on batch `step`; returns the global mean loss (same on every rank)."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    from megatron_dapo.model.builder import causal_attention_mask

    dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    per_rank = GLOBAL_BATCH // dp
    tokens = _batch(step)[dp_rank * per_rank : (dp_rank + 1) * per_rank]
    micro = [(tokens[i : i + 1, :-1], tokens[i : i + 1, 1:]) for i in range(per_rank)]
    mask = causal_attention_mask(SEQ_LEN)
    position_ids = torch.arange(SEQ_LEN).unsqueeze(0)

    def forward_step(data_iterator, model):
        inputs, labels = next(data_iterator)
        output = model(inputs, position_ids, mask)

        def loss_func(logits):
            # Cross entropy over the real vocabulary only: Megatron's own loss also normalises over
            # the TP-dependent padding rows, which would make the loss differ between layouts.
            full = gather_from_tensor_model_parallel_region(logits)[..., :VOCAB].float()
            loss = torch.nn.functional.cross_entropy(full.reshape(-1, VOCAB), labels.t().reshape(-1))
            return loss, {"loss": loss.detach().clone()}  # clone: the schedule rescales `loss` in place

        return output, loss_func

    for model in models:
        model.zero_grad_buffer()
    optimizer.zero_grad()
    iterators = [iter(micro) for _ in models]
    results = get_forward_backward_func()(
        forward_step_func=forward_step,
        data_iterator=iterators if len(models) > 1 else iterators[0],
        model=models if len(models) > 1 else models[0],
        num_microbatches=per_rank,
        seq_length=SEQ_LEN,
        micro_batch_size=1,
        forward_only=False,
    )
    ok, _, _ = optimizer.step()
    assert ok, "optimizer step skipped"
    scheduler.step(increment=1)
    # Mean over micro-batches on the last stage, then over the whole world (last-stage ranks only).
    local = torch.stack([r["loss"] for r in results]).mean() if ps.is_pipeline_last_stage(ignore_virtual=True) else torch.zeros(())
    contributors = ps.get_tensor_model_parallel_world_size() * dp
    total = local.double().reshape(1)
    dist.all_reduce(total)
    return float(total.item() / contributors)


def _rng_draw() -> list[float]:
    import numpy as np

    return [random.random(), float(np.random.rand()), float(torch.rand(()).item())]


def train_and_save(model_dir: str, root: str, layout: dict, weights_root: str, local_root: str) -> dict:
    """Steps 1-2 (saving after each, keep_last=1), steps 3-4 (reference), then a save that fails mid-way.

    Before training, a model-only checkpoint (no optimizer / scheduler) goes to `weights_root`.
    Afterwards the same run with the non-distributed optimizer saves step 2 to `local_root`.
    """
    from megatron_dapo.checkpoint import core
    from megatron_dapo.checkpoint.core import CheckpointError, save_checkpoint

    out = {}
    with reporting(out):
        ctx, models, optimizer, scheduler = setup(model_dir, layout)
        save_checkpoint(weights_root, 0, models)
        losses = {}
        for step in (1, 2):
            losses[step] = train_step(models, optimizer, scheduler, step)
            save_checkpoint(root, step, models, optimizer, scheduler, keep_last=1, hf_dir=model_dir,
                            trainer_state={"next_step": step + 1, "losses": dict(losses)},
                            config={"layout": layout, "lr": LR})  # fmt: skip
        out["rng_after_save"] = _rng_draw()
        for step in (3, 4):
            losses[step] = train_step(models, optimizer, scheduler, step)
        out["losses"] = losses

        def failing_metadata(directory, metadata):
            raise RuntimeError("injected failure while writing metadata.json")

        original = core._write_checkpoint_metadata
        core._write_checkpoint_metadata = failing_metadata
        try:
            save_checkpoint(root, 4, models, optimizer, scheduler, keep_last=1)
            out["failed_save"] = "no error"
        except (RuntimeError, CheckpointError) as err:
            out["failed_save"] = f"{type(err).__name__}: {err}"
        finally:
            core._write_checkpoint_metadata = original

        models, optimizer, scheduler = build_training(model_dir, ctx.layout, distributed_optimizer=False)
        local_losses = {}
        for step in (1, 2, 3, 4):
            local_losses[step] = train_step(models, optimizer, scheduler, step)
            if step == 2:
                save_checkpoint(local_root, step, models, optimizer, scheduler)
        out["local_losses"] = local_losses
        out["rank"] = ctx.rank


def resume_then_crash(model_dir: str, root: str) -> None:
    """Single process (TP=PP=DP=1): resume from `root`, one step, then die half-way through saving step 3."""
    from megatron_dapo.checkpoint import core
    from megatron_dapo.checkpoint.core import load_checkpoint, save_checkpoint
    from torchrun_utils import write_rank_result

    _, models, optimizer, scheduler = setup(model_dir, {"tp": 1, "pp": 1})
    loaded = load_checkpoint(root, models, optimizer, scheduler)
    loss3 = train_step(models, optimizer, scheduler, 3)
    write_rank_result({"step": loaded.step, "loss3": loss3, "notes": loaded.notes, "rng_restored": loaded.rng_restored})

    def die(directory, metadata):
        os._exit(17)  # the process vanishes: no exception handler, no clean-up

    core._write_checkpoint_metadata = die
    save_checkpoint(root, 3, models, optimizer, scheduler, keep_last=1)


def resume_layouts(model_dir: str, root: str, layouts: list, qwen3_dir: str, weights_only_dir: str, local_root: str) -> None:
    """For each layout: fresh model + optimizer, load the latest checkpoint, steps 3-4. Then error cases.

    A layout with "distributed_optimizer": False resumes the non-distributed run from `local_root`.
    """
    from megatron_dapo.checkpoint.core import load_checkpoint
    from megatron_dapo.checkpoint.torch_dist import CheckpointMismatchError
    from megatron_dapo.distributed import teardown

    out: dict = {"layouts": {}}
    with reporting(out):
        for index, spec in enumerate(layouts):
            if index:
                teardown(keep_process_group=True)
            ctx, models, optimizer, scheduler = setup(
                model_dir, spec, distributed_optimizer=spec.get("distributed_optimizer", True), load_hf=False
            )
            source = root if spec.get("distributed_optimizer", True) else local_root
            loaded = load_checkpoint(source, models, optimizer, scheduler, load_optimizer=spec.get("load_optimizer", True))
            entry = {
                "step": loaded.step,
                "path": str(loaded.path),
                "rng_restored": loaded.rng_restored,
                "rng_draw": _rng_draw(),
                "scheduler_loaded": loaded.scheduler_loaded,
                "optimizer_loaded": loaded.optimizer_loaded,
                "notes": loaded.notes,
                "trainer_state": loaded.trainer_state,
                "config": loaded.metadata.get("config"),
                "losses": {},
            }
            for step in (3, 4):
                entry["losses"][step] = train_step(models, optimizer, scheduler, step)
            out["layouts"][spec["name"]] = entry

        # Error cases at the last layout.
        errors = {}
        models, optimizer, _ = build_training(qwen3_dir, ctx.layout, load_hf=False)
        try:
            load_checkpoint(root, models, optimizer)
        except CheckpointMismatchError as err:
            errors["other_model"] = str(err)
        models, optimizer, _ = build_training(model_dir, ctx.layout, distributed_optimizer=True, load_hf=False)
        try:
            load_checkpoint(weights_only_dir, models, optimizer)
        except CheckpointMismatchError as err:
            errors["no_optimizer_state"] = str(err)
        loaded = load_checkpoint(weights_only_dir, models, optimizer, load_optimizer=False)
        errors["weights_only_step"] = loaded.step
        models, optimizer, _ = build_training(model_dir, ctx.layout, distributed_optimizer=False, load_hf=False)
        try:
            load_checkpoint(root, models, optimizer)
        except CheckpointMismatchError as err:
            errors["optimizer_kind"] = str(err)
        out["errors"] = errors
