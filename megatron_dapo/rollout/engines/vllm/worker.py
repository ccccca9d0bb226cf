"""The worker side of the vLLM engine: methods mixed into vLLM's worker (`worker_extension_cls`).

They run where vLLM's model lives: in vLLM's worker processes (leader placement) or in the
trainer's own process (SPMD placement, `distributed_executor_backend="external_launcher"`). The
driver (`vllm_engine.VLLMEngine`) calls them with `LLM.collective_rpc`; names carry an `mdapo_`
prefix because vLLM refuses an extension whose names clash with the worker's.

Loading. Weights go through vLLM's layer-wise in-place reload
(`vllm.model_executor.model_loader.reload`): each layer is rebuilt in checkpoint format, loaded,
re-processed (on CPU: its linear weights re-packed for oneDNN) and copied back into the original
storage. A plain `model.load_weights` cannot do this on CPU, where packed linear layers keep no
checkpoint-format weight. One session may span many buckets (a fused layer - qkv_proj,
gate_up_proj - may be split across them: vLLM buffers a layer's parts until it is complete); the
driver closes it ("commits"). Committing also re-packs a tied LM head: vLLM processes a tied
weight only through the embedding, so on CPU the LM head would keep its old packed copy. Fused MoE
experts on CPU need their kernel's packing redone as well, which vLLM skips on a reload
(`vllm/experts.py`, `repack_cpu_experts_on_reload`).
Tensors arrive as safetensors bucket files (leader placement: `collective_rpc` arguments cross a
process boundary as plain lists otherwise) or, in-process, as tensors on the parameters' device
(TP slices as full-shape `tp_shards.PlacedSlice`s, which the loaders narrow to their rows).

Reading weights back (`mdapo_export_weights`). On GPU vLLM keeps its weights in checkpoint layout,
fused and TP-sharded; we split them back into HF names. On CPU, linear layers keep no readable
weight (it is packed into an opaque oneDNN / AMX handle), so the EFFECTIVE weight is read through
the layer's own kernel: feeding the identity matrix to `x @ W^T` gives `W^T` exactly (every product
is w * 1 or w * 0, every sum has one non-zero term). This also catches a stale packed copy (the
tied LM head above); for tied models `lm_head.weight` is listed as well. Fused MoE experts are
listed per expert under their checkpoint names, read from the kernel's own copy (`vllm/experts.py`).
Fusions other than qkv_proj, gate_up_proj and the experts, renamed checkpoints (`hf_to_vllm_mapper`)
and quantized layers are not mapped back.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
from pathlib import Path
from typing import Any, Iterable, Iterator, Optional

import torch
from safetensors import safe_open

from megatron_dapo.rollout.engines.vllm.experts import expert_shards, is_routed_experts, repack_cpu_experts_on_reload
from megatron_dapo.model.bucketing import write_safetensors

# vLLM is an optional install and this module is also imported where it is absent (the trainer names
# the class to vLLM): vLLM's modules are imported inside the methods, which run in vLLM's workers.

# Rows of the identity fed at once when reading a packed CPU linear weight back (bounds memory).
_IDENTITY_CHUNK = 1024


def _reported(method):
    """Run a worker method and return {"value": ...} or {"error": "..."} instead of raising.

    With TP > 1, a worker that raises makes vLLM's `collective_rpc` fail at the first error while
    the other workers' answers stay queued and are read as the answers of the NEXT call. Reporting
    the error as a value keeps every worker's answer in step; the driver raises it (`_rpc`).
    """

    @functools.wraps(method)
    def wrapper(self, *args):
        try:
            return {"value": method(self, *args)}
        except Exception as error:  # noqa: BLE001 - handed to the driver, which raises it
            return {"error": f"{type(error).__name__}: {error}"}

    return wrapper


class VLLMWorkerExtension:
    """Methods that vLLM adds to its worker (`worker_extension_cls`); called with `collective_rpc`.

    Names carry an `mdapo_` prefix because vLLM refuses an extension whose names clash with the
    worker's. Arguments and results are plain Python values (paths, dicts, lists of str/int).
    """

    def _mdapo_model(self) -> torch.nn.Module:
        return self.model_runner.get_model()  # type: ignore[attr-defined]

    @_reported
    def mdapo_begin_weight_update(self) -> None:
        """Open an in-place reload session: every layer waits for its new checkpoint-format weights."""
        from vllm.config import set_current_vllm_config
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        _quiet_rotary_reload_warning()
        model = self._mdapo_model()
        repack_cpu_experts_on_reload(model)  # CPU: the experts kernel's packed copy (vllm/experts.py)
        with set_current_vllm_config(self.vllm_config):  # type: ignore[attr-defined]
            initialize_layerwise_reload(model)

    @_reported
    def mdapo_load_weights_file(self, path: str) -> int:
        """Load the HF-named tensors of one safetensors file into the open session; returns their count.

        A layer is re-processed as soon as all its parts have arrived (possibly over several files).
        On an error the session is closed at once (layers not yet complete keep their old weights,
        partly loaded ones are undefined) so that the engine stays usable, and the error is reported.
        """
        def tensors() -> Iterator[tuple[str, torch.Tensor]]:
            with safe_open(path, framework="pt", device="cpu") as handle:
                for name in handle.keys():
                    yield name, handle.get_tensor(name)

        return self._mdapo_load(tensors())

    @_reported
    def mdapo_load_weights(self, weights: list) -> int:
        """In-process only (SPMD placement): like `mdapo_load_weights_file`, from (name, tensor) pairs."""
        return self._mdapo_load(iter(weights))

    def _mdapo_load(self, weights: Iterable[tuple[str, torch.Tensor]]) -> int:
        from vllm.config import set_current_vllm_config

        count = 0

        def counted() -> Iterator[tuple[str, torch.Tensor]]:
            nonlocal count
            for name, tensor in weights:
                count += 1
                yield name, tensor

        try:
            with set_current_vllm_config(self.vllm_config):  # type: ignore[attr-defined]
                self._mdapo_model().load_weights(counted())
        except BaseException:
            with contextlib.suppress(Exception):  # the load error is the one to report
                self._mdapo_finish_weight_update()
            raise
        return count

    @_reported
    def mdapo_parameter_device(self) -> str:
        """The device of this worker's model parameters (where in-process weight buckets are held)."""
        parameter = next(self._mdapo_model().parameters(), None)
        return str(parameter.device) if parameter is not None else "cpu"

    @_reported
    def mdapo_tensor_parallel_ranks(self) -> list[int]:
        """Global ranks of this worker's vLLM TP group, in TP-rank order (SPMD: the trainer's world)."""
        from vllm.distributed import get_tp_group

        return list(get_tp_group().ranks)

    @_reported
    def mdapo_vocab_rows(self) -> dict[str, list[int]]:
        """{HF name: [first, end)} of the real vocabulary rows this TP rank holds, per vocabulary layer.

        vLLM pads the vocabulary to a multiple of 64 before splitting it over TP ranks; Megatron pads
        to 128 * TP, so the two split points can differ (`tp_shards` exchanges rows then).
        """
        from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding

        rows = {}
        for module_name, module in self._mdapo_model().named_modules():
            if isinstance(module, VocabParallelEmbedding):
                indices = module.shard_indices
                rows[f"{module_name}.weight"] = [indices.org_vocab_start_index, indices.org_vocab_end_index]
        return rows

    @_reported
    def mdapo_finish_weight_update(self) -> list[str]:
        """Close the session; re-pack tied output heads; returns the names of the heads re-packed."""
        return self._mdapo_finish_weight_update()

    def _mdapo_finish_weight_update(self) -> list[str]:
        from vllm.config import set_current_vllm_config
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        model = self._mdapo_model()
        incomplete = _keep_old_weights_of_incomplete_layers(model)
        with set_current_vllm_config(self.vllm_config):  # type: ignore[attr-defined]
            finalize_layerwise_reload(model, self.vllm_config.model_config)  # type: ignore[attr-defined]
            refreshed = _reprocess_tied_output_heads(model)
        runner = self.model_runner  # type: ignore[attr-defined]
        for reset in ("reset_lora_state", "reset_encoder_cache", "reset_mm_cache"):
            if callable(getattr(runner, reset, None)):
                getattr(runner, reset)()
        if incomplete:
            listed = ", ".join(f"{name} ({loaded} of {total} elements)" for name, loaded, total in incomplete[:5])
            raise ValueError(
                f"{len(incomplete)} layer(s) received only part of their tensors in this weight update: {listed}. "
                "vLLM rebuilds a layer from the tensors of one update, so every part of a fused layer "
                "(q/k/v_proj, gate/up_proj) must come in the same update; these layers keep their previous weights"
            )
        return refreshed

    @_reported
    def mdapo_process(self, names: list[str]) -> dict[str, Any]:
        """This worker's process id and its values of the environment variables `names` (None: unset):
        what a vLLM process really received at launch (/proc/PID/environ is unreliable once vLLM
        retitles the process)."""
        return {"pid": os.getpid(), "environment": {name: os.environ.get(name) for name in names}}

    @_reported
    def mdapo_distributed_ident(self) -> Optional[str]:
        """The name vLLM's CPU worker gave its process group (prefix of its /dev/shm segments)."""
        return os.environ.get("VLLM_DIST_IDENT")

    @_reported
    def mdapo_seed_sampler(self, seed: int) -> None:
        """Reseed the generators vLLM's sampler draws unseeded requests from (torch's defaults: CPU and
        every GPU), so that one engine-level seed reproduces a whole generate call."""
        torch.manual_seed(seed)

    @_reported
    def mdapo_export_weights(self, directory: str) -> dict[str, Any]:
        """Write this worker's weights, HF-named, to `<directory>/tp<rank>.safetensors`.

        Returns {"tp_rank": r, "layout": {name: [shard_dim or None, replicas]}}: how the driver
        gathers the TP shards (concatenate along shard_dim over every `replicas`-th rank).
        """
        from vllm.distributed import get_tensor_model_parallel_rank

        tp_rank = get_tensor_model_parallel_rank()
        tensors: list[tuple[str, torch.Tensor]] = []
        layout: dict[str, list] = {}
        with torch.no_grad():
            for name, tensor, shard_dim, replicas in _iter_hf_named_shards(self._mdapo_model()):
                tensors.append((name, tensor))  # written from its own device into the file
                layout[name] = [shard_dim, replicas]
        write_safetensors(Path(directory) / f"tp{tp_rank}.safetensors", tensors)
        return {"tp_rank": tp_rank, "layout": layout}


