"""Per-GPU memory plan of a DAPO run, and the largest micro-batch token budget that fits; `megatron-dapo plan`.

    megatron-dapo plan configs/dapo_qwen2.5_7b.yaml --model qwen2.5-7b --nodes 2
    python tools/plan_memory.py configs/dapo_qwen2.5_32b.yaml --model qwen2.5-32b --nodes 8 --json

    plan = plan_memory(cfg, known_model("qwen2.5-7b"), ClusterShape(nodes=2))
    print(format_plan(plan))

The model shape comes from `model.hf_dir`'s config.json or, to plan without downloading anything,
from `KNOWN_MODELS` (`--model`). All figures are bytes per GPU (printed in GiB = 2^30 bytes).

What one GPU holds, and when
----------------------------
The actor, the rollout engine and the trainer share every GPU and take turns:

* generation: the actor state that is not offloaded (`actor.offload_params / _grads / _optimizer`;
  without offload all of it: params, grads, optimizer state) + reference + the engine's memory pool
  (`rollout.gpu_memory_utilization` x GPU, the vLLM / SGLang convention: weights, KV cache and, for
  vLLM, the engine's profiled activations live inside it) + the gathered results + reserve;
* weight sync (after the update, `trainer.py`: grads and optimizer state go to host first if
  offloaded, then the engine's weights wake, the push, then the params go to host, and only then
  does the KV cache wake): the actor's params + the rest of the actor state not offloaded +
  reference + the engine's weights (its whole pool if `rollout.free_cache_engine` is off: then
  nothing sleeps) + one weight-sync bucket (`rollout.weight_sync_bucket_mb`) + reserve;
  the rollout phase needs the larger of these two moments;
* training phase: actor (all of it: whatever was offloaded is back) + reference + activations of
  one micro-batch + reserve; the engine sleeps and its pool is released (`rollout.free_cache_engine`,
  the default; if it is off the pool stays).

Offload therefore lets the pool grow by the offloaded bytes: the largest `rollout.gpu_memory_utilization`
is (GPU - actor state kept while generating - reference - reserve) / GPU, shown for the config's
offload, for a resident actor and for everything offloaded. The offloaded params and optimizer state
live in host memory (pinned) for the whole run (offloaded grads are dropped and come back as zeros:
no host copy): per GPU the fullest stage's offloaded params + optimizer state, plus the engine's weights
where a sleeping engine keeps them there (vLLM at `rollout.sleep_level=1`, the embedded engine at
either level; vLLM at level 2 and SGLang drop them);
per node that times the GPUs per node (an upper bound with PP > 1, where stages differ).

The GPU is what `torch.cuda.get_device_properties(i).total_memory` reports, not the marketing size:
an "80 GB" H100 reports about 79.1 GiB (PyTorch's out-of-memory messages say "total capacity of
79.10 GiB", vLLM logs "total_gpu_memory (79.11GiB)" to 79.25 with the driver), an H200 139.8 GiB
(vLLM: "total_gpu_memory (139.81GiB)"), an A100 80GB 79.15 to 79.25 and an A100 40GB 39.4 to 39.5
GiB; `GPU_MODELS` keeps the lowest such figure, rounded down (`--gpu`, or `--gpu-memory-gib`).
vLLM's pool is `gpu_memory_utilization` times that same figure (`request_memory` in
vllm/v1/worker/utils.py).

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
dominates: about 6.4 GiB, whatever the model size. Non-torch memory (NCCL, custom all-reduce: 0.1
to 0.4 GiB in published logs) and the CUDA graph estimate also come out of the pool and are not
modelled: the KV cache is that much smaller than shown. SGLang's `mem_fraction_static` holds
weights and KV only; its activations run outside it, so for SGLang the same estimate is counted
next to the pool instead of inside.

Result buffers: the step gathers the generated rollouts (`experience.gather_samples`: one flat
buffer per engine, token id + float32 log-prob = 8 bytes per response token, 4 per prompt token)
over NCCL while the engine, KV pool included, is still awake; a rank holds the buffer being
received and the previous one. The plan counts two engines' worth at full length next to the pool.

The reserve (`--reserve-gib`) stands for what no formula here counts: the CUDA context, NCCL
buffers, allocator fragmentation with varying micro-batch shapes, and small per-token inputs
(position ids, labels, the per-token loss inputs: tens of bytes per token).

Actor (Megatron DDP + Megatron's optimizer, as `actor/optim.py` builds them), per parameter:
bf16 weights 2 B; DDP's contiguous fp32 gradient buffer 4 B (`grad_reduce_in_fp32=True`); fp32
main weights 4 B (none when the model itself is fp32); Adam's two fp32 moments 8 B. The
distributed optimizer shards main weights and moments over the data-parallel x context-parallel
ranks, not the weights or the gradient buffer: 6 + 12/DP bytes per parameter instead of 18, the
numbers Megatron's own `theoretical_memory_usage.py` uses. Parameters are counted per pipeline
stage: the first holds the (vocab-padded) embedding, the last the output layer (a copy of the
embedding when tied and PP > 1) and the final norm. The reference model (only built with
`algorithm.kl.use_kl_loss`; DAPO has none) is a bf16 copy in the same layout.

Rollout engine: bf16 weights split over `rollout.tp` (KV heads are replicated when rollout.tp
exceeds their number, as vLLM and SGLang do); KV cache per token = 2 (K, V) x layers x KV heads
per GPU x head_dim x 2 B; KV pool = engine pool - weights - vLLM's profiled activation peak.

Activations per token of a micro-batch (bf16, flash attention: no [seq x seq] scores, packed THD
sequences, no dropout), per transformer layer, with s = TP under sequence parallelism else 1:
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
Qwen2.5-7B. The reserve is meant to absorb differences of this size.
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
rank computes and a micro-batch holds CP times the budget in sequence tokens. At a fixed world size,
TP and PP the actor state per GPU does not change with CP (the distributed optimizer shards over
DP x CP, a constant), so the plan also gives the smallest CP whose micro-batch holds the longest sequence.

The largest `trainer.max_tokens_per_micro_batch` is then (GPU - reserve - fixed) / per-token on
the pipeline stage where it is smallest.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

from megatron_dapo.config import Config, ConfigError, load_config, validate_model_shape, validate_world

if TYPE_CHECKING:  # megatron_dapo.model imports torch: kept out of `megatron-dapo --help` (see cli.py)
    from megatron_dapo.model.hf_config import HFModelConfig

__all__ = [
    "ActorMemory",
    "ClusterShape",
    "GPU_MODELS",
    "GPUModel",
    "KNOWN_MODELS",
    "LOGPROB_CHUNK_TOKENS",
    "LayerParameters",
    "MemoryPlan",
    "RolloutMemory",
    "StageActivation",
    "StageMemory",
    "actor_memory",
    "add_arguments",
    "format_plan",
    "hf_parameter_count",
    "in_flight_microbatches",
    "known_model",
    "kv_cache_bytes_per_token",
    "layer_activation_bytes_per_token",
    "layer_input_bytes_per_token",
    "layer_parameters",
    "output_activation_bytes_per_token",
    "plan_memory",
    "resolve_model",
    "result_buffer_bytes",
    "rollout_weight_parameters",
    "run",
    "stage_activation_bytes",
    "stage_parameters",
    "vllm_activation_peak",
    "vllm_batch_defaults",
]

GIB = float(2**30)
LOGPROB_CHUNK_TOKENS = 4096
"""Tokens per fp32 chunk of the vocab-parallel log-prob (the actor's `logprob_chunk_size` default)."""
TOKEN_ID_BYTES = 8
"""int64 token ids kept per in-flight micro-batch on the first stage."""
DEFAULT_RESERVE_GIB = 6.0
VLLM_SAMPLER_BYTES_PER_LOGIT = 40
"""Bytes per (row, vocabulary entry) at the peak of vLLM's profiled sampler run (calibrated, module doc)."""
PROCESSED_LOGPROBS_BYTES_PER_LOGIT = 4
"""The float32 log-softmax `logprobs_mode="processed_logprobs"` (rollout/engines/vllm/engine.py) keeps besides."""
RESULT_BYTES_PER_RESPONSE_TOKEN = 8
"""`experience.pack_samples`: int32 token id + float32 log-prob per response token (4 per prompt token)."""


@dataclass(frozen=True)
class GPUModel:
    """A GPU as software sees it."""

    label: str
    memory_gib: float
    """`torch.cuda.get_device_properties(i).total_memory` in GiB: the lowest published figure, rounded down."""


# Sources (module doc): PyTorch's "total capacity" in out-of-memory messages and vLLM's
# "total_gpu_memory (...)" start-up line on these GPUs.
GPU_MODELS: dict[str, GPUModel] = {
    "h100": GPUModel("H100 80GB", 79.1),  # 79.10 (PyTorch) .. 79.25 (vLLM) GiB
    "h200": GPUModel("H200 141GB", 139.8),  # 139.81 GiB (vLLM)
    "a100-80gb": GPUModel("A100 80GB", 79.1),  # 79.15 .. 79.25 GiB
    "a100-40gb": GPUModel("A100 40GB", 39.3),  # 39.38 .. 39.50 GiB
}
DEFAULT_GPU = "h100"

# ---------------------------------------------------------------------------------------------
# Known model shapes
# ---------------------------------------------------------------------------------------------


def _config(arch: str, **fields: Any) -> dict[str, Any]:
    return {"architectures": [arch], "hidden_act": "silu", **fields}


# The architecture fields of the public Hugging Face config.json of each base model
# (https://huggingface.co/<repo>/blob/main/config.json for Qwen/Qwen2.5-{0.5B,1.5B,7B,14B,32B,72B},
# meta-llama/Llama-3.1-{8B,70B}, Qwen/Qwen3-{8B,32B}), enough for `read_hf_config`. The parameter
# counts they give equal the totals published on the model pages (tests/plan/test_memory_plan.py).
KNOWN_MODELS: dict[str, dict[str, Any]] = {
    "qwen2.5-0.5b": _config(
        "Qwen2ForCausalLM", hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
        num_attention_heads=14, num_key_value_heads=2, vocab_size=151936, max_position_embeddings=32768,
        rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=True,
    ),
    "qwen2.5-1.5b": _config(
        "Qwen2ForCausalLM", hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
        num_attention_heads=12, num_key_value_heads=2, vocab_size=151936, max_position_embeddings=131072,
        rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=True,
    ),
    "qwen2.5-7b": _config(
        "Qwen2ForCausalLM", hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
        num_attention_heads=28, num_key_value_heads=4, vocab_size=152064, max_position_embeddings=131072,
        rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=False,
    ),
    "qwen2.5-14b": _config(
        "Qwen2ForCausalLM", hidden_size=5120, intermediate_size=13824, num_hidden_layers=48,
        num_attention_heads=40, num_key_value_heads=8, vocab_size=152064, max_position_embeddings=131072,
        rope_theta=1000000.0, rms_norm_eps=1e-5, tie_word_embeddings=False,
    ),
    "qwen2.5-32b": _config(
        "Qwen2ForCausalLM", hidden_size=5120, intermediate_size=27648, num_hidden_layers=64,
        num_attention_heads=40, num_key_value_heads=8, vocab_size=152064, max_position_embeddings=131072,
        rope_theta=1000000.0, rms_norm_eps=1e-5, tie_word_embeddings=False,
    ),
    "qwen2.5-72b": _config(
        "Qwen2ForCausalLM", hidden_size=8192, intermediate_size=29568, num_hidden_layers=80,
        num_attention_heads=64, num_key_value_heads=8, vocab_size=152064, max_position_embeddings=131072,
        rope_theta=1000000.0, rms_norm_eps=1e-5, tie_word_embeddings=False,
    ),
    "llama-3.1-8b": _config(
        "LlamaForCausalLM", hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, vocab_size=128256, max_position_embeddings=131072,
        rope_theta=500000.0, rms_norm_eps=1e-5, tie_word_embeddings=False,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 8192},
    ),
    "llama-3.1-70b": _config(
        "LlamaForCausalLM", hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
        num_attention_heads=64, num_key_value_heads=8, vocab_size=128256, max_position_embeddings=131072,
        rope_theta=500000.0, rms_norm_eps=1e-5, tie_word_embeddings=False,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 8192},
    ),
    "qwen3-8b": _config(
        "Qwen3ForCausalLM", hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
        num_attention_heads=32, num_key_value_heads=8, head_dim=128, vocab_size=151936,
        max_position_embeddings=40960, rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=False,
    ),
    "qwen3-32b": _config(
        "Qwen3ForCausalLM", hidden_size=5120, intermediate_size=25600, num_hidden_layers=64,
        num_attention_heads=64, num_key_value_heads=8, head_dim=128, vocab_size=151936,
        max_position_embeddings=40960, rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=False,
    ),
}  # fmt: skip


