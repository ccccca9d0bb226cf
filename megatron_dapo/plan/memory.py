"""Bytes one GPU holds for the actor's state and for the rollout engine (activations: `activations.py`).

Actor (Megatron DDP + Megatron's optimizer, as `actor/optim.py` builds them), per parameter:
bf16 weights 2 B; DDP's contiguous fp32 gradient buffer 4 B (`grad_reduce_in_fp32=True`); fp32
main weights 4 B (none when the model itself is fp32); Adam's two fp32 moments 8 B. The
distributed optimizer shards main weights and moments over the data-parallel x context-parallel
ranks, not the weights or the gradient buffer: 6 + 12/DP bytes per parameter instead of 18, the
numbers Megatron's own `theoretical_memory_usage.py` uses. The reference model (only built with
`algorithm.kl.use_kl_loss`; DAPO has none) is a bf16 copy in the same layout. `actor.offload_*`
takes params, grads or optimizer state (main weights + moments) off the GPU while the engine
generates (`actor/offload.py`).

Mixtures of experts: Megatron keeps the routed experts in their own DDP buffers and optimizer
shards (`parameters.StageParameters`). The dense part's main weights and moments are sharded over
DP x CP as above; an expert's over the ranks that hold a copy of it, the expert data-parallel group
of DP x CP x TP / (EP x expert-TP) = DP x CP / EP ranks (expert-TP = TP:
`distributed.layout.expert_data_parallel_size`). The weights and the grad buffer of both parts stay
whole on every rank. So EP divides the experts' weights and grads per GPU but not their optimizer
state: EP x expert DP is DP x CP whatever EP is.

Rollout engine: bf16 weights split over `rollout.tp` (`parameters.rollout_weight_parameters`);
KV cache per token = 2 (K, V) x layers x KV heads per GPU x head_dim x 2 B; KV pool = engine pool
- weights - vLLM's profiled activation peak.

Inside vLLM's pool not everything is KV cache: at start-up vLLM runs a profiling forward of
`max_num_batched_tokens` tokens and its sampler on `max_num_seqs` rows, and subtracts the peak of
that run from the pool (`Worker.determine_available_memory` in vllm/v1/worker/gpu_worker.py, vLLM
0.32: KV = pool - weights - non-torch memory - profiled activation peak - CUDA graph estimate).
Without our setting them, vLLM picks 16384 tokens and 1024 sequences on H100/H200 and 8192 and 256
on other GPUs (`EngineArgs.get_batch_defaults`, offline `LLM` class). `vllm_activation_peak` estimates
that peak as the larger of (a) the forward: per token 2 bytes x (3f/TP + 4h), the SwiGLU's gate/up
output and product and four hidden-size buffers, and (b) the sampler: 40 bytes per row and
vocabulary entry (the logits gathered over TP in bf16 and fp32, sorting for top-p/top-k, softmax,
noise), plus 4 for the log-probs our `processed_logprobs` mode keeps. (a) reproduces the 4.35 GiB
vLLM 0.8.5 logged for Qwen2.5-7B at 32768 tokens (4.34), (b) the 1.19-1.24 GiB it logs for
Llama-3.1-8B with 256 sequences (1.22); for Qwen's 152k vocabulary and 1024 sequences the sampler
dominates: about 6.4 GiB, whatever the model size. For a mixture of experts the forward's MLP
term is the fused-MoE workspace instead (vLLM's `fused_experts_impl`: per token top-k x
(max(2I/TP, h) + I/TP), the gate/up output, reused for the down output, and the activation), plus
the shared expert's 3I_shared/TP. Non-torch memory (NCCL, custom all-reduce: 0.1 to 0.4 GiB in
published logs) and the CUDA graph estimate also come out of the pool and are not
modelled: the KV cache is that much smaller than shown. SGLang's `mem_fraction_static` holds
weights and KV only; its activations run outside it, so for SGLang the same estimate is counted
next to the pool instead of inside.

Result buffers: the step gathers the generated rollouts (`trainer/samples.py` `gather_samples`: one
flat buffer per engine, token id + float32 log-prob = 8 bytes per response token, 4 per prompt token)
over NCCL while the engine, KV pool included, is still awake; a rank holds the buffer being
received and the previous one. The plan counts two engines' worth at full length next to the pool.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from megatron_dapo.plan.parameters import kv_heads_per_rank

if TYPE_CHECKING:  # megatron_dapo.model imports torch: kept out of `megatron-dapo --help`
    from megatron_dapo.model.hf_config import HFModelConfig

VLLM_SAMPLER_BYTES_PER_LOGIT = 40
"""Bytes per (row, vocabulary entry) at the peak of vLLM's profiled sampler run (calibrated, module doc)."""
PROCESSED_LOGPROBS_BYTES_PER_LOGIT = 4
"""The float32 log-softmax `logprobs_mode="processed_logprobs"` (rollout/engines/vllm/engine.py) keeps besides."""
RESULT_BYTES_PER_RESPONSE_TOKEN = 8
"""`trainer/samples.py` `pack_samples`: int32 token id + float32 log-prob per response token (4 per prompt token)."""

# ---------------------------------------------------------------------------------------------
# Actor state
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ActorMemory:
    """Bytes of the actor's persistent state on one GPU."""

    params: float
    grads: float
    main_params: float
    optimizer: float

    @property
    def total(self) -> float:
        return self.params + self.grads + self.main_params + self.optimizer

    def __add__(self, other: ActorMemory) -> ActorMemory:
        return ActorMemory(
            self.params + other.params,
            self.grads + other.grads,
            self.main_params + other.main_params,
            self.optimizer + other.optimizer,
        )