def _keep_old_weights_of_incomplete_layers(model: torch.nn.Module) -> list[tuple[str, int, int]]:
    """Find the layers that got only some of their elements in the open session; make them keep
    their current weights. Returns [(module name, elements loaded, elements expected)].

    vLLM's finalize would re-materialise such a layer from the parts that arrived, leaving the rest
    (e.g. the gate half of gate_up_proj when only up_proj came) as uninitialised memory. Forgetting
    what was buffered sends the layer down finalize's "nothing loaded" path instead, which puts the
    layer's previous tensors back.
    """
    from vllm.model_executor.layers.attention import is_deferred_attention_layer
    from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding
    from vllm.model_executor.model_loader.reload.layerwise import get_layerwise_info

    incomplete = []
    for name, layer in model.named_modules():
        info = get_layerwise_info(layer)
        # A vocabulary layer is one tensor, loaded whole or not at all; it counts its padding rows
        # (vocabulary padded to 64 x TP) among the elements to load, so it always looks incomplete.
        if not info.can_load() or is_deferred_attention_layer(layer) or isinstance(layer, VocabParallelEmbedding):
            continue
        if 0 < info.load_numel < info.load_numel_total:  # type: ignore[operator]
            incomplete.append((name, info.load_numel, info.load_numel_total))
            info.load_numel = 0
            info.loaded_weights.clear()
    return incomplete


