"""RMSNorm for Megatron's local layer spec that also runs under sequence parallelism.

Megatron-Core's local spec normalises with `WrappedTorchNorm`, which returns a plain
`torch.nn.RMSNorm` and asserts ``not config.sequence_parallel``: without Transformer Engine (or apex)
there is no sequence parallelism, so on a CPU, or a GPU without TE, a TP x SP (x CP) layout could not
be built at all. The mathematics of the norm does not change under SP - each TP rank normalises its
own slice of the sequence - only its weight gradient becomes a partial sum over that slice. Megatron's
`finalize_model_grads` already all-reduces, over TP, the gradients of parameters marked
``sequence_parallel = True`` (how TE's and apex's norms are handled), so marking the weight is all
that is needed. Without SP the module is exactly `torch.nn.RMSNorm`, as `WrappedTorchNorm` builds it.

    spec = with_sequence_parallel_norms(get_gpt_layer_local_spec(...))   # layer norms, q/k norms
    block = local_block_submodules(spec, config, vp_stage)               # + the final norm
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

import torch
from megatron.core.transformer import transformer_block
from megatron.core.transformer.torch_norm import WrappedTorchNorm

__all__ = ["SequenceParallelRMSNorm", "local_block_submodules", "with_sequence_parallel_norms"]


class SequenceParallelRMSNorm(torch.nn.RMSNorm):
    """`torch.nn.RMSNorm` built from Megatron's norm arguments; its weight is marked for SP."""

    def __init__(self, config: Any, hidden_size: int, eps: float = 1e-5, **unused: Any) -> None:
        if config.normalization != "RMSNorm":
            raise ValueError(f"SequenceParallelRMSNorm is an RMSNorm, config.normalization={config.normalization!r}")
        super().__init__(normalized_shape=hidden_size, eps=eps)
        # Megatron's finalize_model_grads all-reduces the gradients of `sequence_parallel` parameters over TP.
        self.weight.sequence_parallel = bool(config.sequence_parallel)


def _torch_norm_class() -> type:
    return WrappedTorchNorm


def with_sequence_parallel_norms(spec: Any) -> Any:
    """A copy of a local layer spec whose `WrappedTorchNorm` entries are `SequenceParallelRMSNorm`.

    Other norm implementations (apex's FusedLayerNorm, TE's) support SP themselves and stay.
    """
    torch_norm = _torch_norm_class()

    def swap(module: Any) -> Any:
        return SequenceParallelRMSNorm if module is torch_norm else module

    layer = spec.submodules
    attention = layer.self_attention
    attention_submodules = dataclasses.replace(
        attention.submodules,
        q_layernorm=swap(attention.submodules.q_layernorm),
        k_layernorm=swap(attention.submodules.k_layernorm),
    )
    layer = dataclasses.replace(
        layer,
        input_layernorm=swap(layer.input_layernorm),
        pre_mlp_layernorm=swap(layer.pre_mlp_layernorm),
        self_attention=dataclasses.replace(attention, submodules=attention_submodules),
    )
    return dataclasses.replace(spec, submodules=layer)


def local_block_submodules(layer_spec: Any, config: Any, vp_stage: Optional[int]) -> Any:
    """The decoder block of a local layer spec with the final norm as `SequenceParallelRMSNorm`.

    Megatron builds the block of a layer spec with its module-level `LayerNormImpl` (WrappedTorchNorm
    without TE/apex) as the final norm; spelling the block out replaces it. Same layers, same names.
    """
    final_norm = transformer_block.LayerNormImpl
    if final_norm is _torch_norm_class():
        final_norm = SequenceParallelRMSNorm
    layers = transformer_block.get_num_layers_to_build(config, vp_stage=vp_stage)
    return transformer_block.TransformerBlockSubmodules(layer_specs=[layer_spec] * layers, layer_norm=final_norm)
