"""Activation bytes the actor update keeps for backward, per token of a micro-batch, on one rank of
each pipeline stage.

Per transformer layer (bf16, flash attention: no [seq x seq] scores, packed THD sequences, no
dropout), with s = TP under sequence parallelism else 1:
  norm inputs 2 x 2h/s, QKV- and FC1-inputs 2 x 2h/s, Q/K/V 2(a + 2g)d/TP, attention output
  2ad/TP, SwiGLU input (gate and up) 4f/TP, SwiGLU output 2f/TP.
This is the per-layer count of Korthikanti et al. 2022 (arXiv 2205.05198, Table 2, the one
Megatron's formula implements) redone for this architecture: grouped-query K/V (Megatron assumes
K and V as large as Q), a gated MLP (Megatron assumes a plain one: 4f instead of 6f), no dropout
masks (Megatron counts 2h bytes of them), flash attention's softmax statistics (fp32, a per head
and token) ignored. `layer_activation_bytes_per_token(..., gated_mlp=False, dropout_masks=True)`
on a multi-head model reproduces Megatron's per-layer numbers exactly (tests check that).
Not verified on a GPU here (no Transformer Engine on the machines these tests run on). The
SwiGLU count is Megatron's fused bias-SwiGLU (used with TE on GPU), which saves only its input;
with `model.transformer_engine=off` the unfused path also keeps silu(gate), 2f/TP more. And if
the attention kernel kept V as a view of the fused QKV output instead of a copy, that whole output
(2(a + 2g)d/TP) would stay alive next to the rotated Q and K, about 6% more per layer for
Qwen2.5-7B. The planner's reserve is meant to absorb differences of this size.

Pipeline: with 1F1B stage r keeps PP - r micro-batches in flight (interleaved: Megatron's warm-up
count, so stage 0 keeps PP x (1 + (PP - 1) / (PP x VPP)) micro-batches' worth, Megatron's factor);
we assume at least PP micro-batches per mini-batch, the worst case. Full recompute (Megatron's
"full"/"uniform", one layer per checkpoint) keeps only each layer's input (2h/s per token) plus
one layer recomputed in full during its backward. The first stage also keeps the token ids (8 B),
the last the output side: final-norm input and output-layer input (2 x 2h/s), the bf16 logits
shard and its gradient (2 x 2V/TP: `model/logprobs.py` saves the logits by reference and builds
one gradient of the same size), plus two fp32 [chunk x V/TP] buffers of the chunked log-prob
(a fixed amount, `LOGPROB_CHUNK_TOKENS`); a temperature other than 1 adds one more logits copy.

Context parallelism: a rank computes 1/CP of each sequence, so the per-token figures are per token a
rank computes and a micro-batch holds CP times the budget in sequence tokens.

Mixtures of experts (Megatron's MoE layer, routing balanced over the experts): attention and the
four h-wide inputs are as above; the dense MLP's terms give way to
  router scores 6E/s (the fp32 softmax over all E experts the load-balancing loss keeps, the bf16
  routing probabilities); the experts' input rows, top-k per token, 2h each: the permuted tokens as
  the experts' first linear keeps them, after the token dispatcher's all-to-all over EP and its
  gather over expert-TP (= TP), so every rank of an EP x TP grid holds top-k rows per token of its
  micro-batch whatever EP and TP are; per row the gate/up output 4I/TP and the activation times the
  routing probability 2I/TP (I = moe_intermediate_size; Megatron applies the probabilities inside
  the experts: 4 bytes of them per row), the unfused local path also silu(gate) and the product
  before the probabilities (4I/TP); and Qwen2-MoE's shared expert as a SwiGLU of its width.
While a layer runs, its token dispatcher also holds the permuted tokens going to the experts and
the experts' outputs coming back (in and out: 2 x top-k rows x 2h per token), counted once per stage
like the recomputed layer (`dispatch_buffer_bytes_per_token`); the allgather dispatcher gathers
the hidden states of the whole EP x TP group besides (EP rows per token, in and out). A rank whose
experts draw more than their share of the tokens holds more: Megatron sets no capacity factor.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

from megatron_dapo.plan.parameters import model_dims, padded_vocab

if TYPE_CHECKING:  # megatron_dapo.model imports torch: kept out of `megatron-dapo --help`
    from megatron_dapo.model.hf_config import HFModelConfig

LOGPROB_CHUNK_TOKENS = 4096
"""Tokens per fp32 chunk of the vocab-parallel log-prob (the actor's `logprob_chunk_size` default)."""
TOKEN_ID_BYTES = 8
"""int64 token ids kept per in-flight micro-batch on the first stage."""
ROUTER_BYTES_PER_EXPERT = 6
"""Per token and expert, what an MoE layer's router keeps: the fp32 softmax of the load-balancing loss
and the bf16 routing probabilities."""
ROUTING_PROBABILITY_BYTES = 4
"""The fp32 routing probability of each expert input row, which the experts multiply their activation by."""


def _sequence_split(tp: int, sequence_parallel: bool) -> int:
    return tp if sequence_parallel and tp > 1 else 1


def layer_activation_bytes_per_token(
    model: HFModelConfig,
    tp: int,
    sequence_parallel: bool,
    *,
    gated_mlp: bool = True,
    dropout_masks: bool = False,
    fused_swiglu: bool = True,
) -> float:
    """Bytes one transformer layer keeps for backward, per token (see the module docstring).

    `fused_swiglu=False` (no Transformer Engine: Megatron's unfused SwiGLU) adds silu(gate), 2f/TP.

    `gated_mlp=False, dropout_masks=True` switch to the assumptions of Korthikanti et al. /
    Megatron's theoretical formula (a plain MLP, 1-byte dropout masks after attention and MLP),
    which the tests use to check this count against Megatron's.
    """
    h, a, g, d, f = model_dims(model)
    s = _sequence_split(tp, sequence_parallel)
    replicated = 4 * 2 * h / s  # inputs of the two norms, of the QKV projection and of FC1 (MoE: router, shared expert)
    if dropout_masks:
        replicated += 2 * h / s
    split = 2 * (a + 2 * g) * d  # Q, K, V as flash attention saves them
    split += 2 * a * d  # attention output = input of the output projection
    if model.is_moe:
        return replicated + split / tp + moe_activation_bytes_per_token(model, tp, sequence_parallel, fused_swiglu=fused_swiglu)
    split += (4 * f if gated_mlp else 2 * f) + 2 * f  # FC1 output (activation input), activation output
    if gated_mlp and not fused_swiglu:
        split += 2 * f  # autograd also keeps silu(gate) for the product's backward
    return replicated + split / tp


def moe_activation_bytes_per_token(
    model: HFModelConfig, tp: int, sequence_parallel: bool, *, fused_swiglu: bool = True
) -> float:
    """What an MoE layer keeps for backward per token besides attention and the h-wide inputs (module
    doc): router scores, the top-k expert input rows and their SwiGLU intermediates, the shared expert."""
    s = _sequence_split(tp, sequence_parallel)
    h, width = model.hidden_size, model.moe_ffn_hidden_size or 0
    per_row = 2 * h + ROUTING_PROBABILITY_BYTES + (6 * width + (0 if fused_swiglu else 4 * width)) / tp
    shared = model.shared_expert_ffn_hidden_size or 0
    shared_bytes = (6 * shared + (0 if fused_swiglu else 2 * shared)) / tp
    return ROUTER_BYTES_PER_EXPERT * model.num_experts / s + model.num_experts_per_tok * per_row + shared_bytes


def dispatch_buffer_bytes_per_token(model: HFModelConfig, ep: int = 1, dispatcher: str = "alltoall") -> float:
    """Bytes the token dispatcher of the MoE layer being run holds per token beyond what the layers keep
    (module doc): the permuted tokens in and the experts' outputs out, top-k rows of 2h bytes each, and
    under the allgather dispatcher the EP x TP group's gathered hidden states (EP rows) in and out too;
    0 for a dense model."""
    if not model.is_moe:
        return 0.0
    rows = model.num_experts_per_tok + (ep if dispatcher == "allgather" else 0)
    return 2 * rows * 2 * model.hidden_size


def layer_input_bytes_per_token(model: HFModelConfig, tp: int, sequence_parallel: bool) -> float:
    """What full recompute keeps per layer and token: the layer's input (bf16 hidden state)."""
    return 2 * model.hidden_size / _sequence_split(tp, sequence_parallel)


def output_activation_bytes_per_token(
    model: HFModelConfig, tp: int, sequence_parallel: bool, temperature: float = 1.0
) -> float:
    """Last stage, per token: final-norm and output-layer inputs, bf16 logits shard and its gradient."""
    s = _sequence_split(tp, sequence_parallel)
    logits = 2 * padded_vocab(model, tp) / tp
    copies = 2 if temperature == 1.0 else 3  # logits / T keeps one more [tokens, V/TP] tensor
    return 2 * 2 * model.hidden_size / s + copies * logits


def in_flight_microbatches(pp: int, vpp: Optional[int], stage: int) -> float:
    """Micro-batches' worth of layer activations stage `stage` holds at its peak (1F1B schedules).

    Non-interleaved: PP - stage. Interleaved (VPP chunks per rank): Megatron's warm-up count of
    chunk forwards, (PP - stage - 1) x 2 + (VPP - 1) x PP, plus the one in the steady state,
    divided by VPP; for stage 0 that is PP x (1 + (PP - 1) / (PP x VPP)), the factor of
    Megatron's theoretical formula. Assumes at least PP micro-batches (the worst case).
    """
    if pp == 1:
        return 1.0
    if vpp is None or vpp == 1:
        return float(pp - stage)
    return ((pp - stage - 1) * 2 + (vpp - 1) * pp + 1) / vpp


@dataclass(frozen=True)
class StageActivation:
    per_token: float
    """Bytes per token of the micro-batch token budget."""
    fixed: float
    """Bytes independent of the budget (the chunked log-prob buffers on the last stage)."""


def stage_activation_bytes(
    model: HFModelConfig,
    tp: int,
    pp: int,
    stage: int,
    *,
    vpp: Optional[int] = None,
    cp: int = 1,
    sequence_parallel: bool = False,
    recompute: bool = False,
    temperature: float = 1.0,
    gated_mlp: bool = True,
    dropout_masks: bool = False,
    fused_swiglu: bool = True,
    ep: int = 1,
    moe_dispatcher: str = "alltoall",
) -> StageActivation:
    """Peak activation memory of one pipeline stage's rank during the actor update.

    A mixture of experts adds the token dispatcher's buffers of the layer being run (`ep`,
    `moe_dispatcher`: `dispatch_buffer_bytes_per_token`).

    Per token the rank computes: under context parallelism a rank computes 1/CP of every sequence (its
    2 of the 2*CP chunks), so `per_token` does not depend on CP, while a micro-batch of ``n`` sequence
    tokens costs ``n / CP`` of them (the all-gathered K/V of the layer being computed, 2 x 2gd/TP per
    token of the sequence, is transient and left to the reserve). ``cp`` is accepted for symmetry.
    """
    s = _sequence_split(tp, sequence_parallel)
    in_flight = in_flight_microbatches(pp, vpp, stage)
    layers = model.num_layers // pp
    full_layer = layer_activation_bytes_per_token(
        model, tp, sequence_parallel, gated_mlp=gated_mlp, dropout_masks=dropout_masks, fused_swiglu=fused_swiglu
    )
    if recompute:
        per_token = in_flight * layers * layer_input_bytes_per_token(model, tp, sequence_parallel) + full_layer
    else:
        per_token = in_flight * layers * full_layer
    if model.is_moe:
        per_token += dispatch_buffer_bytes_per_token(model, ep, moe_dispatcher)
    fixed = 0.0
    if stage == 0:
        per_token += in_flight * TOKEN_ID_BYTES
        if dropout_masks:
            per_token += in_flight * model.hidden_size / s  # embedding dropout mask
    if stage == pp - 1:
        per_token += output_activation_bytes_per_token(model, tp, sequence_parallel, temperature)
        fixed += 2 * 4 * LOGPROB_CHUNK_TOKENS * padded_vocab(model, tp) / tp
    return StageActivation(per_token=per_token, fixed=fixed)