def _not_a_rotary_reload_warning(record: logging.LogRecord) -> bool:
    """A logging filter: False (drop) for vLLM's reload warning about a rotary embedding layer."""
    is_rotary = bool(record.args) and str(record.args[0]).endswith("RotaryEmbedding")
    return not (record.msg == "%s: Failed to load weights" and is_rotary)


def _quiet_rotary_reload_warning() -> None:
    """Drop vLLM's "RotaryEmbedding: Failed to load weights" warning at the end of every reload.

    A rotary layer's cos/sin cache is computed, never part of a checkpoint, so no update carries it
    and vLLM rightly keeps the existing one; the warning would repeat for every worker at every
    training step. Other layers that receive nothing are still reported.
    """
    layerwise_logger = logging.getLogger("vllm.model_executor.model_loader.reload.layerwise")
    if _not_a_rotary_reload_warning not in layerwise_logger.filters:
        layerwise_logger.addFilter(_not_a_rotary_reload_warning)


def _reprocess_tied_output_heads(model: torch.nn.Module) -> list[str]:
    """Re-run weight processing of every LM head that shares its weight with an input embedding.

    vLLM's reload processes a shared weight only through its first owner (the embedding); on CPU the
    LM head multiplies with its own packed copy (`cpu_linear`), which would otherwise keep the old
    values. Elsewhere the head reads the shared weight itself and nothing needs re-processing.
    """
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding

    embedding_weights = {
        id(module.weight)
        for module in model.modules()
        if isinstance(module, VocabParallelEmbedding) and not isinstance(module, ParallelLMHead)
    }
    refreshed = []
    for name, module in model.named_modules():
        if not isinstance(module, ParallelLMHead) or not hasattr(module, "cpu_linear"):
            continue
        if id(module.weight) in embedding_weights:
            module.quant_method.process_weights_after_loading(module)
            refreshed.append(name)
    return refreshed


