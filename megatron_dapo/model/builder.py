"""HF model description -> Megatron `TransformerConfig` and this rank's `GPTModel` chunk(s).

    models = build_gpt_models(hf_cfg, layout, dtype=torch.bfloat16)   # list: one per VPP chunk
    check_against_hf(models, hf_cfg)                                  # fail loudly on any mismatch

Call after `distributed.setup.init_distributed` (Megatron's parallel state must exist).

Layer implementation: the Transformer Engine spec when TE is importable on a CUDA machine
("auto"), required ("on": a missing or broken TE is a `TransformerEngineUnavailable` error naming
the import error) or never ("off"); otherwise Megatron's local spec with RMSNorm. The choice and,
under "auto", why TE was not used are printed once on rank 0 (`model/gpu_kernels.py`).

Attention masks. Both specs build the causal mask themselves when given `attention_mask=None`
(the local spec's `DotProductAttention` via `attn_mask_type=causal`; on the CPU the compat layer
reroutes its `device="cuda"` mask to the CPU). For explicit masks with the local spec, pass
`causal_attention_mask(seq_len)` (True = masked, shape [1, 1, s, s]); `attention_mask_for` returns
what a forward helper should pass for a given model.

Mixtures of experts (Qwen3-MoE, Qwen2-MoE). Every layer is an MoE layer: a top-k softmax router
(`moe_router_pre_softmax` = not `norm_topk_prob`: HF renormalises the top-k weights exactly when
Megatron takes the softmax over the top-k logits), SwiGLU experts of `moe_intermediate_size`, and
for Qwen2-MoE a sigmoid-gated shared expert. The experts are TE's grouped GEMM (`TEGroupedMLP`)
with the TE spec and Megatron's sequential experts (`SequentialMLP`) with the local spec; the
expert-parallel size comes from Megatron's parallel state (`distributed.setup.init_distributed`),
the token dispatcher (`alltoall` or `allgather`) from the caller. The load-balancing loss is
Megatron's "aux_loss" with the coefficient the model was trained with (HF `router_aux_loss_coef`);
it acts only in training forwards with gradients.

RoPE. Plain RoPE matches HF by construction. For Llama 3 scaling, Megatron's built-in scaling
hard-codes low/high frequency factors 1/4 and an original context of 8192; we compute the inverse
frequencies from the config's own parameters (`rope_inv_freq`, same formula as HF) and set them on
the rotary module, so any llama3 parameters match HF exactly (the logits tests check it).
"""

from __future__ import annotations

import dataclasses
from typing import Literal, Optional, Sequence

import torch
from megatron.core import parallel_state
from megatron.core.models.gpt import GPTModel, gpt_layer_specs
from megatron.core.tensor_parallel.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    set_tensor_model_parallel_attributes,
)
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_dapo.distributed.layout import ParallelLayout, check_expert_dispatcher
from megatron_dapo.model.gpu_kernels import (
    KernelStatus,
    TransformerEngineUnavailable,
    apex_fused_wgrad_status,
    describe_layer_choice,
    gradient_options,
    transformer_engine_status,
)
from megatron_dapo.model.gpu_kernels import resolve_transformer_engine as _resolve_te
from megatron_dapo.model.hf_config import HFModelConfig
from megatron_dapo.model.mapping import LOCAL_SPEC, TE_SPEC, padded_vocab_size
from megatron_dapo.distributed.objects import is_logging_rank
from megatron_dapo.model.local_norm import local_block_submodules, with_sequence_parallel_norms
from megatron_dapo.model.sdpa_attention import with_sdpa_core_attention

__all__ = [
    "announce_once",
    "attention_mask_for",
    "build_gpt_models",
    "build_transformer_config",
    "causal_attention_mask",
    "check_against_hf",
    "layer_spec_of",
    "resolve_transformer_engine",
    "rope_inv_freq",
    "TransformerEngineUnavailable",
    "transformer_engine_available",
    "unwrap_model",
]

TEMode = Literal["auto", "on", "off"]
MoEDispatcher = Literal["alltoall", "allgather"]  # distributed.layout.EXPERT_DISPATCHERS


# ---------------------------------------------------------------------------------------------
# Transformer Engine detection (the probes and pure decisions live in model/gpu_kernels.py)
# ---------------------------------------------------------------------------------------------


def transformer_engine_available() -> bool:
    """True when TE's PyTorch API imports and CUDA is available (TE has no CPU kernels)."""
    return transformer_engine_status().available