def dtype_bytes(dtype: str) -> int:
    """Bytes per parameter of the model's dtype (`model.dtype`)."""
    return 4 if dtype == "float32" else 2


OFFLOAD_KINDS = ("params", "grads", "optimizer")
"""What `actor.offload_*` takes off the GPU while the engine generates (`actor/offload.py`; grads are dropped, not copied)."""


def actor_parts(actor: ActorMemory) -> dict[str, float]:
    """The actor's bytes by offload kind: params, the grad buffer, optimizer = main params + moments."""
    return {"params": actor.params, "grads": actor.grads, "optimizer": actor.main_params + actor.optimizer}


def actor_memory(num_params: int, dtype: str = "bfloat16", optimizer_shards: int = 1) -> ActorMemory:
    """Weights, fp32 grad buffer, fp32 main weights and Adam moments of `num_params` parameters.

    `optimizer_shards` is DP x CP with the distributed optimizer (main weights and moments are
    sharded over it), 1 without.
    """
    param_bytes = dtype_bytes(dtype)
    main = 0 if param_bytes == 4 else 4  # an fp32 model is its own master copy
    return ActorMemory(
        params=float(num_params * param_bytes),
        grads=float(num_params * 4),
        main_params=num_params * main / optimizer_shards,
        optimizer=num_params * 8 / optimizer_shards,
    )


# ---------------------------------------------------------------------------------------------
# Rollout engine
# ---------------------------------------------------------------------------------------------


def kv_cache_bytes_per_token(model: HFModelConfig, rollout_tp: int, dtype_bytes: int = 2) -> int:
    """KV-cache bytes per token on one GPU of a rollout engine: K and V of every layer."""
    return 2 * model.num_layers * kv_heads_per_rank(model, rollout_tp) * model.head_dim * dtype_bytes


def vllm_batch_defaults(gpu_memory_gib: float, gpu_name: str) -> tuple[int, int]:
    """(max_num_batched_tokens, max_num_seqs) vLLM picks for the offline `LLM` class on this GPU when
    not told (vLLM 0.32 `EngineArgs.get_batch_defaults`: >= 70 GiB and not an A100 -> 16384 and 1024,
    else 8192 and 256)."""
    if gpu_memory_gib >= 70 and "a100" not in gpu_name.lower():
        return 16384, 1024
    return 8192, 256


def vllm_activation_peak(
    model: HFModelConfig, rollout_tp: int, max_num_batched_tokens: int, max_num_seqs: int, processed_logprobs: bool = True
) -> float:
    """Estimated peak of vLLM's start-up profiling run, which vLLM subtracts from its pool (module doc).

    The larger of the forward over `max_num_batched_tokens` tokens, 2 bytes x (3f/TP + 4h) per token
    (a mixture of experts: its fused-MoE workspace in place of 3f/TP), and the sampler over
    `max_num_seqs` rows of the full (TP-gathered) vocabulary, `VLLM_SAMPLER_BYTES_PER_LOGIT` (+4 with
    processed log-probs) per entry.
    """
    h = model.hidden_size
    forward = max_num_batched_tokens * 2 * (_engine_mlp_width(model, rollout_tp) + 4 * h)
    per_logit = VLLM_SAMPLER_BYTES_PER_LOGIT + (PROCESSED_LOGPROBS_BYTES_PER_LOGIT if processed_logprobs else 0)
    sampler = max_num_seqs * model.vocab_size * per_logit
    return float(max(forward, sampler))


def _engine_mlp_width(model: HFModelConfig, rollout_tp: int) -> float:
    """Elements per token of the engine's MLP intermediates on one GPU (module doc): the SwiGLU's
    3f/TP, or the fused-MoE workspace of the top-k experts plus the shared expert."""
    if not model.is_moe:
        return 3 * model.ffn_hidden_size / rollout_tp
    width = (model.moe_ffn_hidden_size or 0) / rollout_tp
    shared = 3 * (model.shared_expert_ffn_hidden_size or 0) / rollout_tp
    return model.num_experts_per_tok * (max(2 * width, model.hidden_size) + width) + shared


def routing_entry_bytes(num_experts: int) -> int:
    """Bytes of one routed-expert entry: `actor.routing.routing_dtype` (1 up to 128 experts, 2 up to 32768)."""
    return 1 if num_experts <= 128 else 2 if num_experts <= 32768 else 4


def routing_host_bytes(model: "HFModelConfig", sequences: int, longest_sequence: int) -> float:
    """Host bytes of the MoE routing of `sequences` sequences: L x k entries per token read, at full
    length, in the compact type (`actor.routing.routing_dtype`). It never lands on a GPU: the
    generating rank keeps it, and sends each sample's to the replica that trains on it
    (`trainer/routing_exchange.py`)."""
    if not model.is_moe:
        return 0.0
    per_token = model.num_layers * model.num_experts_per_tok * routing_entry_bytes(model.num_experts)
    return float(sequences * longest_sequence * per_token)


def result_buffer_bytes(responses_per_engine: int, n: int, max_prompt_length: int, max_response_length: int) -> float:
    """GPU bytes of the rollout gather while the engine is awake: two engines' flat result buffers (the one
    being received and the previous one), every response at full length (`trainer/samples.py` `pack_samples`)."""
    prompts = math.ceil(responses_per_engine / n)
    one = responses_per_engine * max_response_length * RESULT_BYTES_PER_RESPONSE_TOKEN + prompts * max_prompt_length * 4
    return 2.0 * one