def _effective_linear_weight(module: torch.nn.Module, in_features: int, dtype: torch.dtype) -> torch.Tensor:
    """The [out, in] weight that a layer's kernel multiplies with, read through the kernel itself.

    `apply(layer, I)` computes `I @ W^T` = W^T exactly; the identity is fed in row chunks.
    """
    device = next((t.device for t in module.parameters()), torch.device("cpu"))
    columns = []
    for start in range(0, in_features, _IDENTITY_CHUNK):
        rows = min(_IDENTITY_CHUNK, in_features - start)
        identity = torch.zeros(rows, in_features, dtype=dtype, device=device)
        identity[torch.arange(rows), torch.arange(start, start + rows)] = 1
        columns.append(module.quant_method.apply(module, identity, None))
    return torch.cat(columns).t().contiguous()


def _linear_weight(module: torch.nn.Module, in_features: int) -> torch.Tensor:
    if hasattr(module, "cpu_linear"):  # CPU: the parameter is emptied or a stale copy; ask the kernel
        return _effective_linear_weight(module, in_features, module.params_dtype)
    return module.weight.data


def _iter_hf_named_shards(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor, Optional[int], int]]:
    """(HF name, this rank's shard, shard dim or None if replicated, replica count) of every weight."""
    from vllm.model_executor.layers.linear import (
        ColumnParallelLinear,
        LinearBase,
        MergedColumnParallelLinear,
        QKVParallelLinear,
        RowParallelLinear,
        UnquantizedLinearMethod,
    )
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding

    handled: set[int] = set()
    for module_name, module in model.named_modules():
        prefix = f"{module_name}." if module_name else ""
        if isinstance(module, VocabParallelEmbedding):
            sharded = 0 if module.tp_size > 1 else None
            rows = module.shard_indices.num_org_elements  # this rank's real vocabulary rows (no padding)
            if isinstance(module, ParallelLMHead) and hasattr(module, "cpu_linear"):
                weight = _effective_linear_weight(module, module.embedding_dim, module.weight.dtype)
            else:
                weight = module.weight.data
            yield f"{prefix}weight", weight[:rows], sharded, 1
            if getattr(module, "bias", None) is not None:
                yield f"{prefix}bias", module.bias.data[:rows], sharded, 1
            handled.update(id(p) for p in module.parameters(recurse=False))
            continue
        if is_routed_experts(module):  # fused experts: one tensor per expert matrix, checkpoint-named
            yield from expert_shards(module)
            handled.update((id(module.w13_weight), id(module.w2_weight)))  # any other parameter: below
        if isinstance(module, LinearBase):
            if not isinstance(module.quant_method, UnquantizedLinearMethod):
                raise NotImplementedError(f"cannot read back the quantized layer {module_name}")
            handled.update(id(p) for p in module.parameters(recurse=False))
            # A replicated layer (e.g. a MoE router, `GateLinear`) has no per-partition input size.
            weight = _linear_weight(module, getattr(module, "input_size_per_partition", module.input_size))
            bias = None
            if getattr(module, "bias", None) is not None:  # CPU AMX kernels keep it in float32
                bias = module.bias.data.to(module.params_dtype)
            parallel = module.tp_size > 1
            if isinstance(module, RowParallelLinear):
                yield f"{prefix}weight", weight, 1 if parallel else None, 1
                if bias is not None:
                    yield f"{prefix}bias", bias, None, 1
                continue
            if isinstance(module, QKVParallelLinear) and module_name.endswith("qkv_proj"):
                base = module_name[: -len("qkv_proj")]
                sizes = [
                    module.num_heads * module.head_size,
                    module.num_kv_heads * module.head_size,
                    module.num_kv_heads * module.v_head_size,
                ]
                kv_replicas = module.num_kv_head_replicas  # TP > KV heads: each KV head lives on several ranks
                parts = [(f"{base}q_proj", 1), (f"{base}k_proj", kv_replicas), (f"{base}v_proj", kv_replicas)]
            elif isinstance(module, MergedColumnParallelLinear) and module_name.endswith("gate_up_proj"):
                base = module_name[: -len("gate_up_proj")]
                sizes = [size // module.tp_size for size in module.output_sizes]
                parts = [(f"{base}gate_proj", 1), (f"{base}up_proj", 1)]
            else:  # a plain column-parallel or replicated layer, or a fusion we do not map: vLLM's name
                dim = 0 if parallel and isinstance(module, ColumnParallelLinear) else None
                yield f"{prefix}weight", weight, dim, 1
                if bias is not None:
                    yield f"{prefix}bias", bias, dim, 1
                continue
            dim = 0 if parallel else None
            for (name, replicas), piece in zip(parts, weight.split(sizes, dim=0)):
                yield f"{name}.weight", piece, dim, replicas
            if bias is not None:
                for (name, replicas), piece in zip(parts, bias.split(sizes, dim=0)):
                    yield f"{name}.bias", piece, dim, replicas
            continue
        for param_name, param in module.named_parameters(recurse=False):
            if id(param) not in handled:  # norms and other replicated parameters
                handled.add(id(param))
                yield f"{prefix}{param_name}", param.data, None, 1