def known_model(name: str) -> HFModelConfig:
    """The `HFModelConfig` of a model in `KNOWN_MODELS` (case-insensitive name)."""
    from megatron_dapo.model.hf_config import read_hf_config

    key = name.lower()
    if key not in KNOWN_MODELS:
        raise ConfigError(f"unknown model {name!r}: known models are {', '.join(KNOWN_MODELS)}")
    return read_hf_config(KNOWN_MODELS[key])


def resolve_model(cfg: Config, model_name: Optional[str] = None) -> tuple[str, HFModelConfig]:
    """The model to plan for: `model_name` from `KNOWN_MODELS`, else `model.hf_dir`'s config.json.

    The parallel sizes are checked against the shape with the config's own messages
    (`validate_model_shape`).
    """
    from megatron_dapo.model.hf_config import read_hf_config

    if model_name:
        key = model_name.lower()
        if key not in KNOWN_MODELS:
            raise ConfigError(f"unknown model {model_name!r}: known models are {', '.join(KNOWN_MODELS)}")
        raw, name = KNOWN_MODELS[key], key
    else:
        config_json = Path(cfg.model.hf_dir) / "config.json" if cfg.model.hf_dir else None
        if config_json is None or not config_json.is_file():
            raise ConfigError(
                f"no model shape: 'model.hf_dir'={cfg.model.hf_dir!r} has no config.json; set model.hf_dir to a "
                f"HuggingFace model directory or pass --model with one of {', '.join(KNOWN_MODELS)}"
            )
        raw, name = json.loads(config_json.read_text()), Path(cfg.model.hf_dir).name
    validate_model_shape(cfg, raw)
    return name, read_hf_config(raw)


