"""Megatron DDP, the Megatron optimizer and the learning-rate schedule for the actor.

    models = prepare_for_training(models, use_distributed_optimizer=True)   # config flags + Megatron DDP
    optimizer = build_optimizer(models, cfg.optimizer, use_distributed_optimizer=True)
    scheduler = build_scheduler(optimizer, cfg.optimizer, total_steps=cfg.trainer.total_steps)

How the exact global token-mean survives Megatron (checked in megatron-core 0.16.1 and in the
core_r0.19.0 branch of NVIDIA/Megatron-LM, where the same code paths hold):

* ``schedules.forward_step_calc_loss``: when the loss function returns a 3-tuple
  ``(loss, num_tokens, reduced)``, the loss is divided by ``num_tokens`` and by the number of
  micro-batches UNLESS ``config.calculate_per_token_loss`` is True. (A 2-tuple is always divided by
  the number of micro-batches and multiplied by the CP size.) We set the flag and return a 3-tuple
  whose loss is already normalised by the GLOBAL token / sequence counts.
* ``DistributedDataParallel.__init__``: with ``calculate_per_token_loss`` the gradient buffers get
  ``gradient_scaling_factor = 1.0`` and the DP all-reduce / reduce-scatter SUMS instead of
  averaging (it also asserts ``average_in_collective`` is off). So the flag must be set BEFORE the
  models are wrapped in DDP.
* the schedules call ``config.finalize_model_grads_func(models, total_num_tokens, pg_collection=...,
  force_all_reduce=...)``, passing the summed token count when ``calculate_per_token_loss`` is on;
  Megatron's ``finalize_model_grads`` then broadcasts it over PP, all-reduces it over DP x CP and
  divides every gradient by it. Our losses are normalised already, so `finalize_grads_without_scaling`
  calls ``finalize_model_grads(models, num_tokens=None, ...)``: the DP reduction, the TP all-reduce
  of replicated (layer-norm) gradients and the PP all-reduce of tied embeddings happen, the division
  does not.

Net effect: the gradient is the sum over DP ranks and micro-batches of d(loss_mb)/dtheta, i.e. the
gradient of the exact mini-batch loss; tests/actor compares it with a single-process run and with
a hand-written loss on the HF model.

Learning rate: Megatron's ``OptimizerParamScheduler`` with a linear warm-up from 0 over
``optimizer.warmup_steps`` and the ``constant`` decay style. We use Megatron's scheduler (not our
own) because it also applies the per-group weight decay multipliers Megatron's optimizer relies on
(``wd_mult = 0`` for biases and norms) and checkpoints with the optimizer. One convention differs
from Megatron's training loop, which steps the scheduler AFTER ``optimizer.step()`` so that the
first update runs at the initial (zero) warm-up learning rate: `MegatronActor.update` advances it
BEFORE the updates of a rollout step, so rollout step ``k`` (1-based) trains at
``lr * min(1, k / warmup_steps)`` and no step is wasted at lr 0.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import torch
from megatron.core import parallel_state as ps
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
from megatron.core.optimizer import OptimizerConfig as MegatronOptimizerConfig, get_megatron_optimizer
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

from megatron_dapo.model.builder import mark_tensor_parallel_weights as ensure_tensor_parallel_attributes
from megatron_dapo.model.builder import announce_once
from megatron_dapo.model.gpu_kernels import apex_fused_wgrad_status, gradient_options, transformer_engine_status

__all__ = [
    "announce_gradient_options",
    "build_optimizer",
    "ensure_tensor_parallel_attributes",
    "build_scheduler",
    "finalize_grads_without_scaling",
    "megatron_optimizer_config",
    "prepare_for_training",
    "prepare_transformer_config",
    "resolve_overlap_grad_reduce",
]


def finalize_grads_without_scaling(
    models: list[torch.nn.Module], num_tokens: Optional[torch.Tensor] = None, **kwargs: Any
) -> None:
    """Megatron's ``finalize_model_grads`` minus the division by the token count (see module doc).

    ``num_tokens`` is what the schedule summed from our loss function; it is deliberately ignored
    because every micro-batch loss is already divided by the global count.
    """
    finalize_model_grads(models, None, **kwargs)


def prepare_transformer_config(config: Any, pipeline_parallel_size: int, model_chunks: int = 1) -> None:
    """Flags every actor / reference forward needs on a model's ``TransformerConfig``.

    Micro-batches have varying shapes (token budget, trimmed padding), so with pipeline parallelism
    stages must exchange tensor shapes before each transfer (``variable_seq_lengths``).

    With interleaving (several chunks per rank) at pipeline size 2, the previous and the next stage
    are the same peer, and Megatron's batched shape exchange posts two sends and two receives to it
    in an order that pairs them crosswise (tagless point-to-point matches FIFO): activations get the
    gradient's shape and training breaks (NVIDIA/Megatron-LM issue #1450; unfixed in 0.16.1, in the
    core_r0.19.0 branch and on main at the time of writing). Splitting forward and backward
    communication in the steady state (``overlap_p2p_comm=True, batch_p2p_comm=False``, as verl
    does) avoids the simultaneous bidirectional exchange; we use it for every interleaved run.
    """
    if pipeline_parallel_size > 1:
        config.variable_seq_lengths = True
    if pipeline_parallel_size > 1 and model_chunks > 1:
        config.overlap_p2p_comm = True
        config.batch_p2p_comm = False


def resolve_overlap_grad_reduce(overlap_grad_reduce: Optional[bool], device: torch.device) -> bool:
    """``overlap_grad_reduce`` for models on ``device``: None decides (on with CUDA, `gpu_kernels.gradient_options`)."""
    return gradient_options(device.type, False, False, overlap_grad_reduce=overlap_grad_reduce).overlap_grad_reduce


def prepare_for_training(
    models: Sequence[torch.nn.Module],
    use_distributed_optimizer: bool,
    overlap_grad_reduce: Optional[bool] = None,
) -> list[torch.nn.Module]:
    """Set the per-token-loss flags on the models' config and wrap every chunk in Megatron DDP.

    Must run before the optimizer is built (the optimizer reads the DDP gradient buffers).
    ``overlap_grad_reduce``: None decides from the models' device (on with CUDA). When on, the
    schedules get Megatron's hooks as its own trainer sets them (``training.py``, with its default
    ``align_grad_reduce``): ``no_sync_func`` keeps every micro-batch but the last from reducing, and
    ``grad_sync_func`` lets the pipeline schedules start a chunk's reduction when its last backward
    is done; ``finalize_model_grads`` then waits for the reductions (``finish_grad_sync``).
    """
    models = list(models)
    config = models[0].config
    if any(m.config is not config for m in models):
        raise ValueError("all model chunks must share one TransformerConfig (build them together)")
    ensure_tensor_parallel_attributes(models)  # before DDP and the optimizer read them
    config.calculate_per_token_loss = True  # BEFORE DDP: makes it sum gradients (module doc)
    config.finalize_model_grads_func = finalize_grads_without_scaling
    prepare_transformer_config(config, ps.get_pipeline_model_parallel_world_size(), len(models))
    overlap_grad_reduce = resolve_overlap_grad_reduce(overlap_grad_reduce, next(models[0].parameters()).device)
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True,
        overlap_grad_reduce=overlap_grad_reduce,
        use_distributed_optimizer=use_distributed_optimizer,
        average_in_collective=False,
    )
    wrapped = [
        DistributedDataParallel(
            config,
            ddp_config,
            model,
            # Like Megatron's training loop: only the first chunk's buckets overlap with backward.
            disable_bucketing=index > 0,
        )
        for index, model in enumerate(models)
    ]
    if overlap_grad_reduce:
        no_sync = [m.no_sync for m in wrapped]
        config.no_sync_func = no_sync[0] if len(no_sync) == 1 else no_sync
        grad_sync = [m.start_grad_sync for m in wrapped]
        config.grad_sync_func = grad_sync[0] if len(grad_sync) == 1 else grad_sync
    return wrapped


def announce_gradient_options(wrapped: Sequence[torch.nn.Module]) -> str:
    """Print (once, rank 0) how gradients are reduced and accumulated, as DDP and the layers were built."""
    device = next(wrapped[0].parameters()).device
    cuda = device.type == "cuda"
    decided = gradient_options(
        device.type,
        cuda and transformer_engine_status().available,
        cuda and apex_fused_wgrad_status().available,
        overlap_grad_reduce=bool(wrapped[0].ddp_config.overlap_grad_reduce),
        gradient_accumulation_fusion=bool(wrapped[0].config.gradient_accumulation_fusion),
    )
    announce_once(decided.describe())
    return decided.describe()


def megatron_optimizer_config(optimizer_cfg: Any, dtype: torch.dtype, use_distributed_optimizer: bool):
    """Megatron's ``OptimizerConfig`` (AdamW) from our `config.OptimizerConfig`."""
    return MegatronOptimizerConfig(
        optimizer="adam",
        lr=optimizer_cfg.lr,
        min_lr=optimizer_cfg.lr,
        weight_decay=optimizer_cfg.weight_decay,
        adam_beta1=optimizer_cfg.adam_beta1,
        adam_beta2=optimizer_cfg.adam_beta2,
        adam_eps=optimizer_cfg.adam_eps,
        clip_grad=optimizer_cfg.grad_clip,
        use_distributed_optimizer=use_distributed_optimizer,
        bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16,
        params_dtype=dtype,
    )


