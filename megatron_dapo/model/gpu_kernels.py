"""Which optional GPU kernels this process can use, and the settings they decide.

    te = transformer_engine_status()                         # KernelStatus(available, detail)
    use_te = resolve_transformer_engine("auto", te)          # pure: mode + status -> bool
    options = gradient_options("cuda", te.available, apex_fused_wgrad_status().available)

Two optional packages change how the actor runs on a GPU:

* Transformer Engine (`model.transformer_engine`): its layer spec (fused attention, packed THD
  micro-batches, fused SwiGLU) or Megatron's local spec. TE has no CPU kernels.
* apex's ``fused_weight_gradient_mlp_cuda`` (the fused weight-gradient GEMM that accumulates into the
  fp32 ``main_grad``): Megatron's ``gradient_accumulation_fusion``.

The probes (`*_status`) import the packages once and keep the error, so a broken install is never
silent: the start-up line says what was chosen and why (`describe_layer_choice`). The decisions are
pure functions of (device, what is importable, what the caller asked), tested on the CPU.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Literal, Optional

import torch

from megatron_dapo.errors import ConfigError

__all__ = [
    "GradientOptions",
    "KernelStatus",
    "TransformerEngineUnavailable",
    "apex_fused_wgrad_status",
    "describe_layer_choice",
    "gradient_options",
    "resolve_transformer_engine",
    "transformer_engine_status",
]

TEMode = Literal["auto", "on", "off"]

APEX_FUSED_WGRAD_MODULE = "fused_weight_gradient_mlp_cuda"
"""The extension megatron-core's tensor_parallel/layers.py imports for gradient accumulation fusion."""


@dataclass(frozen=True)
class KernelStatus:
    """Whether an optional kernel package can be used here, and the version or the reason it cannot."""

    available: bool
    detail: str


class TransformerEngineUnavailable(ConfigError):
    """`model.transformer_engine=on` on a machine where Transformer Engine cannot be used."""


def _import_error(module: str, error: BaseException) -> str:
    return f"import {module} failed: {type(error).__name__}: {error}".strip()


@functools.lru_cache(maxsize=1)
def transformer_engine_status() -> KernelStatus:
    """Transformer Engine's PyTorch API: importable on a CUDA machine? (cached: imported once)."""
    if not torch.cuda.is_available():
        return KernelStatus(False, "no CUDA device; Transformer Engine has no CPU kernels")
    try:
        import transformer_engine
        import transformer_engine.pytorch  # noqa: F401
    except Exception as error:  # a broken install (missing .so, ABI mismatch) is reported, not raised
        return KernelStatus(False, _import_error("transformer_engine.pytorch", error))
    return KernelStatus(True, f"Transformer Engine {getattr(transformer_engine, '__version__', '(version unknown)')}")


@functools.lru_cache(maxsize=1)
def apex_fused_wgrad_status() -> KernelStatus:
    """apex's fused weight-gradient GEMM extension: importable on a CUDA machine? (cached)."""
    if not torch.cuda.is_available():
        return KernelStatus(False, "no CUDA device")
    try:
        __import__(APEX_FUSED_WGRAD_MODULE)
    except Exception as error:
        return KernelStatus(False, _import_error(APEX_FUSED_WGRAD_MODULE, error))
    return KernelStatus(True, f"apex {APEX_FUSED_WGRAD_MODULE}")


# ---------------------------------------------------------------------------------------------
# Transformer Engine or the local layer spec
# ---------------------------------------------------------------------------------------------


def resolve_transformer_engine(mode: TEMode, status: KernelStatus) -> bool:
    """Whether to build the TE layer spec for `model.transformer_engine` = auto / on / off.

    "on" without a usable TE raises `TransformerEngineUnavailable` with the import error: a recipe
    planned for TE's fused kernels must not quietly run the slower, hungrier local layers.
    """
    if mode not in ("auto", "on", "off"):
        raise ConfigError(f"'model.transformer_engine' must be auto, on or off, got {mode!r}")
    if mode == "off":
        return False
    if mode == "on" and not status.available:
        raise TransformerEngineUnavailable(
            f"'model.transformer_engine'=on but Transformer Engine cannot be used here: {status.detail}. "
            "Install transformer-engine[pytorch] matching this torch and CUDA (`megatron-dapo doctor` shows "
            "the import error on each node), or set model.transformer_engine=auto to run the local layer "
            "spec (slower, more activation memory than `megatron-dapo plan` assumes)"
        )
    return status.available