# ---------------------------------------------------------------------------------------------
# Parameters
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class LayerParameters:
    """Parameters of one transformer layer, by how tensor parallelism stores them."""

    tensor_parallel: int
    """Split over TP ranks: q/k/v/o and MLP weights, the q/k/v biases."""
    replicated: int
    """On every TP rank: the two RMSNorm weights (and Qwen3's per-head q/k norms)."""

    @property
    def total(self) -> int:
        return self.tensor_parallel + self.replicated


def layer_parameters(model: HFModelConfig) -> LayerParameters:
    """Parameters of one layer: attention (GQA, optional QKV bias), SwiGLU MLP, RMSNorms."""
    h, a, g, d, f = _dims(model)
    qkv = h * (a + 2 * g) * d + ((a + 2 * g) * d if model.qkv_bias else 0)
    attention_out = a * d * h
    mlp = 3 * h * f  # gate, up (h -> f each) and down (f -> h)
    norms = 2 * h + (2 * d if model.qk_norm else 0)
    return LayerParameters(tensor_parallel=qkv + attention_out + mlp, replicated=norms)


def hf_parameter_count(model: HFModelConfig) -> int:
    """Parameters of the HF model (unpadded vocabulary): what `sum(p.numel())` gives in transformers."""
    embedding = model.vocab_size * model.hidden_size
    output = 0 if model.tie_word_embeddings else embedding
    return embedding + output + model.num_layers * layer_parameters(model).total + model.hidden_size


def _padded_vocab(model: HFModelConfig, tp: int) -> int:
    from megatron_dapo.model.mapping import padded_vocab_size  # Megatron's padding rule, one source of truth

    return padded_vocab_size(model.vocab_size, tp)


def stage_parameters(model: HFModelConfig, tp: int, pp: int, stage: int) -> int:
    """Parameters one rank of pipeline stage `stage` holds in Megatron (all its virtual chunks together).

    Layers split evenly over stages and their matrices over TP ranks; the first stage adds the
    vocab-padded embedding shard, the last the final norm and the output-layer shard (with tied
    embeddings and PP > 1 Megatron keeps a copy of the embedding there; with PP = 1 it is shared).
    """
    if model.num_layers % pp:
        raise ConfigError(f"the model's num_hidden_layers={model.num_layers} is not divisible by parallel.pp={pp}")
    if not 0 <= stage < pp:
        raise ValueError(f"stage {stage} is not in [0, {pp})")
    _check_tensor_parallel(model, tp, "parallel.tp")
    layer = layer_parameters(model)
    count = model.num_layers // pp * (layer.tensor_parallel // tp + layer.replicated)
    vocab_shard = _padded_vocab(model, tp) * model.hidden_size // tp
    if stage == 0:
        count += vocab_shard
    if stage == pp - 1:
        count += model.hidden_size
        if not model.tie_word_embeddings or pp > 1:
            count += vocab_shard
    return count


def _check_tensor_parallel(model: HFModelConfig, tp: int, key: str) -> None:
    h, a, g, d, f = _dims(model)
    if a % tp:
        raise ConfigError(f"'{key}'={tp} does not divide the model's num_attention_heads={a}")
    if f % tp:
        raise ConfigError(f"'{key}'={tp} does not divide the model's intermediate_size={f}")
    if key == "parallel.tp" and g % tp:
        raise ConfigError(f"'{key}'={tp} does not divide the model's num_key_value_heads={g} (query groups)")
    if g % tp and tp % g:
        raise ConfigError(
            f"'{key}'={tp} and the model's num_key_value_heads={g}: one must divide the other "
            "(rollout engines replicate KV heads only when rollout.tp is a multiple of their number)"
        )


