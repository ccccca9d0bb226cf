"""Micro-batches through Megatron's pipeline schedule, and per-token log-probs from vocab-parallel logits.

    outputs = run_schedule(models, micro_batches, forward_step, forward_only=True)

`run_schedule` is the one place that calls ``get_forward_backward_func()`` (no pipelining, 1F1B, or
interleaved 1F1B when the rank holds several virtual-pipeline chunks). `response_log_probs` turns
the last stage's ``[rows, S, V/tp]`` logits into ``[k, W]`` log-probs of the response tokens using
`model.logprobs.token_log_probs_and_entropy`, which never gathers the vocabulary.
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps
from megatron.core.pipeline_parallel import get_forward_backward_func

from megatron_dapo.actor.batch import MicroBatch
from megatron_dapo.model.logprobs import token_log_probs_and_entropy
from megatron_dapo.distributed.context_parallel import gather_sequence_keep_slice

__all__ = [
    "broadcast_from_last_stage",
    "is_last_stage",
    "model_forward",
    "response_log_probs",
    "run_schedule",
]


def is_last_stage() -> bool:
    """Whether this rank holds the last pipeline stage (where the logits are)."""
    return ps.is_pipeline_last_stage(ignore_virtual=True)


def model_forward(model: torch.nn.Module, micro_batch: MicroBatch) -> torch.Tensor:
    """One model chunk on one micro-batch: logits ``[rows, S, V/tp]`` on the last stage, else hidden states."""
    kwargs = {}
    if micro_batch.packed_seq_params is not None:
        kwargs["packed_seq_params"] = micro_batch.packed_seq_params
    return model(micro_batch.input_ids, micro_batch.position_ids, micro_batch.attention_mask, **kwargs)


def response_log_probs(
    logits: torch.Tensor,
    micro_batch: MicroBatch,
    vocab_size: int,
    temperature: float = 1.0,
    compute_entropy: bool = True,
    chunk_size: int = 4096,
) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Log-probs (and entropy) of the micro-batch's response tokens, ``[k, W]``, 0 past each response.

    ``logits`` is this tensor-parallel rank's vocabulary shard ``[rows, S, V_padded/tp]``; columns at ids
    ``>= vocab_size`` (Megatron's vocabulary padding) are excluded from the softmax. Under context
    parallelism ``S`` is this rank's ``S/CP`` positions and the per-token values are all-gathered over
    the CP group (``micro_batch.context_parallel``). Differentiable.
    """
    if temperature != 1.0:
        logits = logits / temperature  # the distribution the rollout engine sampled from
    log_probs, entropy = token_log_probs_and_entropy(
        logits,
        micro_batch.labels.to(logits.device),
        tp_group=ps.get_tensor_model_parallel_group(),
        chunk_size=chunk_size,
        compute_entropy=compute_entropy,
        vocab_size=vocab_size,
    )
    if micro_batch.context_parallel > 1:
        # This rank holds 2 of the 2*CP sequence chunks: gather the per-token values into full order.
        # Every CP rank then computes the same loss; backward keeps this rank's slice (its tokens'
        # gradients are complete there, so summing over CP would count them CP times).
        group = ps.get_context_parallel_group()
        log_probs = gather_sequence_keep_slice(log_probs, 1, group)
        entropy = gather_sequence_keep_slice(entropy, 1, group) if entropy is not None else None
    # GPTModel returns [b, s, V/tp] (it transposes Megatron's [s, b] at the end, in 0.16 and 0.19), the
    # layout of `labels` and of the flat positions in `gather_index`.
    index = micro_batch.gather_index.to(logits.device)
    valid = micro_batch.response_valid.to(logits.device)
    # Indexing the flat per-token values: backward scatters into the gathered positions only.
    picked = torch.where(valid, log_probs.reshape(-1)[index], 0.0)
    picked_entropy = torch.where(valid, entropy.reshape(-1)[index], 0.0) if entropy is not None else None
    return picked, picked_entropy


def run_schedule(
    models: Sequence[torch.nn.Module],
    micro_batches: Sequence[MicroBatch],
    forward_step: Callable[[Any, torch.nn.Module], tuple[torch.Tensor, Callable]],
    forward_only: bool,
    collect_non_loss_data: bool = False,
) -> list:
    """Run Megatron's forward(-backward) schedule for this rank's model chunks over ``micro_batches``.

    Every chunk gets its own iterator over the same micro-batches (with interleaving, each virtual
    stage reads every micro-batch: the first for the tokens, all for the attention mask, the last
    for the labels). Returns Megatron's ``forward_data_store`` (filled on the last stage only).
    """
    if not micro_batches:
        raise ValueError("run_schedule needs at least one micro-batch (use an empty one to stay in step)")
    models = list(models)
    iterators = [iter(micro_batches) for _ in models]
    return get_forward_backward_func()(
        forward_step_func=forward_step,
        data_iterator=iterators if len(models) > 1 else iterators[0],
        model=models if len(models) > 1 else models[0],
        num_microbatches=len(micro_batches),
        # Shapes vary per micro-batch; with PP the stages exchange them (variable_seq_lengths), so
        # these two only matter to schedules that ignore them.
        seq_length=max(mb.seq_length * mb.context_parallel for mb in micro_batches),
        micro_batch_size=max(mb.rows for mb in micro_batches),
        forward_only=forward_only,
        collect_non_loss_data=collect_non_loss_data,
    )


def broadcast_from_last_stage(tensor: torch.Tensor) -> torch.Tensor:
    """Give every pipeline stage the last stage's ``tensor`` (same shape and dtype on every rank)."""
    if ps.get_pipeline_model_parallel_world_size() == 1:
        return tensor
    group = ps.get_pipeline_model_parallel_group()
    tensor = tensor.contiguous()
    dist.broadcast(tensor, src=ps.get_pipeline_model_parallel_last_rank(), group=group)
    return tensor
