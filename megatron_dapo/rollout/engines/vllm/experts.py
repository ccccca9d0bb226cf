"""vLLM's fused experts, for the worker extension: the in-place reload on CPU and reading them back.

vLLM keeps a mixture-of-experts layer's routed experts in one `RoutedExperts` module (vLLM 0.32:
`model_executor/layers/fused_moe/routed_experts.py`) with two fused parameters, TP-sharded along
the intermediate dimension I:

    w13_weight   [E, 2I, H]   every expert's gate_proj rows, then its up_proj rows
    w2_weight    [E, H, I]    every expert's down_proj

and loads the checkpoint's per-expert tensors (`<layer_name>.<e>.gate_proj.weight`, ...) into them.

Reload on CPU. vLLM's CPU experts kernel (`experts/cpu_moe.py`, `CPUUnquantizedExperts.
process_weights_after_loading`) pads I to its alignment and replaces both parameters by a
pre-packed copy (`cpu_prepack_moe_weight`), which is what `cpu_fused_moe` multiplies with. vLLM
runs that step only when the layer's kernel is first built: `UnquantizedFusedMoEMethod._setup_kernel`
(`unquantized_fused_moe_method.py`) skips `moe_kernel.fused_experts.process_weights_after_loading`
on a weight update, so the layer-wise reload copies UNPACKED checkpoint-layout values into the
packed storage and the engine computes garbage with them. `repack_cpu_experts_on_reload` makes
the layer's re-processing run the kernel's step too, on the freshly loaded layer and before vLLM
copies it back into the kernel's storage: the result is what a fresh engine holds. GPU kernels
keep no copy of their own: there the skipped step is the base class's no-op
(`modular_kernel.py`, `FusedMoEExperts.process_weights_after_loading`) for every unquantized
experts kernel but MoonEP (which refuses reloads), and `_setup_kernel` re-does the only layout
change, `convert_to_unquantized_kernel_format`, copying into the parameters the kernel reads.

Reading back (`expert_shards`). The packed CPU layout is a permutation of each expert's [rows,
cols] matrix (a blocked transpose); `_pack_order` finds it by packing index digits with vLLM's
own op, so the read-back is exact and reads what the kernel multiplies with (a stale copy shows).
On GPU the Triton kernels (vLLM's unquantized default on Hopper) read the checkpoint layout as is;
other GPU layouts (FlashInfer, AITER shuffles), quantized experts and expert parallelism are not
mapped back.
"""

from __future__ import annotations

import functools
import math
from typing import Iterator, Optional

import torch

__all__ = ["expert_shards", "is_routed_experts", "repack_cpu_experts_on_reload"]

# Set on a quant method whose re-processing also runs the CPU kernel's packing (installed once).
_REPACK_MARK = "_mdapo_repacks_cpu_experts"

# Backends whose kernels read w13_weight / w2_weight in the checkpoint layout.
_CHECKPOINT_LAYOUT_BACKENDS = ("TRITON", "BATCHED_TRITON")


def _cpu_experts(method) -> Optional[object]:
    """The CPU experts kernel of an unquantized fused-MoE method, or None (another kernel, not built)."""
    from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts

    kernel = getattr(method, "moe_kernel", None)
    experts = getattr(kernel, "fused_experts", None)
    return experts if isinstance(experts, CPUUnquantizedExperts) else None


def repack_cpu_experts_on_reload(model: torch.nn.Module) -> int:
    """Make every CPU-packed experts layer of `model` re-pack when a reload re-processes it.

    vLLM's layer-wise reload calls `layer.quant_method.process_weights_after_loading(layer)` on
    the layer rebuilt from the new checkpoint-format tensors, then copies the layer's parameters
    into the kernel's storage. The method's own processing skips the kernel's packing on a weight
    update (module docstring); the wrapper adds it, exactly as the first load runs it. Idempotent;
    returns the number of layers wrapped now. A no-op where no CPU experts kernel exists (GPUs).
    """
    from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import UnquantizedFusedMoEMethod
    from vllm.model_executor.utils import is_weights_pre_processed

    wrapped = 0
    for module in model.modules():
        method = getattr(module, "quant_method", None)
        if not isinstance(method, UnquantizedFusedMoEMethod) or getattr(method, _REPACK_MARK, False):
            continue
        experts = _cpu_experts(method)
        if experts is None:
            continue
        process = method.process_weights_after_loading

        @functools.wraps(process)
        def process_and_repack(layer, process=process, experts=experts):
            process(layer)
            if not is_weights_pre_processed():  # pre-processed weights arrive packed already
                experts.process_weights_after_loading(layer)

        method.process_weights_after_loading = process_and_repack
        setattr(method, _REPACK_MARK, True)
        wrapped += 1
    return wrapped