def _kv_heads_per_rank(model: HFModelConfig, tp: int) -> int:
    """KV heads on one rank of a tensor-parallel engine; replicated when tp exceeds their number."""
    return max(1, model.num_key_value_heads // tp)


def rollout_weight_parameters(model: HFModelConfig, rollout_tp: int) -> int:
    """Parameters one GPU of a rollout engine holds (unpadded vocabulary, KV heads replicated if needed)."""
    _check_tensor_parallel(model, rollout_tp, "rollout.tp")
    h, a, g, d, f = _dims(model)
    kv = _kv_heads_per_rank(model, rollout_tp)
    q_and_o = 2 * h * a * d // rollout_tp + (a * d // rollout_tp if model.qkv_bias else 0)
    k_and_v = 2 * h * kv * d + (2 * kv * d if model.qkv_bias else 0)
    norms = 2 * h + (2 * d if model.qk_norm else 0)
    per_layer = q_and_o + k_and_v + 3 * h * f // rollout_tp + norms
    vocab = model.vocab_size * h // rollout_tp * (1 if model.tie_word_embeddings else 2)
    return model.num_layers * per_layer + vocab + h


def kv_cache_bytes_per_token(model: HFModelConfig, rollout_tp: int, dtype_bytes: int = 2) -> int:
    """KV-cache bytes per token on one GPU of a rollout engine: K and V of every layer."""
    return 2 * model.num_layers * _kv_heads_per_rank(model, rollout_tp) * model.head_dim * dtype_bytes


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

    The larger of the forward over `max_num_batched_tokens` tokens, 2 bytes x (3f/TP + 4h) per token,
    and the sampler over `max_num_seqs` rows of the full (TP-gathered) vocabulary,
    `VLLM_SAMPLER_BYTES_PER_LOGIT` (+4 with processed log-probs) per entry.
    """
    h, f = model.hidden_size, model.ffn_hidden_size
    forward = max_num_batched_tokens * 2 * (3 * f / rollout_tp + 4 * h)
    per_logit = VLLM_SAMPLER_BYTES_PER_LOGIT + (PROCESSED_LOGPROBS_BYTES_PER_LOGIT if processed_logprobs else 0)
    sampler = max_num_seqs * model.vocab_size * per_logit
    return float(max(forward, sampler))


def result_buffer_bytes(responses_per_engine: int, n: int, max_prompt_length: int, max_response_length: int) -> float:
    """GPU bytes of the rollout gather while the engine is awake: two engines' flat result buffers (the one
    being received and the previous one), every response at full length (`experience.pack_samples`)."""
    prompts = math.ceil(responses_per_engine / n)
    one = responses_per_engine * max_response_length * RESULT_BYTES_PER_RESPONSE_TOKEN + prompts * max_prompt_length * 4
    return 2.0 * one


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


def _dtype_bytes(dtype: str) -> int:
    return 4 if dtype == "float32" else 2


OFFLOAD_KINDS = ("params", "grads", "optimizer")
"""What `actor.offload_*` takes off the GPU while the engine generates (`actor/offload.py`; grads are dropped, not copied)."""


def _actor_parts(actor: ActorMemory) -> dict[str, float]:
    """The actor's bytes by offload kind: params, the grad buffer, optimizer = main params + moments."""
    return {"params": actor.params, "grads": actor.grads, "optimizer": actor.main_params + actor.optimizer}


def actor_memory(num_params: int, dtype: str = "bfloat16", optimizer_shards: int = 1) -> ActorMemory:
    """Weights, fp32 grad buffer, fp32 main weights and Adam moments of `num_params` parameters.

    `optimizer_shards` is DP x CP with the distributed optimizer (main weights and moments are
    sharded over it), 1 without.
    """
    param_bytes = _dtype_bytes(dtype)
    main = 0 if param_bytes == 4 else 4  # an fp32 model is its own master copy
    return ActorMemory(
        params=float(num_params * param_bytes),
        grads=float(num_params * 4),
        main_params=num_params * main / optimizer_shards,
        optimizer=num_params * 8 / optimizer_shards,
    )


# ---------------------------------------------------------------------------------------------
# Activations
# ---------------------------------------------------------------------------------------------


def _dims(model: HFModelConfig) -> tuple[int, int, int, int, int]:
    return (
        model.hidden_size,
        model.num_attention_heads,
        model.num_key_value_heads,
        model.head_dim,
        model.ffn_hidden_size,
    )


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
    h, a, g, d, f = _dims(model)
    s = _sequence_split(tp, sequence_parallel)
    replicated = 4 * 2 * h / s  # inputs of the two norms, of the QKV projection and of FC1
    if dropout_masks:
        replicated += 2 * h / s
    split = 2 * (a + 2 * g) * d  # Q, K, V as flash attention saves them
    split += 2 * a * d  # attention output = input of the output projection
    split += (4 * f if gated_mlp else 2 * f) + 2 * f  # FC1 output (activation input), activation output
    if gated_mlp and not fused_swiglu:
        split += 2 * f  # autograd also keeps silu(gate) for the product's backward
    return replicated + split / tp


def layer_input_bytes_per_token(model: HFModelConfig, tp: int, sequence_parallel: bool) -> float:
    """What full recompute keeps per layer and token: the layer's input (bf16 hidden state)."""
    return 2 * model.hidden_size / _sequence_split(tp, sequence_parallel)


