"""Process-group set-up: from a torchrun, SLURM or plain single-process launch to Megatron's groups.

    ctx = init_distributed(cfg.parallel, timeout_s=1800, seed=cfg.trainer.seed)
    ...  # build models, train
    teardown()

Launch environments, in order of precedence:
- torchrun (or any launcher that sets RANK / WORLD_SIZE / LOCAL_RANK / MASTER_ADDR / MASTER_PORT);
- SLURM `srun` with one task per GPU (SLURM_PROCID / SLURM_NTASKS / SLURM_LOCALID; the master is
  the first host of SLURM_JOB_NODELIST, the port MASTER_PORT or one derived from SLURM_JOB_ID);
- nothing: a single process (world 1) with a gloo group on a free local port, so that Megatron's
  parallel state works in a plain `python` run or a test.

NCCL on GPUs (the CUDA device is set from the local rank), gloo on the CPU, where the CPU
compatibility layer is enabled before Megatron is first imported.

Two timeouts. Every collective of the default group (and of Megatron's groups) fails after
`timeout_s` (`trainer.collective_timeout_s`): a rank that never arrives fails the job instead of
hanging. The one place where ranks legitimately wait long for each other is right after the rollout
engines generated on their own (one engine may finish minutes after another); there the ranks first
meet on the *gather group* (`gather_group()`), a gloo group over the whole world with its own long
timeout (`rollout.gather_timeout_s`), and only then move tensors over the default group (NCCL on
GPUs), where nobody waits long any more. Gloo groups are not watched by NCCL's watchdog
(`TORCH_NCCL_ASYNC_ERROR_HANDLING`): their timeout is the only limit, raised in the waiting call.
"""

from __future__ import annotations

import datetime
import math
import os
import random
import re
import socket
from dataclasses import dataclass
from typing import Any, Mapping, Optional

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

from megatron_dapo.distributed.cpu_compat import enable_cpu_compat
from megatron_dapo.distributed.layout import ParallelLayout, validate_expert_parallel

__all__ = [
    "DistributedContext",
    "LaunchEnv",
    "find_free_port",
    "gather_group",
    "gather_group_options",
    "init_distributed",
    "parse_slurm_hostlist",
    "resolve_launch_env",
    "teardown",
]

DEFAULT_TIMEOUT_S = 1800.0
DEFAULT_GATHER_TIMEOUT_S = 3 * 3600.0
GATHER_GROUP_BACKEND = "gloo"
"""The gather group's backend on every machine: a CPU wait with a timeout of its own, outside NCCL's
watchdog, and object collectives (pickles) that need no device copy."""

_gather_group: Optional[Any] = None
_gather_group_timeout: Optional[datetime.timedelta] = None


# ---------------------------------------------------------------------------------------------
# Launch environment (pure functions)
# ---------------------------------------------------------------------------------------------


def _split_top_level(text: str) -> list[str]:
    """Split on commas that are not inside [...]."""
    parts, depth, current = [], 0, []
    for ch in text:
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise ValueError(f"unbalanced ']' in SLURM hostlist {text!r}")
        if ch == "," and depth == 0:
            parts.append("".join(current))
            current = []
        else:
            current.append(ch)
    if depth != 0:
        raise ValueError(f"unbalanced '[' in SLURM hostlist {text!r}")
    parts.append("".join(current))
    return [p.strip() for p in parts if p.strip()]


def _expand_range_list(body: str, text: str) -> list[str]:
    """'01-03,07' -> ['01', '02', '03', '07'] (zero padding kept as written)."""
    values = []
    for item in body.split(","):
        item = item.strip()
        if not item:
            raise ValueError(f"empty range in SLURM hostlist {text!r}")
        match = re.fullmatch(r"(\d+)(?:-(\d+))?", item)
        if match is None:
            raise ValueError(f"bad range {item!r} in SLURM hostlist {text!r}")
        lo, hi = match.group(1), match.group(2)
        if hi is None:
            values.append(lo)
            continue
        if int(hi) < int(lo):
            raise ValueError(f"descending range {item!r} in SLURM hostlist {text!r}")
        width = len(lo)
        values.extend(str(n).zfill(width) for n in range(int(lo), int(hi) + 1))
    return values


def _expand_host(pattern: str, text: str) -> list[str]:
    """Expand every [...] of one host pattern (several brackets give their product)."""
    match = re.search(r"\[([^\[\]]*)\]", pattern)
    if match is None:
        if "[" in pattern or "]" in pattern:
            raise ValueError(f"bad host pattern {pattern!r} in SLURM hostlist {text!r}")
        return [pattern]
    prefix, suffix = pattern[: match.start()], pattern[match.end():]
    hosts = []
    for value in _expand_range_list(match.group(1), text):
        hosts.extend(_expand_host(prefix + value + suffix, text))
    return hosts