def resolve_transformer_engine(mode: TEMode = "auto") -> bool:
    """Whether to use the TE layer spec for `model.transformer_engine` = auto / on / off, on this machine."""
    return _resolve_te(mode, transformer_engine_status())


_announced: set[str] = set()


def announce_once(line: str) -> None:
    """Print a start-up line once per process, on the logging rank (actor and reference build alike)."""
    if line not in _announced and is_logging_rank():
        print(f"[megatron-dapo] {line}", flush=True)
    _announced.add(line)


# ---------------------------------------------------------------------------------------------
# RoPE
# ---------------------------------------------------------------------------------------------


def rope_inv_freq(cfg: HFModelConfig) -> torch.Tensor:
    """The RoPE inverse frequencies HF uses for this config (float32, [head_dim / 2])."""
    dim = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).to(dtype=torch.float) / dim))
    scaling = cfg.rope_scaling
    if scaling is None:
        return inv_freq
    if scaling["rope_type"] != "llama3":
        raise ValueError(f"unsupported rope_type {scaling['rope_type']!r}")
    # Llama 3: keep high frequencies, divide low frequencies by `factor`, interpolate in between.
    factor = scaling["factor"]
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    original = scaling["original_max_position_embeddings"]
    low_freq_wavelen = original / low
    high_freq_wavelen = original / high
    wavelen = 2 * torch.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (original / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(medium, smoothed, scaled)


# ---------------------------------------------------------------------------------------------
# Masks
# ---------------------------------------------------------------------------------------------


def causal_attention_mask(seq_len: int, device: Optional[torch.device | str] = None) -> torch.Tensor:
    """Megatron-style causal mask: bool [1, 1, s, s], True where attention is NOT allowed."""
    return torch.triu(torch.ones(seq_len, seq_len, dtype=torch.bool, device=device), diagonal=1)[None, None]


def unwrap_model(model: torch.nn.Module) -> torch.nn.Module:
    """The GPTModel inside Megatron's wrappers (DistributedDataParallel, Float16Module: `.module`)."""
    while hasattr(model, "module") and isinstance(model.module, torch.nn.Module):
        model = model.module
    return model


def layer_spec_of(model: torch.nn.Module) -> str:
    """"te" when the model's layers come from the Transformer Engine spec, else "local"."""
    for name, _ in model.named_parameters():
        if name.endswith("linear_qkv.layer_norm_weight"):
            return TE_SPEC
    return LOCAL_SPEC


def attention_mask_for(model: torch.nn.Module, seq_len: int, device=None) -> Optional[torch.Tensor]:
    """The mask a causal LM forward should pass: explicit for the local spec, None for TE (it is causal)."""
    return causal_attention_mask(seq_len, device) if layer_spec_of(model) == LOCAL_SPEC else None


# ---------------------------------------------------------------------------------------------
# Config and models
# ---------------------------------------------------------------------------------------------


def _dtype_flags(dtype: torch.dtype) -> dict:
    if dtype == torch.float32:
        return {"params_dtype": torch.float32, "bf16": False, "fp16": False}
    if dtype == torch.bfloat16:
        return {"params_dtype": torch.bfloat16, "bf16": True, "fp16": False}
    if dtype == torch.float16:
        return {"params_dtype": torch.float16, "bf16": False, "fp16": True}
    raise ValueError(f"unsupported dtype {dtype}")


def build_transformer_config(
    cfg: HFModelConfig,
    layout: ParallelLayout,
    dtype: torch.dtype = torch.bfloat16,
    *,
    use_te: bool = False,
    sequence_parallel: bool = False,
    init_weights: bool = True,
    recompute_activations: bool = False,
    gradient_accumulation_fusion: bool = False,
    moe_token_dispatcher: MoEDispatcher = "alltoall",
    moe_aux_loss_coeff: Optional[float] = None,
    moe_z_loss_coeff: Optional[float] = None,
):
    """The Megatron `TransformerConfig` equivalent to the HF model, for this layout and dtype.

    `gradient_accumulation_fusion` (apex's fused weight-gradient GEMM into DDP's ``main_grad``; see
    `gpu_kernels.gradient_options`) is fixed when the layers are built, not when DDP wraps them.
    MoE models: the layout's `ep` (Megatron's `expert_model_parallel_size`), the token dispatcher,
    the load-balancing loss coefficient (None: the model's `router_aux_loss_coef`) and the router
    z-loss coefficient (None or 0: off).
    """
    layout.validate(None, cfg.num_layers, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.num_experts)
    on_gpu = torch.cuda.is_available()
    # Fused kernels need CUDA; with TE on a GPU use them, on the local spec / CPU use plain PyTorch.
    fused = use_te and on_gpu
    kwargs = dict(
        num_layers=cfg.num_layers,
        hidden_size=cfg.hidden_size,
        num_attention_heads=cfg.num_attention_heads,
        num_query_groups=cfg.num_key_value_heads,
        kv_channels=cfg.head_dim,
        ffn_hidden_size=cfg.ffn_hidden_size,
        normalization="RMSNorm",
        layernorm_epsilon=cfg.rms_norm_eps,
        gated_linear_unit=True,
        activation_func=torch.nn.functional.silu,
        add_bias_linear=False,
        add_qkv_bias=cfg.qkv_bias,
        qk_layernorm=cfg.qk_norm,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        attention_softmax_in_fp32=True,
        apply_query_key_layer_scaling=False,
        bias_activation_fusion=fused,
        bias_dropout_fusion=fused,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        apply_rope_fusion=fused,
        gradient_accumulation_fusion=gradient_accumulation_fusion,
        tensor_model_parallel_size=layout.tp,
        pipeline_model_parallel_size=layout.pp,
        virtual_pipeline_model_parallel_size=layout.megatron_vpp,
        context_parallel_size=layout.cp,
        sequence_parallel=sequence_parallel and layout.tp > 1,
        pipeline_dtype=dtype,
        use_cpu_initialization=not on_gpu,
        perform_initialization=init_weights,
        **_dtype_flags(dtype),
    )
    if recompute_activations:
        kwargs.update(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    if cfg.is_moe:
        check_expert_dispatcher(moe_token_dispatcher, layout.pp, layout.ep)
        kwargs.update(_moe_kwargs(cfg, use_te, layout.ep, moe_token_dispatcher, moe_aux_loss_coeff, moe_z_loss_coeff))
    fields = {f.name for f in dataclasses.fields(TransformerConfig)}
    if "cuda_graph_scope" in fields:
        # The default "full" is deprecated (a UserWarning per config); an empty list is its equivalent.
        kwargs["cuda_graph_scope"] = []
    if "transformer_impl" in fields:  # tells Megatron which implementation the spec uses
        kwargs["transformer_impl"] = "transformer_engine" if use_te else "local"
    return TransformerConfig(**kwargs)


def _moe_kwargs(
    cfg: HFModelConfig,
    use_te: bool,
    expert_parallel: int,
    dispatcher: str,
    aux_loss_coeff: Optional[float],
    z_loss_coeff: Optional[float] = None,
) -> dict:
    """The TransformerConfig fields of an MoE model (see the module docstring)."""
    kwargs = dict(
        num_moe_experts=cfg.num_experts,
        moe_router_topk=cfg.num_experts_per_tok,
        moe_ffn_hidden_size=cfg.moe_ffn_hidden_size,
        moe_router_score_function="softmax",
        moe_router_pre_softmax=not cfg.norm_topk_prob,
        moe_router_load_balancing_type="aux_loss",
        moe_aux_loss_coeff=cfg.router_aux_loss_coef if aux_loss_coeff is None else float(aux_loss_coeff),
        moe_grouped_gemm=use_te,  # TE's grouped GEMM; the local spec runs the experts one by one
        moe_token_dispatcher_type=dispatcher,
        expert_model_parallel_size=expert_parallel,
        moe_z_loss_coeff=float(z_loss_coeff) if z_loss_coeff else None,
    )
    if "moe_enable_routing_replay" in {f.name for f in dataclasses.fields(TransformerConfig)}:
        # A RouterReplay per router (megatron-core >= 0.16): idle unless actor.routing drives it.
        kwargs["moe_enable_routing_replay"] = True
    if cfg.shared_expert_ffn_hidden_size is not None:
        kwargs.update(moe_shared_expert_intermediate_size=cfg.shared_expert_ffn_hidden_size, moe_shared_expert_gate=True)
    return kwargs


def _layer_spec(cfg: HFModelConfig, use_te: bool, attention: Literal["sdpa", "megatron"] = "sdpa"):
    """The layer spec: TE's, or the local one with `attention` as core attention.

    "sdpa" (default): `sdpa_attention.SDPADotProductAttention`, PyTorch's fused attention kernels;
    "megatron": Megatron's unfused `DotProductAttention` (materialises the [b, heads, s, s] scores;
    kept as the reference). With TE, TE's own fused attention is used whatever `attention` says.
    """
    if attention not in ("sdpa", "megatron"):
        raise ValueError(f"attention must be 'sdpa' or 'megatron', got {attention!r}")
    num_experts = cfg.num_experts or None
    if use_te:
        return gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec(
            num_experts=num_experts, moe_grouped_gemm=num_experts is not None, qk_layernorm=cfg.qk_norm
        )

    spec = gpt_layer_specs.get_gpt_layer_local_spec(num_experts=num_experts, qk_layernorm=cfg.qk_norm, normalization="RMSNorm")
    if num_experts is not None:
        spec = _moe_norm_checkpoint_key(spec)
    spec = with_sequence_parallel_norms(spec)  # Megatron's torch norm refuses sequence parallelism
    if attention == "sdpa":
        spec = with_sdpa_core_attention(spec)
    return spec


def _moe_norm_checkpoint_key(spec):
    """The local MoE layer spec with its pre-MLP norm stored under its own checkpoint key.

    The local spec renames `pre_mlp_layernorm.` to `mlp.linear_fc1.layer_norm_` in checkpoints, the
    key of TE's fused dense MLP, so that dense checkpoints load under both specs. An MoE layer has no
    `linear_fc1` and TE's MoE spec keeps `pre_mlp_layernorm.weight`; without the rename the local
    spec writes that key too, and a checkpoint converted or trained on the CPU loads on TE GPUs.
    """
    keys = {k: v for k, v in spec.submodules.sharded_state_dict_keys_map.items() if k != "pre_mlp_layernorm."}
    return dataclasses.replace(spec, submodules=dataclasses.replace(spec.submodules, sharded_state_dict_keys_map=keys))


def build_gpt_models(
    cfg: HFModelConfig,
    layout: ParallelLayout,
    dtype: torch.dtype = torch.bfloat16,
    *,
    transformer_engine: TEMode = "auto",
    sequence_parallel: bool = False,
    init_weights: bool = True,
    recompute_activations: bool = False,
    attention: Literal["sdpa", "megatron"] = "sdpa",
    gradient_accumulation_fusion: Optional[bool] = None,
    moe_token_dispatcher: MoEDispatcher = "alltoall",
    moe_aux_loss_coeff: Optional[float] = None,
    moe_z_loss_coeff: Optional[float] = None,
) -> list[torch.nn.Module]:
    """This rank's `GPTModel` chunks (one per virtual-pipeline stage, in order).

    `layout` must match Megatron's initialised parallel state. `init_weights=False` skips the
    random initialisation (for models about to be loaded from a checkpoint). `attention` picks the
    local spec's core attention: "sdpa" (PyTorch's fused kernels) or "megatron" (Megatron's own).
    `gradient_accumulation_fusion`: None decides from the machine (on with CUDA and apex's fused
    weight-gradient GEMM, `gpu_kernels.gradient_options`); a model built with it on must be trained
    through Megatron DDP (`actor.optim.prepare_for_training`), which provides ``main_grad``.
    MoE models take the expert-parallel size from the layout and `moe_token_dispatcher`
    / `moe_aux_loss_coeff` / `moe_z_loss_coeff` as `build_transformer_config` does.
    """
    actual = {
        "tp": parallel_state.get_tensor_model_parallel_world_size(),
        "pp": parallel_state.get_pipeline_model_parallel_world_size(),
        "cp": parallel_state.get_context_parallel_world_size(),
        "ep": parallel_state.get_expert_model_parallel_world_size(),
    }
    wanted = {kind: getattr(layout, kind) for kind in actual}
    if actual != wanted:
        raise ValueError(f"layout {wanted} differs from Megatron's parallel state {actual}: build with init_distributed's layout (ctx.layout)")
    # "off" never imports TE: a broken install cannot get in the way of a run that does not want it.
    te_status = transformer_engine_status() if transformer_engine != "off" else KernelStatus(False, "not probed")
    use_te = _resolve_te(transformer_engine, te_status)
    device_type = "cuda" if torch.cuda.is_available() else "cpu"
    announce_once(describe_layer_choice(transformer_engine, te_status, use_te, device_type))
    fusion = gradient_options(
        device_type,
        te_status.available,
        apex_fused_wgrad_status().available,
        gradient_accumulation_fusion=gradient_accumulation_fusion,
    ).gradient_accumulation_fusion
    config = build_transformer_config(
        cfg,
        layout,
        dtype,
        use_te=use_te,
        sequence_parallel=sequence_parallel,
        init_weights=init_weights,
        recompute_activations=recompute_activations,
        gradient_accumulation_fusion=fusion,
        moe_token_dispatcher=moe_token_dispatcher,
        moe_aux_loss_coeff=moe_aux_loss_coeff,
        moe_z_loss_coeff=moe_z_loss_coeff,
    )
    if layout.cp > 1 and not use_te and attention != "sdpa":
        # Megatron's own DotProductAttention refuses CP; the SDPA core attention all-gathers K/V over CP.
        raise ValueError("parallel.cp > 1 without Transformer Engine needs the SDPA core attention (attention='sdpa')")
    spec = _layer_spec(cfg, use_te, attention)
    pp_rank = parallel_state.get_pipeline_model_parallel_rank()
    vpp = layout.megatron_vpp
    inv_freq = rope_inv_freq(cfg)
    models = []
    for chunk in range(vpp or 1):
        model = GPTModel(
            config=config,
            transformer_layer_spec=spec if use_te else local_block_submodules(spec, config, chunk if vpp else None),
            vocab_size=padded_vocab_size(cfg.vocab_size, layout.tp),
            max_sequence_length=cfg.max_position_embeddings,
            pre_process=pp_rank == 0 and chunk == 0,
            post_process=pp_rank == layout.pp - 1 and chunk == (vpp or 1) - 1,
            parallel_output=True,
            share_embeddings_and_output_weights=cfg.tie_word_embeddings,
            position_embedding_type="rope",
            rotary_percent=1.0,
            rotary_base=cfg.rope_theta,
            rope_scaling=cfg.rope_scaling is not None,
            rope_scaling_factor=cfg.rope_scaling["factor"] if cfg.rope_scaling else 8.0,
            vp_stage=chunk if vpp else None,
        )
        rotary = model.rotary_pos_emb
        # Set before the first forward: RotaryEmbedding.forward caches its output per length.
        rotary.inv_freq = inv_freq.to(device=rotary.inv_freq.device)
        place_parameters(model, dtype)
        models.append(model)
    if not init_weights:
        mark_tensor_parallel_weights(models)
    return models



def place_parameters(model: torch.nn.Module, dtype: torch.dtype) -> int:
    """Put every parameter on this rank's device in the model's dtype; returns how many moved.

    The local spec's RMSNorm (`WrappedTorchNorm` -> `torch.nn.RMSNorm`) is created on the CPU in
    float32 whatever the config says, while the linear layers follow `params_dtype` and the GPU.
    Megatron's own trainer hides this with `model.cuda()` + `Float16Module`; without it a GPU
    forward fails (norm weight on the CPU) and, once Megatron DDP has moved them, the norms train
    in float32 and no longer match a bf16 engine's copy (found on an H100). HF keeps its norms in
    the model dtype too, so casting them keeps the two numerically identical.
    """
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    moved = 0
    for param in model.parameters():
        target_dtype = dtype if param.is_floating_point() else param.dtype
        target_device = param.device if param.is_meta else device  # meta: shape-only models (conversion)
        if param.device != target_device or param.dtype != target_dtype:
            param.data = param.data.to(device=target_device, dtype=target_dtype)
            moved += 1
    return moved


def mark_tensor_parallel_weights(models: Sequence[torch.nn.Module]) -> int:
    """Mark tensor-parallel weights as such when Megatron left them unmarked; returns how many were.

    Megatron-core 0.16.1 sets ``tensor_model_parallel`` / ``partition_dim`` on the weights of
    ``ColumnParallelLinear``, ``RowParallelLinear`` and ``VocabParallelEmbedding`` only inside its
    weight initialisers, so a model built with ``perform_initialization=False`` (to be loaded from a
    checkpoint) has unmarked shards (fixed upstream by 0.19). The optimizer's gradient norm then
    counts every unmarked shard as a TP duplicate, on TP rank 0 only: with TP > 1 the norm - and
    with it gradient clipping - is wrong (found by tests/actor at TP=2). Marking them is exact:
    these three layer types always shard their weight, along dim 0, 1 and 0 respectively.
    """
    repaired = 0
    for model in models:
        for module in model.modules():
            if isinstance(module, (ColumnParallelLinear, VocabParallelEmbedding)):
                dim = 0
            elif isinstance(module, RowParallelLinear):
                dim = 1
            else:
                continue
            weight = getattr(module, "weight", None)
            if isinstance(weight, torch.nn.Parameter) and not hasattr(weight, "tensor_model_parallel"):
                set_tensor_model_parallel_attributes(weight, True, dim, 1)
                repaired += 1
    return repaired


# ---------------------------------------------------------------------------------------------
# Built model vs HF config
# ---------------------------------------------------------------------------------------------


def check_against_hf(models: list[torch.nn.Module], cfg: HFModelConfig) -> list[str]:
    """Compare the built model chunks with the HF config; raise ValueError listing every mismatch.

    Returns the list of checks that passed (for logs). Checks: sizes (hidden, heads, query groups,
    head dim, FFN, layers, vocabulary and its padding), norm type and epsilon, activation, biases,
    q/k norm, tied embeddings, RoPE base and scaling (as the exact inverse frequencies); for MoE models
    the experts, top-k, expert width, router normalisation and shared expert.
    """
    if not models:
        raise ValueError("no model chunks to check")
    config = models[0].config
    tp = config.tensor_model_parallel_size
    expected_vocab = padded_vocab_size(cfg.vocab_size, tp)
    checks = [
        ("hidden_size", config.hidden_size, cfg.hidden_size),
        ("num_layers", config.num_layers, cfg.num_layers),
        ("num_attention_heads", config.num_attention_heads, cfg.num_attention_heads),
        ("num_query_groups (num_key_value_heads)", config.num_query_groups, cfg.num_key_value_heads),
        ("kv_channels (head_dim)", config.kv_channels, cfg.head_dim),
        ("ffn_hidden_size (intermediate_size)", config.ffn_hidden_size, cfg.ffn_hidden_size),
        ("normalization", config.normalization, "RMSNorm"),
        ("layernorm_epsilon (rms_norm_eps)", config.layernorm_epsilon, cfg.rms_norm_eps),
        ("gated_linear_unit", config.gated_linear_unit, True),
        ("activation_func", getattr(config.activation_func, "__name__", config.activation_func), "silu"),
        ("add_bias_linear", config.add_bias_linear, False),
        ("add_qkv_bias", config.add_qkv_bias, cfg.qkv_bias),
        ("qk_layernorm", config.qk_layernorm, cfg.qk_norm),
        ("num_moe_experts (num_experts)", config.num_moe_experts, cfg.num_experts or None),
    ]
    if cfg.is_moe:
        checks += [
            ("moe_router_topk (num_experts_per_tok)", config.moe_router_topk, cfg.num_experts_per_tok),
            ("moe_ffn_hidden_size (moe_intermediate_size)", config.moe_ffn_hidden_size, cfg.moe_ffn_hidden_size),
            ("moe_router_score_function", config.moe_router_score_function, "softmax"),
            ("moe_router_pre_softmax (not norm_topk_prob)", config.moe_router_pre_softmax, not cfg.norm_topk_prob),
            ("moe_shared_expert_intermediate_size (shared_expert_intermediate_size)",
             config.moe_shared_expert_intermediate_size, cfg.shared_expert_ffn_hidden_size),
            ("moe_shared_expert_gate", config.moe_shared_expert_gate, cfg.shared_expert_ffn_hidden_size is not None),
        ]  # fmt: skip
    expected_inv_freq = rope_inv_freq(cfg)
    for index, model in enumerate(models):
        checks += [
            (f"chunk {index} share_embeddings_and_output_weights (tie_word_embeddings)",
             model.share_embeddings_and_output_weights, cfg.tie_word_embeddings),
            (f"chunk {index} padded vocab_size", model.vocab_size, expected_vocab),
            (f"chunk {index} position_embedding_type", model.position_embedding_type, "rope"),
        ]
        inv_freq = model.rotary_pos_emb.inv_freq.detach().float().cpu()
        same = inv_freq.shape == expected_inv_freq.shape and torch.equal(inv_freq, expected_inv_freq)
        checks.append((f"chunk {index} RoPE inverse frequencies (rope_theta={cfg.rope_theta}, scaling={cfg.rope_scaling})",
                       "equal" if same else "different", "equal"))
    failures = [f"{name}: Megatron {got!r} != HF {want!r}" for name, got, want in checks if got != want]
    if expected_vocab < cfg.vocab_size:
        failures.append(f"padded vocab {expected_vocab} < vocab_size {cfg.vocab_size}")
    if failures:
        raise ValueError("built Megatron model does not match the HF config:\n  " + "\n  ".join(failures))
    return [f"{name}: {want!r}" for name, _, want in checks]
