"""Per-GPU memory plan of a DAPO run, and the largest micro-batch token budget that fits (`megatron-dapo plan`).

    cfg = load_config("configs/dapo_qwen2.5_7b.yaml")
    plan = plan_memory(cfg, known_model("qwen2.5-7b"), ClusterShape(nodes=2))
    print(format_plan(plan))

All figures are bytes per GPU. One module per step of the reckoning:

    shapes.py       the model (`KNOWN_MODELS` or `model.hf_dir`) and the cluster (`GPU_MODELS`) planned for
    parameters.py   parameter counts: the HF total (and a mixture of experts' active ones), per pipeline
                    stage (dense and expert parts), per rollout-engine GPU
    memory.py       bytes of the actor state (optimizer, offload) and of the rollout engine (KV cache,
                    vLLM's profiled activations, the gathered results)
    activations.py  bytes the actor update keeps per token of a micro-batch, per pipeline stage
    phases.py       `plan_memory`: each phase of the step on the fullest GPU, what fits, the largest
                    micro-batch budget and engine pool
    report.py       `format_plan`: the table the command prints

The command line is `megatron_dapo/cli/plan.py`. Each module's docstring says what is counted and why.
"""

from megatron_dapo.plan.activations import (
    LOGPROB_CHUNK_TOKENS,
    TOKEN_ID_BYTES,
    StageActivation,
    dispatch_buffer_bytes_per_token,
    in_flight_microbatches,
    layer_activation_bytes_per_token,
    layer_input_bytes_per_token,
    moe_activation_bytes_per_token,
    output_activation_bytes_per_token,
    stage_activation_bytes,
)
from megatron_dapo.plan.memory import (
    ActorMemory,
    actor_memory,
    kv_cache_bytes_per_token,
    result_buffer_bytes,
    routing_entry_bytes,
    routing_host_bytes,
    vllm_activation_peak,
    vllm_batch_defaults,
)
from megatron_dapo.plan.parameters import (
    LayerParameters,
    StageParameters,
    hf_active_parameter_count,
    hf_parameter_count,
    layer_parameters,
    rollout_weight_parameters,
    stage_parameter_split,
    stage_parameters,
)
from megatron_dapo.plan.phases import (
    DEFAULT_RESERVE_GIB,
    ExpertPlan,
    ExpertStageMemory,
    MemoryPlan,
    RolloutMemory,
    StageMemory,
    plan_memory,
)
from megatron_dapo.plan.report import format_plan, format_utilization
from megatron_dapo.plan.shapes import (
    DEFAULT_GPU,
    GIB,
    GPU_MODELS,
    KNOWN_MODELS,
    ClusterShape,
    GPUModel,
    known_model,
    resolve_model,
)

__all__ = [
    "ActorMemory",
    "ClusterShape",
    "DEFAULT_GPU",
    "DEFAULT_RESERVE_GIB",
    "ExpertPlan",
    "ExpertStageMemory",
    "GIB",
    "GPU_MODELS",
    "GPUModel",
    "KNOWN_MODELS",
    "LOGPROB_CHUNK_TOKENS",
    "LayerParameters",
    "MemoryPlan",
    "RolloutMemory",
    "StageActivation",
    "StageMemory",
    "StageParameters",
    "TOKEN_ID_BYTES",
    "actor_memory",
    "dispatch_buffer_bytes_per_token",
    "format_plan",
    "format_utilization",
    "hf_active_parameter_count",
    "hf_parameter_count",
    "in_flight_microbatches",
    "known_model",
    "kv_cache_bytes_per_token",
    "layer_activation_bytes_per_token",
    "layer_input_bytes_per_token",
    "layer_parameters",
    "moe_activation_bytes_per_token",
    "output_activation_bytes_per_token",
    "plan_memory",
    "resolve_model",
    "result_buffer_bytes",
    "routing_entry_bytes",
    "routing_host_bytes",
    "rollout_weight_parameters",
    "stage_activation_bytes",
    "stage_parameter_split",
    "stage_parameters",
    "vllm_activation_peak",
    "vllm_batch_defaults",
]