def parse_slurm_hostlist(hostlist: str) -> list[str]:
    """Expand SLURM's compressed hostlist syntax, in order.

    >>> parse_slurm_hostlist("gpu[01-03,07],cpu5")
    ['gpu01', 'gpu02', 'gpu03', 'gpu07', 'cpu5']
    """
    if not hostlist or not hostlist.strip():
        raise ValueError("empty SLURM hostlist")
    hosts: list[str] = []
    for pattern in _split_top_level(hostlist.strip()):
        hosts.extend(_expand_host(pattern, hostlist))
    return hosts


def find_free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


@dataclass(frozen=True)
class LaunchEnv:
    """Where this process sits in the launch: rank, world, local rank and the rendezvous address."""

    rank: int
    world_size: int
    local_rank: int
    master_addr: str
    master_port: int
    source: str
    """"torchrun", "slurm" or "single"."""


def slurm_master_port(env: Mapping[str, str]) -> int:
    """MASTER_PORT if set, else a port derived from SLURM_JOB_ID (same on every task of the job)."""
    if env.get("MASTER_PORT"):
        return int(env["MASTER_PORT"])
    job_id = env.get("SLURM_JOB_ID") or env.get("SLURM_JOBID")
    if not job_id or not job_id.strip().isdigit():
        raise ValueError("SLURM launch without MASTER_PORT or a numeric SLURM_JOB_ID: export MASTER_PORT in the sbatch script")
    return 15000 + int(job_id) % 20000


def resolve_launch_env(env: Optional[Mapping[str, str]] = None, free_port: Optional[int] = None) -> LaunchEnv:
    """Read the launch environment (torchrun, then SLURM, else single process) from `env`.

    `free_port` is the port used for a single-process launch (found with `find_free_port` if None).
    """
    env = os.environ if env is None else env
    if "RANK" in env and "WORLD_SIZE" in env:
        missing = [k for k in ("MASTER_ADDR", "MASTER_PORT") if not env.get(k)]
        if missing:
            raise ValueError(f"RANK/WORLD_SIZE are set but {', '.join(missing)} is not: launch with torchrun")
        return LaunchEnv(
            rank=int(env["RANK"]),
            world_size=int(env["WORLD_SIZE"]),
            local_rank=int(env.get("LOCAL_RANK", "0")),
            master_addr=env["MASTER_ADDR"],
            master_port=int(env["MASTER_PORT"]),
            source="torchrun",
        )
    if "SLURM_PROCID" in env and "SLURM_NTASKS" in env:
        nodelist = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
        if env.get("MASTER_ADDR"):
            master = env["MASTER_ADDR"]
        elif nodelist:
            master = parse_slurm_hostlist(nodelist)[0]
        else:
            raise ValueError("SLURM launch without SLURM_JOB_NODELIST or MASTER_ADDR")
        return LaunchEnv(
            rank=int(env["SLURM_PROCID"]),
            world_size=int(env["SLURM_NTASKS"]),
            local_rank=int(env.get("SLURM_LOCALID", "0")),
            master_addr=master,
            master_port=slurm_master_port(env),
            source="slurm",
        )
    return LaunchEnv(0, 1, 0, "127.0.0.1", free_port or find_free_port(), "single")


# ---------------------------------------------------------------------------------------------
# Process groups
# ---------------------------------------------------------------------------------------------


def gather_group_options(gather_timeout_s: float) -> tuple[str, datetime.timedelta]:
    """(backend, timeout) of the gather group for `rollout.gather_timeout_s`; pure.

    Always gloo, whatever the default backend: a rank waiting there for a slow engine must neither
    trip NCCL's watchdog nor hold a GPU stream.
    """
    if not gather_timeout_s > 0:
        raise ValueError(f"rollout.gather_timeout_s must be > 0, got {gather_timeout_s}")
    return GATHER_GROUP_BACKEND, datetime.timedelta(seconds=float(gather_timeout_s))


def gather_group() -> Optional[Any]:
    """The gloo group where ranks meet after generating independently (see the module doc).

    None before `init_distributed` (or where torch.distributed was set up by other code): callers
    then use the default group.
    """
    return _gather_group


def _make_gather_group(gather_timeout_s: float) -> None:
    """Create the gather group (a collective over the world: every rank calls it), once per timeout."""
    global _gather_group, _gather_group_timeout
    backend, timeout = gather_group_options(gather_timeout_s)
    if _gather_group is not None and _gather_group_timeout == timeout:
        return  # kept from an earlier layout over the same processes (teardown(keep_process_group=True))
    _gather_group = dist.new_group(backend=backend, timeout=timeout)
    _gather_group_timeout = timeout