def build_optimizer(models: Sequence[torch.nn.Module], optimizer_cfg: Any, use_distributed_optimizer: bool):
    """``get_megatron_optimizer`` over the DDP-wrapped chunks; installs its loss scaling on the config."""
    models = list(models)
    config = models[0].config
    optimizer = get_megatron_optimizer(
        megatron_optimizer_config(optimizer_cfg, config.params_dtype, use_distributed_optimizer), models
    )
    config.grad_scale_func = optimizer.scale_loss  # fp16 loss scaling; 1.0 for bf16 / fp32
    return optimizer


def build_scheduler(optimizer: Any, optimizer_cfg: Any, total_steps: int):
    """Megatron's ``OptimizerParamScheduler``: linear warm-up from 0 over ``warmup_steps``, then constant.

    Step it once per rollout step, before that step's updates (see the module docstring).
    """
    warmup = int(optimizer_cfg.warmup_steps)
    steps = max(int(total_steps), warmup + 1)  # Megatron asserts warm-up < decay steps
    return OptimizerParamScheduler(
        optimizer,
        init_lr=0.0,
        max_lr=optimizer_cfg.lr,
        min_lr=optimizer_cfg.lr,
        lr_warmup_steps=warmup,
        lr_decay_steps=steps,
        lr_decay_style="constant",
        start_wd=optimizer_cfg.weight_decay,
        end_wd=optimizer_cfg.weight_decay,
        wd_incr_steps=steps,
        wd_incr_style="constant",
    )