def is_routed_experts(module: torch.nn.Module) -> bool:
    """vLLM's module holding a MoE layer's fused routed experts (w13_weight, w2_weight)."""
    from vllm.model_executor.layers.fused_moe.routed_experts import RoutedExperts

    return isinstance(module, RoutedExperts)


@functools.lru_cache(maxsize=16)
def _pack_order(rows: int, cols: int, dtype: torch.dtype, isa: str) -> torch.Tensor:
    """`order` with packed.flatten()[j] == matrix.flatten()[order[j]] for one expert's matrix
    packed by vLLM's CPU kernel (`cpu_prepack_moe_weight`, which only moves elements).

    Found by packing the flat indices written in base 2^(mantissa bits + 1), one digit per pass:
    every digit is an integer the dtype holds exactly, so nothing is rounded.
    """
    from vllm._custom_ops import cpu_prepack_moe_weight

    count = rows * cols
    base = 2 ** (round(-math.log2(torch.finfo(dtype).eps)) + 1)  # eps = 2^-(mantissa bits)
    index = torch.arange(count, dtype=torch.long)
    order = torch.zeros(count, dtype=torch.long)
    scale = 1
    while scale < count:
        digits = ((index // scale) % base).to(dtype).view(1, rows, cols)
        order += cpu_prepack_moe_weight(digits, isa).flatten().long() * scale
        scale *= base
    if not torch.equal(order.sort().values, index):
        raise NotImplementedError(f"vLLM's CPU expert packing ({isa}, {dtype}) is not a permutation: cannot read it back")
    return order


def _unpacked(packed: torch.Tensor, isa: str) -> torch.Tensor:
    """[E, rows, cols] in checkpoint layout from the CPU kernel's packed copy."""
    experts, rows, cols = packed.shape
    order = _pack_order(rows, cols, packed.dtype, isa)
    matrices = torch.empty(experts, rows * cols, dtype=packed.dtype)
    matrices[:, order] = packed.detach().reshape(experts, rows * cols).cpu()
    return matrices.view(experts, rows, cols)


def _kernel_weights(layer: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    """w13 [E, 2P, H] and w2 [E, H, P] as the layer's kernel multiplies with them, in checkpoint
    layout (P: the intermediate size per TP rank, padded as the kernel wants it)."""
    method = layer.quant_method
    experts = _cpu_experts(method)
    if experts is not None:
        if getattr(experts, "_use_zentorch", False):  # ZenDNN reads the parameters unpacked
            return layer.w13_weight.data, layer.w2_weight.data
        return _unpacked(layer.w13_weight.data, experts.isa), _unpacked(layer.w2_weight.data, experts.isa)
    backend = getattr(getattr(method, "unquantized_backend", None), "name", None)
    if backend not in _CHECKPOINT_LAYOUT_BACKENDS:
        raise NotImplementedError(f"cannot read back the experts of {layer.layer_name}: vLLM's {backend} MoE backend keeps its own layout")
    return layer.w13_weight.data, layer.w2_weight.data


def expert_shards(layer: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor, Optional[int], int]]:
    """(checkpoint name, this TP rank's shard, shard dim or None, replica count) of every expert
    matrix of a `RoutedExperts` layer: gate_proj and up_proj [I, H] (sharded on rows), down_proj
    [H, I] (on columns), under the names vLLM loads them from."""
    from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import UnquantizedFusedMoEMethod

    config = layer.moe_config
    if not isinstance(layer.quant_method, UnquantizedFusedMoEMethod):
        raise NotImplementedError(f"cannot read back the quantized experts of {layer.layer_name}")
    if config.use_ep or layer.local_num_experts != layer.global_num_experts:
        raise NotImplementedError(f"cannot read back the experts of {layer.layer_name}: vLLM's expert parallelism is not mapped back")
    if not config.is_act_and_mul or layer.ckpt_up_proj_name is None:
        raise NotImplementedError(f"cannot read back the experts of {layer.layer_name}: not a gated (gate/up) MLP")
    w13, w2 = _kernel_weights(layer)
    intermediate = config.intermediate_size_per_partition_unpadded  # this rank's rows, without padding
    padded = w13.shape[1] // 2
    dim = (0, 1) if config.tp_size > 1 else (None, None)
    for expert in range(w13.shape[0]):
        prefix = f"{layer.layer_name}.{expert}"
        yield f"{prefix}.{layer.ckpt_gate_proj_name}.weight", w13[expert, :intermediate], dim[0], 1
        yield f"{prefix}.{layer.ckpt_up_proj_name}.weight", w13[expert, padded : padded + intermediate], dim[0], 1
        yield f"{prefix}.{layer.ckpt_down_proj_name}.weight", w2[expert, :, :intermediate], dim[1], 1
