"""Debugging aids: full-vocabulary logits from Megatron, and a layer-by-layer comparison with HF.

    logits = megatron_logits(models, input_ids)            # [b, s, vocab] on every rank
    report = compare_with_hf(models, hf_model, input_ids)
    print(report.summary())   # "first divergence at layer 3 (decoder.layers.3): max |diff| 2.1e-2 ..."

Both run the whole batch through Megatron's own pipeline schedule (forward only), so they work for
any TP/PP/VPP layout, and both gather full-vocabulary logits: fine for tiny models and tests, not
for production batch sizes (the actor computes vocab-parallel log-probs without gathering).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

from megatron_dapo.model.builder import attention_mask_for, unwrap_model
from megatron_dapo.distributed.context_parallel import (
    cp_pad_multiple,
    gather_sequence_keep_slice,
    padded_length,
    split_for_cp_rank,
)

__all__ = ["BlockDiff", "DivergenceReport", "compare_with_hf", "megatron_logits"]


def _last_stage_rank_and_group():
    group = ps.get_pipeline_model_parallel_group()
    ranks = dist.get_process_group_ranks(group)
    return ranks[-1], group


@torch.no_grad()
def megatron_logits(
    models: Sequence[torch.nn.Module],
    input_ids: torch.Tensor,
    vocab_size: Optional[int] = None,
    micro_batch_size: int = 1,
    broadcast: bool = True,
) -> Optional[torch.Tensor]:
    """Full-vocabulary logits [b, s, V] of a causal forward over `input_ids` [b, s].

    Uses Megatron's `get_forward_backward_func()` with forward_only=True (pipeline-aware), gathers
    the vocab-parallel logits over the TP group on the last stage and drops the vocabulary padding
    (`vocab_size`, default: no trimming). With `broadcast`, every pipeline stage gets the result;
    otherwise non-last stages return None. Tiny models / tests only: the full logits are gathered.
    """
    models = list(models)
    was_training = [model.training for model in models]
    for model in models:
        model.eval()
    device = next(models[0].parameters()).device
    input_ids = input_ids.to(device)
    batch, seq_len = input_ids.shape
    if batch % micro_batch_size != 0:
        raise ValueError(f"batch {batch} is not a multiple of micro_batch_size {micro_batch_size}")
    num_micro = batch // micro_batch_size
    cp_size = ps.get_context_parallel_world_size()
    if cp_size > 1:
        # Context parallelism: right-pad to the chunk multiple, keep this rank's 2 of the 2*CP chunks;
        # the attention is causal by itself (no mask), the logits are gathered back below.
        config = models[0].config
        multiple = cp_pad_multiple(cp_size, config.tensor_model_parallel_size, config.sequence_parallel)
        padding = padded_length(seq_len, multiple) - seq_len
        input_ids = torch.nn.functional.pad(input_ids, (0, padding))
        input_ids = split_for_cp_rank(input_ids, 1, cp_size, ps.get_context_parallel_rank())
        mask = None
    else:
        mask = attention_mask_for(models[0], seq_len, device)
    position_ids = torch.arange(input_ids.shape[1], device=device).unsqueeze(0).expand(micro_batch_size, -1)
    micro_batches = [input_ids[i * micro_batch_size : (i + 1) * micro_batch_size] for i in range(num_micro)]

    def forward_step(data_iterator, model):
        tokens = next(data_iterator)
        output = model(tokens, position_ids, mask)

        def collect(output_tensor, non_loss_data=False):
            return output_tensor

        return output, collect

    iterators = [iter(micro_batches) for _ in models]
    outputs = get_forward_backward_func()(
        forward_step_func=forward_step,
        data_iterator=iterators if len(models) > 1 else iterators[0],
        model=models if len(models) > 1 else models[0],
        num_microbatches=num_micro,
        seq_length=input_ids.shape[1] * cp_size,
        micro_batch_size=micro_batch_size,
        forward_only=True,
        collect_non_loss_data=True,
    )
    for model, training in zip(models, was_training):
        model.train(training)
    result = None
    if ps.is_pipeline_last_stage(ignore_virtual=True):
        logits = torch.cat([gather_from_tensor_model_parallel_region(o) for o in outputs], dim=0)
        if cp_size > 1:
            logits = gather_sequence_keep_slice(logits, 1, ps.get_context_parallel_group())[:, :seq_len]
        result = logits[..., :vocab_size] if vocab_size is not None else logits
    if broadcast and ps.get_pipeline_model_parallel_world_size() > 1:
        src, group = _last_stage_rank_and_group()
        meta = [(list(result.shape), result.dtype) if result is not None else None]
        dist.broadcast_object_list(meta, src=src, group=group)
        if result is None:
            result = torch.empty(meta[0][0], dtype=meta[0][1], device=device)
        result = result.contiguous()
        dist.broadcast(result, src=src, group=group)
    return result


# ---------------------------------------------------------------------------------------------
# Layer-by-layer comparison with HF
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class BlockDiff:
    """Max |Megatron - HF| at the output of one block."""

    label: str
    """"embedding", "layer 3", "logits"."""
    megatron_name: str
    max_abs_diff: float


@dataclass
class DivergenceReport:
    blocks: list[BlockDiff]
    tol: float
    first_divergence: Optional[BlockDiff] = field(default=None)

    def summary(self) -> str:
        """One line: the first block beyond tolerance and what matched before it."""
        layers = [b for b in self.blocks if b.label.startswith("layer ")]
        if self.first_divergence is None:
            worst = max((b.max_abs_diff for b in self.blocks), default=0.0)
            return f"all {len(self.blocks)} blocks match (embedding, {len(layers)} layers, logits): max |diff| {worst:.1e} (tol {self.tol:.0e})"
        bad = self.first_divergence
        head = f"first divergence at {bad.label} ({bad.megatron_name}): max |diff| {bad.max_abs_diff:.1e} (tol {self.tol:.0e})"
        if bad.label.startswith("layer "):
            index = int(bad.label.split()[1])
            head += f"; layers 0-{index - 1} match" if index > 0 else "; the embedding matches"
        elif bad.label == "logits":
            head += f"; all {len(layers)} layers match"
        return head


@torch.no_grad()
def compare_with_hf(
    models: Sequence[torch.nn.Module],
    hf_model: torch.nn.Module,
    input_ids: torch.Tensor,
    tol: float = 1e-5,
    vocab_size: Optional[int] = None,
) -> DivergenceReport:
    """Run Megatron and HF on `input_ids` and compare the embedding, every decoder layer and the logits.

    The HF model is run on every rank (tiny models only); each pipeline stage compares the layers
    it holds, using Megatron's own global layer numbers, and the stages share their results, so
    every rank returns the same report.
    """
    hf_model.eval()
    vocab_size = vocab_size or hf_model.config.vocab_size
    chunks = [unwrap_model(m) for m in models]
    # --- HF reference, captured with forward hooks on the embedding and each decoder layer.
    hf_out: dict[str, torch.Tensor] = {}

    def hf_hook(label):
        def hook(module, args, output):
            hf_out[label] = (output[0] if isinstance(output, tuple) else output).detach().float().cpu()

        return hook

    handles = [hf_model.model.embed_tokens.register_forward_hook(hf_hook("embedding"))]
    for i, layer in enumerate(hf_model.model.layers):
        handles.append(layer.register_forward_hook(hf_hook(f"layer {i}")))
    try:
        hf_logits = hf_model(input_ids=input_ids).logits.detach().float().cpu()
    finally:
        for h in handles:
            h.remove()

    # --- Megatron, captured on this stage's modules (outputs are [s, b, h]; batch-first below).
    mg_out: dict[str, list[torch.Tensor]] = {}
    mg_names: dict[str, str] = {}

    def mg_hook(label, name):
        def hook(module, args, output):
            tensor = output[0] if isinstance(output, tuple) else output
            mg_out.setdefault(label, []).append(tensor.detach().float().cpu().transpose(0, 1))
            mg_names[label] = name

        return hook

    pp_rank, pp = ps.get_pipeline_model_parallel_rank(), ps.get_pipeline_model_parallel_world_size()
    handles = []
    for chunk_index, chunk in enumerate(chunks):
        if chunk.pre_process:
            handles.append(chunk.embedding.register_forward_hook(mg_hook("embedding", "embedding")))
        where = ""
        if pp > 1:
            where = f" on pipeline stage {pp_rank}" + (f" chunk {chunk_index}" if len(chunks) > 1 else "")
        for local, layer in enumerate(chunk.decoder.layers):
            index = layer.layer_number - 1  # Megatron's global (1-based) layer number
            handles.append(layer.register_forward_hook(mg_hook(f"layer {index}", f"decoder.layers.{local}{where}")))
    try:
        logits = megatron_logits(models, input_ids, vocab_size=vocab_size)
    finally:
        for h in handles:
            h.remove()

    diffs = {}
    for label, parts in mg_out.items():
        diffs[label] = (mg_names[label], float((torch.cat(parts, dim=0) - hf_out[label]).abs().max()))
    if ps.is_pipeline_last_stage(ignore_virtual=True):
        diffs["logits"] = ("output_layer", float((logits.float().cpu() - hf_logits).abs().max()))
    if dist.is_initialized() and ps.get_pipeline_model_parallel_world_size() > 1:
        gathered: list = [None] * ps.get_pipeline_model_parallel_world_size()
        dist.all_gather_object(gathered, diffs, group=ps.get_pipeline_model_parallel_group())
        for part in gathered:
            diffs.update(part)

    order = ["embedding"] + [f"layer {i}" for i in range(len(hf_model.model.layers))] + ["logits"]
    missing = [label for label in order if label not in diffs]
    if missing:
        raise RuntimeError(f"no Megatron output captured for {missing}")
    blocks = [BlockDiff(label, diffs[label][0], diffs[label][1]) for label in order]
    first = next((b for b in blocks if not b.max_abs_diff <= tol), None)  # NaN counts as divergent
    return DivergenceReport(blocks=blocks, tol=tol, first_divergence=first)