def _forget_gather_group() -> None:
    global _gather_group, _gather_group_timeout
    _gather_group, _gather_group_timeout = None, None


@dataclass(frozen=True)
class DistributedContext:
    """What `init_distributed` set up for this process."""

    launch: LaunchEnv
    layout: ParallelLayout
    backend: str
    device: torch.device
    cpu_compat: bool
    ep: int = 1
    """Expert-parallel size (`parallel.ep`; 1 for dense models)."""

    @property
    def rank(self) -> int:
        return self.launch.rank

    @property
    def world_size(self) -> int:
        return self.launch.world_size


def init_distributed(
    parallel_cfg: Any,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    seed: int = 1234,
    env: Optional[Mapping[str, str]] = None,
    gather_timeout_s: float = DEFAULT_GATHER_TIMEOUT_S,
) -> DistributedContext:
    """Initialise torch.distributed and Megatron's model-parallel state for this process.

    `parallel_cfg` is anything with tp/pp/vpp/cp attributes (`config.ParallelConfig`, `ParallelLayout`),
    and optionally `ep`, the expert-parallel size of mixture-of-experts models (default 1).
    `timeout_s` bounds every collective (a rank that never arrives fails the job instead of hanging),
    except on the gather group (`gather_group()`), which is created here with `gather_timeout_s`.
    Seeds Python, NumPy and torch with `seed + 100 * pp_rank` (Megatron's convention) and Megatron's
    tensor-parallel RNG tracker.
    """
    cpu_compat = enable_cpu_compat()  # before Megatron is imported below

    if parallel_state.model_parallel_is_initialized():
        raise RuntimeError("Megatron's parallel state is already initialised in this process: call teardown() first")

    launch = resolve_launch_env(env)
    layout = ParallelLayout.from_config(parallel_cfg).resolve(launch.world_size)
    ep = int(getattr(parallel_cfg, "ep", 1) or 1)
    validate_expert_parallel(ep, world_size=launch.world_size, tp=layout.tp, pp=layout.pp, cp=layout.cp)

    use_cuda = torch.cuda.is_available()
    backend = "nccl" if use_cuda else "gloo"
    if use_cuda:
        torch.cuda.set_device(launch.local_rank % torch.cuda.device_count())
        device = torch.device("cuda", torch.cuda.current_device())
    else:
        device = torch.device("cpu")

    if not dist.is_initialized():
        # env:// reads these four variables; set them so SLURM and single launches look like torchrun.
        os.environ["MASTER_ADDR"] = launch.master_addr
        os.environ["MASTER_PORT"] = str(launch.master_port)
        os.environ["RANK"] = str(launch.rank)
        os.environ["WORLD_SIZE"] = str(launch.world_size)
        os.environ["LOCAL_RANK"] = str(launch.local_rank)
        dist.init_process_group(
            backend=backend,
            init_method="env://",
            rank=launch.rank,
            world_size=launch.world_size,
            timeout=datetime.timedelta(seconds=timeout_s),
        )
    elif dist.get_world_size() != launch.world_size:
        raise RuntimeError(
            f"torch.distributed is initialised with world size {dist.get_world_size()}, "
            f"the launch environment says {launch.world_size}"
        )

    _make_gather_group(gather_timeout_s)
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=layout.tp,
        pipeline_model_parallel_size=layout.pp,
        virtual_pipeline_model_parallel_size=layout.megatron_vpp,
        context_parallel_size=layout.cp,
        expert_model_parallel_size=ep,
        distributed_timeout_minutes=max(1, math.ceil(timeout_s / 60)),
    )

    stage_seed = seed + 100 * parallel_state.get_pipeline_model_parallel_rank()
    random.seed(stage_seed)
    try:
        import numpy as np

        np.random.seed(stage_seed)
    except ImportError:  # numpy is a dependency, but seeding must not be the reason a run fails
        pass
    torch.manual_seed(stage_seed)
    model_parallel_cuda_manual_seed(stage_seed)

    return DistributedContext(launch=launch, layout=layout, backend=backend, device=device, cpu_compat=cpu_compat, ep=ep)


def teardown(keep_process_group: bool = False) -> None:
    """Destroy Megatron's model-parallel groups and the default process group (safe to call twice).

    With `keep_process_group`, only Megatron's groups go: `init_distributed` can then set up another
    layout over the same processes (tests do this to try several layouts in one launch).
    """
    try:
        from megatron.core import parallel_state

        parallel_state.destroy_model_parallel()
    except ImportError:
        pass
    if dist.is_initialized() and not keep_process_group:
        dist.destroy_process_group()  # every group, the gather group included
        _forget_gather_group()
    elif not dist.is_initialized():
        _forget_gather_group()