def output_activation_bytes_per_token(
    model: HFModelConfig, tp: int, sequence_parallel: bool, temperature: float = 1.0
) -> float:
    """Last stage, per token: final-norm and output-layer inputs, bf16 logits shard and its gradient."""
    s = _sequence_split(tp, sequence_parallel)
    logits = 2 * _padded_vocab(model, tp) / tp
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
) -> StageActivation:
    """Peak activation memory of one pipeline stage's rank during the actor update.

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
    fixed = 0.0
    if stage == 0:
        per_token += in_flight * TOKEN_ID_BYTES
        if dropout_masks:
            per_token += in_flight * model.hidden_size / s  # embedding dropout mask
    if stage == pp - 1:
        per_token += output_activation_bytes_per_token(model, tp, sequence_parallel, temperature)
        fixed += 2 * 4 * LOGPROB_CHUNK_TOKENS * _padded_vocab(model, tp) / tp
    return StageActivation(per_token=per_token, fixed=fixed)


# ---------------------------------------------------------------------------------------------
# The plan
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ClusterShape:
    nodes: int = 1
    gpus_per_node: int = 8
    gpu_memory_gib: float = GPU_MODELS[DEFAULT_GPU].memory_gib
    """What the GPU reports (`GPU_MODELS`), not its marketing size."""
    gpu: str = DEFAULT_GPU
    """A `GPU_MODELS` key or any name (vLLM's batch defaults depend on it: see `vllm_batch_defaults`)."""

    @property
    def world_size(self) -> int:
        return self.nodes * self.gpus_per_node

    @property
    def gpu_memory_bytes(self) -> float:
        return self.gpu_memory_gib * GIB


@dataclass
class StageMemory:
    """One pipeline stage's rank during the actor update."""

    stage: int
    parameters: int
    actor: ActorMemory
    """With the config's optimizer choice."""
    actor_distributed_optimizer: ActorMemory
    actor_plain_optimizer: ActorMemory
    reference: float
    activation_per_token: float
    activation_per_token_no_recompute: float
    activation_per_token_full_recompute: float
    activation_fixed: float
    activation_at_budget: float
    """Activations at the config's micro-batch token budget."""
    training_total: float
    """Everything the training phase holds at the config's budget."""
    max_tokens: int
    """Largest micro-batch token budget that fits, with the config's recompute setting."""
    max_tokens_no_recompute: int
    max_tokens_full_recompute: int


@dataclass
class RolloutMemory:
    tp: int
    engines: int
    weights: float
    kv_bytes_per_token: int
    pool: float
    """rollout.gpu_memory_utilization x GPU memory."""
    activation_peak: float
    """vLLM's profiled activation peak (`vllm_activation_peak`): inside the pool for vLLM, next to it for SGLang."""
    activation_in_pool: bool
    max_num_batched_tokens: int
    max_num_seqs: int
    """vLLM's batch defaults on this GPU, which size its profiling run."""
    kv_cache: float
    """pool - weights (- the activation peak when it is inside the pool)."""
    result_buffers: float
    """The rollout gather's GPU buffers while the engine is awake (`result_buffer_bytes`)."""
    full_sequence_tokens: int
    concurrent_full_sequences: int
    """Full-length sequences whose KV cache fits the pool at once, per engine."""
    generation_sequences_per_engine: int
    """Sequences of one generation batch (gen_batch_size x n) each engine serves."""
    offloaded: list[str]
    """What the actor offloads while the engine generates (actor.offload_*): params, grads, optimizer."""
    actor_kept: float
    """Actor state + reference that stay on the fullest GPU while the engine generates."""
    generation_total: float
    """Kept actor state + reference + pool + result buffers (+ SGLang's activations) + reserve."""
    sync_total: float
    """At the weight sync: params + kept state + reference + engine weights (the pool if the engine
    never sleeps) + weight-sync bucket + reserve."""
    phase_total: float
    """The rollout phase: the larger of generation_total and sync_total."""
    max_gpu_memory_utilization: float
    """The largest rollout.gpu_memory_utilization that fits with the config's offload."""
    max_gpu_memory_utilization_resident: float
    """... with the whole actor resident (no offload)."""
    max_gpu_memory_utilization_offloaded: float
    """... with params, grads and optimizer state offloaded."""
    concurrent_full_sequences_at_max: int
    """Full-length sequences per engine at max_gpu_memory_utilization."""
    host_per_gpu: float
    """Host memory the offloaded state (and, at sleep level 1, the sleeping engine's weights) takes per GPU."""
    host_per_node: float
    """host_per_gpu x GPUs per node (the fullest stage on every GPU: an upper bound with PP > 1)."""


@dataclass
class MemoryPlan:
    model_name: str
    architecture: str
    hf_parameters: int
    nodes: int
    gpus_per_node: int
    world_size: int
    gpu_memory: float
    gpu: str
    reserve: float
    tp: int
    pp: int
    vpp: Optional[int]
    cp: int
    dp: int
    sequence_parallel: bool
    distributed_optimizer: bool
    recompute: bool
    dtype: str
    reference_built: bool
    engine_pool_during_training: bool
    micro_batch_tokens: int
    """The config's budget per rank: trainer.max_tokens_per_micro_batch, or micro_batch_size x longest sequence / CP."""
    longest_sequence: int
    stages: list[StageMemory]
    binding_stage: int
    """The stage with the smallest token budget (reported in the table)."""
    rollout: RolloutMemory
    max_tokens_per_micro_batch: int
    """Per rank (under CP a rank computes 1/CP of each sequence's tokens)."""
    longest_sequence_per_micro_batch: int
    """max_tokens_per_micro_batch x CP: the longest sequence one micro-batch can hold."""
    min_cp_for_longest_sequence: Optional[int]
    """The smallest parallel.cp (a divisor of world / (TP x PP)) whose micro-batch holds the longest sequence at this
    world, TP and PP; None: no CP does."""
    training_fits: bool
    rollout_fits: bool
    notes: list[str] = field(default_factory=list)

    @property
    def fits(self) -> bool:
        return self.training_fits and self.rollout_fits

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["fits"] = self.fits
        for stage, raw in zip(self.stages, out["stages"]):
            for key in ("actor", "actor_distributed_optimizer", "actor_plain_optimizer"):
                raw[key]["total"] = getattr(stage, key).total
        return out


def plan_memory(
    cfg: Config,
    model: HFModelConfig,
    cluster: ClusterShape,
    *,
    reserve_gib: float = DEFAULT_RESERVE_GIB,
    model_name: str = "",
) -> MemoryPlan:
    """Per-GPU memory of `cfg` on `cluster` for `model`; raises `ConfigError` for an impossible layout."""
    p, r, t = cfg.parallel, cfg.rollout, cfg.trainer
    world = cluster.world_size
    validate_world(cfg, world)  # the config's own messages for layout / world mismatches
    dp = world // (p.tp * p.pp * p.cp)
    shape = {
        "num_attention_heads": model.num_attention_heads,
        "num_key_value_heads": model.num_key_value_heads,
        "num_hidden_layers": model.num_layers,
    }
    validate_model_shape(cfg, shape)  # heads, query groups and layers: the config's own messages
    _check_tensor_parallel(model, p.tp, "parallel.tp")  # adds the FFN split
    gpu = cluster.gpu_memory_bytes
    reserve = reserve_gib * GIB
    longest = r.max_prompt_length + r.max_response_length
    # Per rank, as the actor plans micro-batches: under CP a rank computes 1/CP of each sequence's tokens.
    budget = t.max_tokens_per_micro_batch or math.ceil(t.micro_batch_size * longest / p.cp)
    sp = p.sequence_parallel and p.tp > 1
    shards = dp * p.cp if p.use_distributed_optimizer else 1
    reference_built = cfg.algorithm.kl.use_kl_loss
    param_bytes = _dtype_bytes(cfg.model.dtype)

    # Rollout engine.
    rollout_weights = rollout_weight_parameters(model, r.tp) * 2.0
    kv_per_token = kv_cache_bytes_per_token(model, r.tp)
    pool = r.gpu_memory_utilization * gpu
    batched_tokens, num_seqs = vllm_batch_defaults(cluster.gpu_memory_gib, cluster.gpu)
    activation = vllm_activation_peak(model, r.tp, batched_tokens, num_seqs)
    in_pool = r.engine != "sglang"  # vLLM subtracts it from its pool; SGLang's static fraction excludes it
    engine_in_pool = rollout_weights + (activation if in_pool else 0.0)
    kv_cache = max(0.0, pool - engine_in_pool)
    engines = world // r.tp
    sequences_per_engine = math.ceil(t.gen_batch_size * r.n / engines)
    results = result_buffer_bytes(sequences_per_engine, r.n, r.max_prompt_length, r.max_response_length)
    beside_pool = results + (0.0 if in_pool else activation)  # allocated while the pool is awake
    engine_in_training = not r.free_cache_engine

    stages = []
    for stage in range(p.pp):
        params = stage_parameters(model, p.tp, p.pp, stage)
        with_dist = actor_memory(params, cfg.model.dtype, dp * p.cp)
        plain = actor_memory(params, cfg.model.dtype, 1)
        actor = actor_memory(params, cfg.model.dtype, shards)
        reference = params * param_bytes if reference_built else 0.0
        common = dict(
            vpp=p.vpp,
            cp=p.cp,
            sequence_parallel=sp,
            temperature=r.temperature,
            fused_swiglu=cfg.model.transformer_engine != "off",  # Megatron fuses it only with TE on GPU
        )
        none = stage_activation_bytes(model, p.tp, p.pp, stage, recompute=False, **common)
        full = stage_activation_bytes(model, p.tp, p.pp, stage, recompute=True, **common)
        chosen = full if cfg.model.recompute_activations else none
        static = actor.total + reference + reserve + (pool if engine_in_training else 0.0)

        def largest(act: StageActivation) -> int:
            return max(0, math.floor((gpu - static - act.fixed) / act.per_token))

        at_budget = chosen.fixed + chosen.per_token * budget
        stages.append(
            StageMemory(
                stage=stage,
                parameters=params,
                actor=actor,
                actor_distributed_optimizer=with_dist,
                actor_plain_optimizer=plain,
                reference=reference,
                activation_per_token=chosen.per_token,
                activation_per_token_no_recompute=none.per_token,
                activation_per_token_full_recompute=full.per_token,
                activation_fixed=chosen.fixed,
                activation_at_budget=at_budget,
                training_total=static + at_budget,
                max_tokens=largest(chosen),
                max_tokens_no_recompute=largest(none),
                max_tokens_full_recompute=largest(full),
            )
        )
    binding = min(stages, key=lambda s: (s.max_tokens, s.stage))
    bucket = r.weight_sync_bucket_mb * 2**20
    offloaded = [kind for kind in OFFLOAD_KINDS if getattr(cfg.actor, f"offload_{kind}")]

    def kept(stage: StageMemory, away: list[str]) -> float:
        """What `stage` keeps on the GPU while generating when `away` is offloaded."""
        parts = _actor_parts(stage.actor)
        return stage.reference + sum(parts[kind] for kind in OFFLOAD_KINDS if kind not in away)

    actor_kept = max(kept(s, offloaded) for s in stages)
    at_sync = max(kept(s, [k for k in offloaded if k != "params"]) for s in stages)  # the push reads the params
    engine_at_sync = rollout_weights if r.free_cache_engine else pool
    generation_total = actor_kept + pool + beside_pool + reserve
    sync_total = at_sync + engine_at_sync + bucket + reserve

    def largest_utilization(away: list[str]) -> float:
        room = gpu - max(kept(s, away) for s in stages) - beside_pool - reserve
        if not r.free_cache_engine:  # the pool is there during the sync too
            room = min(room, gpu - max(kept(s, [k for k in away if k != "params"]) for s in stages) - bucket - reserve)
        return max(0.0, room / gpu)

    def full_sequences(pool_bytes: float) -> int:
        return int(max(0.0, pool_bytes - engine_in_pool) // (kv_per_token * longest))

    max_utilization = largest_utilization(offloaded)
    # Offloaded grads are dropped, not copied (their values are dead between updates): no host memory.
    host_per_gpu = max(sum(_actor_parts(s.actor)[k] for k in offloaded if k != "grads") for s in stages)
    if r.free_cache_engine and (r.engine == "embedded" or (r.engine == "vllm" and r.sleep_level == 1)):
        host_per_gpu += rollout_weights  # a sleeping engine that keeps its weights in host memory (SGLang drops them)
    rollout = RolloutMemory(
        tp=r.tp,
        engines=engines,
        weights=rollout_weights,
        kv_bytes_per_token=kv_per_token,
        pool=pool,
        activation_peak=activation,
        activation_in_pool=in_pool,
        max_num_batched_tokens=batched_tokens,
        max_num_seqs=num_seqs,
        kv_cache=kv_cache,
        result_buffers=results,
        full_sequence_tokens=longest,
        concurrent_full_sequences=full_sequences(pool),
        generation_sequences_per_engine=sequences_per_engine,
        offloaded=offloaded,
        actor_kept=actor_kept,
        generation_total=generation_total,
        sync_total=sync_total,
        phase_total=max(generation_total, sync_total),
        max_gpu_memory_utilization=max_utilization,
        max_gpu_memory_utilization_resident=largest_utilization([]),
        max_gpu_memory_utilization_offloaded=largest_utilization(list(OFFLOAD_KINDS)),
        concurrent_full_sequences_at_max=full_sequences(max_utilization * gpu),
        host_per_gpu=host_per_gpu,
        host_per_node=host_per_gpu * cluster.gpus_per_node,
    )
    rollout_total = rollout.phase_total

    notes = []
    if not p.use_distributed_optimizer:
        notes.append("parallel.use_distributed_optimizer=false: every rank keeps all optimizer state")
    if pool <= engine_in_pool:
        notes.append(
            "the rollout pool cannot even hold the engine weights and vLLM's profiled activations: raise "
            "rollout.gpu_memory_utilization or rollout.tp"
        )
    if rollout.concurrent_full_sequences < 1:
        notes.append("the KV pool holds no full-length sequence: raise rollout.gpu_memory_utilization or rollout.tp")
    if r.engine == "embedded":
        notes.append("rollout.engine=embedded has no memory pool: the rollout figures are those of a vLLM engine")
    if r.engine == "sglang":
        notes.append(
            "rollout.engine=sglang: its activations live outside mem_fraction_static (counted next to the pool, "
            "with vLLM's estimate of them)"
        )
    if cfg.model.transformer_engine == "off":
        notes.append(
            "model.transformer_engine=off: the local layer spec runs right-padded rows (no packing), so a "
            "micro-batch's tokens count its padding (rows x longest row); SwiGLU counted unfused"
        )
    # At a fixed world size, TP and PP the actor state per GPU does not depend on CP (the distributed
    # optimizer shards over DP x CP, a constant), so the longest sequence grows exactly with CP.
    longest_per_micro_batch = binding.max_tokens * p.cp
    wanted = math.ceil(longest / binding.max_tokens) if binding.max_tokens > 0 else None
    cp_choices = [c for c in range(1, world // (p.tp * p.pp) + 1) if (world // (p.tp * p.pp)) % c == 0]
    cp_needed = next((c for c in cp_choices if wanted is not None and c >= wanted), None)
    if longest_per_micro_batch < longest:
        remedy = f"set parallel.cp >= {cp_needed} (context parallelism), " if cp_needed else ""
        notes.append(
            f"one full-length sequence ({longest} tokens) does not fit a micro-batch ({longest_per_micro_batch} "
            f"tokens at CP={p.cp}): {remedy}enable model.recompute_activations, sequence parallelism, or raise "
            "parallel.tp / parallel.pp"
        )
    return MemoryPlan(
        model_name=model_name,
        architecture=model.architecture,
        hf_parameters=hf_parameter_count(model),
        nodes=cluster.nodes,
        gpus_per_node=cluster.gpus_per_node,
        world_size=world,
        gpu_memory=gpu,
        gpu=cluster.gpu,
        reserve=reserve,
        tp=p.tp,
        pp=p.pp,
        vpp=p.vpp,
        cp=p.cp,
        dp=dp,
        sequence_parallel=sp,
        distributed_optimizer=p.use_distributed_optimizer,
        recompute=cfg.model.recompute_activations,
        dtype=cfg.model.dtype,
        reference_built=reference_built,
        engine_pool_during_training=engine_in_training,
        micro_batch_tokens=budget,
        longest_sequence=longest,
        stages=stages,
        binding_stage=binding.stage,
        rollout=rollout,
        max_tokens_per_micro_batch=binding.max_tokens,
        longest_sequence_per_micro_batch=longest_per_micro_batch,
        min_cp_for_longest_sequence=cp_needed,
        training_fits=all(s.training_total <= gpu for s in stages) and longest_per_micro_batch >= longest,
        rollout_fits=rollout_total <= gpu and rollout.concurrent_full_sequences >= 1,
        notes=notes,
    )


# ---------------------------------------------------------------------------------------------
# Output
# ---------------------------------------------------------------------------------------------


def _gib(value: float) -> str:
    return f"{value / GIB:8.2f} GiB"


def _down(fraction: float) -> str:
    """A utilisation with two decimals, rounded down (a printed limit must not exceed the real one)."""
    return f"{math.floor(fraction * 100 + 1e-9) / 100:.2f}"


def _row(label: str, *values: str) -> str:
    return (f"  {label:<54}" + "".join(f"{v:>18}" for v in values)).rstrip()


def _gpu_label(name: str) -> str:
    model = GPU_MODELS.get(name.lower())
    return f"{model.label} as reported" if model else name


def format_plan(plan: MemoryPlan) -> str:
    """The plan as a readable table (what `megatron-dapo plan` prints)."""
    s = plan.stages[plan.binding_stage]
    on = lambda flag: "on" if flag else "off"  # noqa: E731
    fits = lambda total: "yes" if total <= plan.gpu_memory else "NO"  # noqa: E731
    r = plan.rollout
    lines = [
        f"memory plan: {plan.model_name or plan.architecture} ({plan.architecture}, {plan.hf_parameters / 1e9:.2f}B "
        f"parameters) on {plan.nodes} node(s) x {plan.gpus_per_node} GPUs = {plan.world_size}, "
        f"{plan.gpu_memory / GIB:.1f} GiB per GPU ({_gpu_label(plan.gpu)}), reserve {plan.reserve / GIB:.1f} GiB",
        f"layout: TP={plan.tp} PP={plan.pp}" + (f" VPP={plan.vpp}" if plan.vpp else "") + f" CP={plan.cp} "
        f"DP={plan.dp}; sequence parallel {on(plan.sequence_parallel)}, distributed optimizer "
        f"{on(plan.distributed_optimizer)}, full recompute {on(plan.recompute)}; {plan.dtype}",
        f"pipeline stage shown: {s.stage} of {plan.pp} (the one with the smallest token budget); "
        f"{s.parameters / 1e9:.3f}B parameters on each of its GPUs",
        "",
        _row("actor (per GPU)", "dist. optimizer", "no dist. optim."),
    ]
    d, n = s.actor_distributed_optimizer, s.actor_plain_optimizer
    lines += [
        _row(f"  params ({plan.dtype})", _gib(d.params), _gib(n.params)),
        _row("  grads (fp32 DDP grad buffer)", _gib(d.grads), _gib(n.grads)),
        _row("  main params (fp32)", _gib(d.main_params), _gib(n.main_params)),
        _row("  Adam moments (fp32 m, v)", _gib(d.optimizer), _gib(n.optimizer)),
        _row("  total", _gib(d.total), _gib(n.total)),
        _row(
            "reference model (bf16, actor layout)",
            _gib(s.reference if plan.reference_built else s.parameters * 2),
            "counted" if plan.reference_built else "not built (no KL)",
        ),
        "",
        _row(f"rollout engine (rollout.tp={r.tp}, {r.engines} engines)"),
        _row("  weights (bf16)", _gib(r.weights)),
        _row("  KV cache per token", f"{r.kv_bytes_per_token / 1024:8.1f} KiB"),
        _row("  pool (gpu_memory_utilization x GPU)", _gib(r.pool)),
        _row(
            f"  profiled activation peak ({r.max_num_batched_tokens} tokens, {r.max_num_seqs} seqs)",
            _gib(r.activation_peak),
            "in the pool" if r.activation_in_pool else "beside the pool",
        ),
        _row("  KV cache (pool - weights" + (" - activation peak)" if r.activation_in_pool else ")"), _gib(r.kv_cache)),
        _row(f"  full-length sequences ({r.full_sequence_tokens} tokens) at once", f"{r.concurrent_full_sequences:>12} / engine"),
        _row("  sequences per generation batch", f"{r.generation_sequences_per_engine:>12} / engine"),
        _row("  result buffers while generating (gathered rollouts)", _gib(r.result_buffers)),
        "",
        _row("actor offload while generating (actor.offload_*)", ", ".join(r.offloaded) or "none"),
        _row("  actor state kept on the GPU (+ reference)", _gib(r.actor_kept)),
        _row("  host memory, pinned (per GPU, per node)", _gib(r.host_per_gpu), _gib(r.host_per_node)),
        "",
        _row("activations (actor update, per token)", "no recompute", "full recompute"),
        _row(
            "  per token of the micro-batch",
            f"{s.activation_per_token_no_recompute / 1024:8.1f} KiB",
            f"{s.activation_per_token_full_recompute / 1024:8.1f} KiB",
        ),
        _row("  fixed (log-prob chunk buffers)", _gib(s.activation_fixed)),
        _row(
            "  largest micro-batch token budget",
            f"{s.max_tokens_no_recompute:>12}",
            f"{s.max_tokens_full_recompute:>12}",
        ),
        _row(f"  at the config's budget ({plan.micro_batch_tokens} tokens)", _gib(s.activation_at_budget)),
        "",
        _row("phase totals (fullest GPU, reserve included)", "total", "fits"),
        _row("  generation: kept actor state + ref + pool + results", _gib(r.generation_total), fits(r.generation_total)),
        _row(
            "  weight sync: params + kept + engine "
            + ("weights" if not plan.engine_pool_during_training else "pool")
            + " + bucket",
            _gib(r.sync_total),
            fits(r.sync_total),
        ),
        _row(
            "  training: actor + ref + activations" + (" + pool" if plan.engine_pool_during_training else ""),
            _gib(max(x.training_total for x in plan.stages)),
            "yes" if plan.training_fits else "NO",
        ),
        "",
        f"largest trainer.max_tokens_per_micro_batch: {plan.max_tokens_per_micro_batch} "
        f"(full recompute {on(plan.recompute)}; config uses {plan.micro_batch_tokens}, "
        f"longest sequence {plan.longest_sequence})",
        f"context parallelism: at CP={plan.cp} one micro-batch holds a sequence of up to "
        f"{plan.longest_sequence_per_micro_batch} tokens; the longest sequence ({plan.longest_sequence}) needs "
        + (f"CP >= {plan.min_cp_for_longest_sequence}" if plan.min_cp_for_longest_sequence else "more memory than any CP gives"),
        f"largest rollout.gpu_memory_utilization: {_down(r.max_gpu_memory_utilization)} with this offload "
        f"({r.concurrent_full_sequences_at_max} full-length sequences per engine); "
        f"{_down(r.max_gpu_memory_utilization_resident)} with the actor resident, "
        f"{_down(r.max_gpu_memory_utilization_offloaded)} with params, grads and optimizer offloaded",
    ]
    lines += [f"note: {note}" for note in plan.notes]
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------------------------

DESCRIPTION = (
    "Per-GPU memory of a DAPO config on a cluster: actor params / grads / optimizer (with and without "
    "the distributed optimizer), reference, rollout weights and KV cache, activations, the largest "
    "trainer.max_tokens_per_micro_batch that fits, and the largest rollout.gpu_memory_utilization with and "
    "without actor offload (actor.offload_*) and the host memory offload takes. Exit status: 0 fits, "
    "1 configuration error, 3 does not fit."
)


def _add_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model",
        choices=sorted(KNOWN_MODELS),
        type=str.lower,
        help="a built-in model shape (no download); default: model.hf_dir's config.json",
    )
    parser.add_argument("--nodes", type=int, default=1, help="number of nodes (default 1)")
    parser.add_argument("--gpus-per-node", type=int, default=8, help="GPUs per node (default 8)")
    parser.add_argument(
        "--gpu",
        choices=sorted(GPU_MODELS),
        type=str.lower,
        default=DEFAULT_GPU,
        help="the GPU model: its memory as torch reports it and vLLM's batch defaults on it (default h100: "
        + ", ".join(f"{k} {v.memory_gib} GiB" for k, v in GPU_MODELS.items())
        + ")",
    )
    parser.add_argument(
        "--gpu-memory-gib",
        type=float,
        default=None,
        help="memory of one GPU in GiB as torch.cuda.get_device_properties reports it (default: the --gpu figure)",
    )
    parser.add_argument(
        "--reserve-gib",
        type=float,
        default=DEFAULT_RESERVE_GIB,
        help=f"memory kept free for the CUDA context, NCCL and fragmentation (default {DEFAULT_RESERVE_GIB})",
    )
    parser.add_argument("--json", action="store_true", help="print the plan as JSON (bytes) instead of a table")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Arguments of `megatron-dapo plan` and tools/plan_memory.py.

    Options may come before or after the config and its overrides (`plan FILE --nodes 2 key=value`):
    argparse's `parse_args` cannot mix positionals and options, so everything after the config is
    taken as it is and sorted out in `run`.
    """
    parser.add_argument("config", nargs="?", help="YAML file (omit to start from the built-in defaults)")
    _add_options(parser)
    parser.add_argument(
        "overrides", nargs=argparse.REMAINDER, help="dotted overrides, e.g. parallel.tp=4 rollout.tp=2"
    )


def _sort_remainder(args: argparse.Namespace) -> argparse.Namespace:
    """Options that followed the config ended up in `args.overrides`: parse them out."""
    if not any(item.startswith("-") for item in args.overrides):
        return args
    rest = argparse.ArgumentParser(prog="plan", add_help=False, argument_default=argparse.SUPPRESS)
    _add_options(rest)
    rest.add_argument("overrides", nargs="*")
    parsed = vars(rest.parse_intermixed_args(args.overrides))
    args.overrides = []
    for key, value in parsed.items():
        setattr(args, key, value)
    return args


def run(args: argparse.Namespace) -> int:
    """Print the plan; 0 if it fits, 3 if it does not, 1 on a configuration or model error."""
    from megatron_dapo.model.hf_config import UnsupportedModelError

    args = _sort_remainder(args)
    config_path, overrides = args.config, list(args.overrides)
    if config_path is not None and "=" in config_path:  # only overrides, no file
        config_path, overrides = None, [config_path, *overrides]
    try:
        gpu_gib = GPU_MODELS[args.gpu].memory_gib if args.gpu_memory_gib is None else args.gpu_memory_gib
        if args.nodes < 1 or args.gpus_per_node < 1 or gpu_gib <= 0 or args.reserve_gib < 0:
            raise ConfigError("--nodes and --gpus-per-node must be >= 1, --gpu-memory-gib > 0, --reserve-gib >= 0")
        cfg = load_config(config_path, overrides)
        name, model = resolve_model(cfg, args.model)
        cluster = ClusterShape(args.nodes, args.gpus_per_node, gpu_gib, args.gpu)
        plan = plan_memory(cfg, model, cluster, reserve_gib=args.reserve_gib, model_name=name)
    except (ConfigError, UnsupportedModelError) as exc:
        print(f"plan error: {exc}", file=sys.stderr)
        return 1
    print(json.dumps(plan.to_dict(), indent=2) if args.json else format_plan(plan))
    return 0 if plan.fits else 3


def main(argv: Optional[list[str]] = None) -> int:
    """Entry point of tools/plan_memory.py."""
    parser = argparse.ArgumentParser(prog="plan_memory.py", description=DESCRIPTION)
    add_arguments(parser)
    return run(parser.parse_args(argv))