def describe_layer_choice(mode: TEMode, status: KernelStatus, use_te: bool, device_type: str = "cuda") -> str:
    """The start-up line naming the layer implementation and why (printed once, on rank 0)."""
    if use_te:
        return f"layers: {status.detail} (fused attention, packed micro-batches; model.transformer_engine={mode})"
    local = "layers: Megatron local spec (PyTorch SDPA attention, right-padded micro-batches"
    if mode == "off":
        return f"{local}; model.transformer_engine=off)"
    line = f"{local}; model.transformer_engine=auto, Transformer Engine not available: {status.detail})"
    if device_type == "cuda":
        line += (
            ": slower and more activation memory than `megatron-dapo plan` assumes; set "
            "model.transformer_engine=on to make a missing Transformer Engine an error"
        )
    return line


# ---------------------------------------------------------------------------------------------
# DDP gradient reduction and weight-gradient accumulation
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class GradientOptions:
    """Megatron's ``overlap_grad_reduce`` (DDP config) and ``gradient_accumulation_fusion`` (model config)."""

    overlap_grad_reduce: bool
    gradient_accumulation_fusion: bool
    reason: str
    """Why, for the start-up log."""

    def describe(self) -> str:
        on = lambda flag: "on" if flag else "off"  # noqa: E731
        return (
            f"gradients: overlap_grad_reduce {on(self.overlap_grad_reduce)}, "
            f"gradient_accumulation_fusion {on(self.gradient_accumulation_fusion)} ({self.reason})"
        )


def gradient_options(
    device_type: str,
    te_available: bool,
    apex_fused_wgrad: bool,
    *,
    overlap_grad_reduce: Optional[bool] = None,
    gradient_accumulation_fusion: Optional[bool] = None,
) -> GradientOptions:
    """Decide both flags from the device, the kernels present and what the caller forces (None: decide).

    * ``overlap_grad_reduce``: on with CUDA. Megatron DDP then starts each bucket's all-reduce /
      reduce-scatter (with or without the distributed optimizer) from backward hooks during the last
      micro-batch's backward, on NCCL's own stream. Off on the CPU: gloo runs on the same few cores as
      the backward, so there is nothing to overlap with (forcing it on works there too, which the
      tests use to check the wiring).
    * ``gradient_accumulation_fusion``: on with CUDA and apex's ``fused_weight_gradient_mlp_cuda``.
      TE's own linear layers accumulate into ``main_grad`` without apex (``fuse_wgrad_accumulation``),
      but GPTModel's output layer is Megatron's ``ColumnParallelLinear`` under both layer specs, and
      megatron-core 0.16.1 raises at its construction when the flag is on and that apex extension is
      missing: so TE alone does not enable it. Needs Megatron DDP (``main_grad``) for any backward.
    """
    cuda = device_type == "cuda"
    if gradient_accumulation_fusion and not (cuda and apex_fused_wgrad):
        raise ConfigError(
            "gradient_accumulation_fusion needs a CUDA device and apex's fused_weight_gradient_mlp_cuda "
            "(megatron-core's ColumnParallelLinear refuses the flag without it): install apex with its CUDA "
            "extensions or leave it to the automatic choice"
        )
    fusion = cuda and apex_fused_wgrad if gradient_accumulation_fusion is None else bool(gradient_accumulation_fusion)
    overlap = cuda if overlap_grad_reduce is None else bool(overlap_grad_reduce)
    if not cuda:
        reason = "CPU: no kernels to fuse, no communication stream to overlap"
    elif fusion:
        reason = "CUDA, apex fused weight-gradient GEMM" + (" and Transformer Engine" if te_available else "")
    else:
        reason = "CUDA; no apex fused_weight_gradient_mlp_cuda, which Megatron's output layer needs for fusion" + (
            " even with Transformer Engine" if te_available else ""
        )
    return GradientOptions(overlap_grad_reduce=overlap, gradient_accumulation_fusion=fusion, reason=reason)
