"""Process-group set-up: from a torchrun, SLURM or plain single-process launch to Megatron's groups.

    ctx = init_distributed(cfg.parallel_layout(world_size), timeout_s=1800, seed=cfg.trainer.seed)
    ...  # build models, train
    teardown()

Launch environments (read by `launch.resolve_launch_env`), in order of precedence:
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

Liveness. A fixed timeout sized for a long generation batch would also keep everyone waiting that
long for a rank whose node is gone. So every rank beats in the job's store from `init_distributed`
to `teardown` (`liveness`), and the long waits (the gathers after generating, the replica's meeting
around the engine's start, sleep and wake) first wait for every rank's arrival in the store: a rank
that stops beating ends the wait within about 1.5 x `rollout.liveness_window_s`; one that beats is
waited for as long as it takes, up to `rollout.gather_timeout_s` (a rank alive but stuck). Only then
do the ranks enter the gather group's collectives, where everyone is already there.
"""

from __future__ import annotations

import datetime
import math
import os
import random
import time
from dataclasses import dataclass
from typing import Any, Mapping, Optional

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

from megatron_dapo.compat.versions import require
from megatron_dapo.distributed import liveness
from megatron_dapo.distributed.bridge import Bridge, bridge_members, split_worlds
from megatron_dapo.distributed.cpu_compat import enable_cpu_compat
from megatron_dapo.distributed.launch import LaunchEnv, find_free_port, resolve_launch_env
from megatron_dapo.distributed.layout import ParallelLayout

__all__ = [
    "DistributedContext",
    "gather_group",
    "gather_group_options",
    "init_distributed",
    "leave_together",
    "process_role",
    "teardown",
]

DEFAULT_TIMEOUT_S = 1800.0
DEFAULT_GATHER_TIMEOUT_S = 3 * 3600.0
GATHER_GROUP_BACKEND = "gloo"
"""The gather group's backend on every machine: a CPU wait with a timeout of its own, outside NCCL's
watchdog, and object collectives (pickles) that need no device copy."""

_role = "trainer"
_gather_group: Optional[Any] = None
_gather_group_timeout: Optional[datetime.timedelta] = None

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

def process_role() -> str:
    """"trainer", or "rollout" on the separate placement's engine ranks (whose default group is their own world)."""
    return _role


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
    role: str = "trainer"
    """"trainer", or "rollout" on the separate placement's engine ranks (no Megatron state there)."""
    bridge: Optional[Bridge] = None
    """The separate placement's link between the trainer's head and the engines' owners (`bridge.py`);
    None on every other rank and in the colocated placements."""

    @property
    def rank(self) -> int:
        """This process's rank in the launch (the trainer's ranks come first: there it is the
        default group's rank too)."""
        return self.launch.rank

    @property
    def world_size(self) -> int:
        """Processes of the launch (the separate placement's trainer world is `layout.world_size`)."""
        return self.launch.world_size

def init_distributed(
    layout: ParallelLayout,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    seed: int = 1234,
    env: Optional[Mapping[str, str]] = None,
    gather_timeout_s: float = DEFAULT_GATHER_TIMEOUT_S,
) -> DistributedContext:
    """Initialise torch.distributed and Megatron's model-parallel state for this process.

    `layout` is the run's `ParallelLayout` (`Config.parallel_layout` at start-up; a layout made in
    code is resolved against the launch's world size here). The context's `layout` is the resolved
    one: every later step takes its sizes from it.
    `timeout_s` bounds every collective (a rank that never arrives fails the job instead of hanging),
    except on the gather group (`gather_group()`), which is created here with `gather_timeout_s`,
    the bound on a wait for a live rank (`liveness`, whose beat starts here).
    Seeds Python, NumPy and torch with `seed + 100 * pp_rank` (Megatron's convention) and Megatron's
    tensor-parallel RNG tracker.
    """
    if not isinstance(layout, ParallelLayout):
        raise TypeError(f"init_distributed takes a ParallelLayout (Config.parallel_layout), got {type(layout).__name__}")
    cpu_compat = enable_cpu_compat()  # before Megatron is imported below
    # The start-up check: a Megatron-Core outside the tested range, or without an API the package
    # calls, stops here with its version, the tested ones and a pip command, not minutes later.
    require("megatron-core")

    if parallel_state.model_parallel_is_initialized():
        raise RuntimeError("Megatron's parallel state is already initialised in this process: call teardown() first")

    launch = resolve_launch_env(env)
    layout = layout.resolve(launch.world_size)

    use_cuda = torch.cuda.is_available()
    backend = "nccl" if use_cuda else "gloo"
    if use_cuda:
        torch.cuda.set_device(launch.local_rank % torch.cuda.device_count())
        device = torch.device("cuda", torch.cuda.current_device())
    else:
        device = torch.device("cpu")

    global _role, _launch_world
    bridge = None
    role = layout.role(launch.rank) if layout.separate else "trainer"
    _role = role
    if not dist.is_initialized():
        # env:// reads these four variables; set them so SLURM and single launches look like torchrun.
        os.environ["MASTER_ADDR"] = launch.master_addr
        os.environ["MASTER_PORT"] = str(launch.master_port)
        os.environ["RANK"] = str(launch.rank)
        os.environ["WORLD_SIZE"] = str(launch.world_size)
        os.environ["LOCAL_RANK"] = str(launch.local_rank)
        timeout = datetime.timedelta(seconds=timeout_s)
        if layout.separate:
            # Two worlds from the launch's one store (`bridge.split_worlds`): Megatron sees the trainer's.
            store, _, _ = next(dist.rendezvous("env://", rank=launch.rank, world_size=launch.world_size, timeout=timeout))
            _launch_world = (store, launch.rank, launch.world_size)  # where the two worlds leave together
            own_store, own_rank, own_world = split_worlds(store, layout, launch.rank)
            dist.init_process_group(backend=backend, store=own_store, rank=own_rank, world_size=own_world, timeout=timeout)
            bridge = Bridge.connect(store, bridge_members(layout), launch.rank, device, gather_timeout_s)
        else:
            dist.init_process_group(
                backend=backend, init_method="env://", rank=launch.rank, world_size=launch.world_size, timeout=timeout
            )
    elif layout.separate:
        raise RuntimeError("the separate placement splits the launch into two worlds: torch.distributed must not be initialised before")
    elif dist.get_world_size() != launch.world_size:
        raise RuntimeError(
            f"torch.distributed is initialised with world size {dist.get_world_size()}, "
            f"the launch environment says {launch.world_size}"
        )

    _make_gather_group(gather_timeout_s)
    liveness.configure(limit_s=gather_timeout_s)
    liveness.start_beating()  # before any rank can wait for this one
    if role == "rollout":  # the engines' ranks hold no actor: no Megatron state, the launch's seed
        _seed_everything(seed)
        return DistributedContext(launch=launch, layout=layout, backend=backend, device=device, cpu_compat=cpu_compat, role=role, bridge=bridge)
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=layout.tp,
        pipeline_model_parallel_size=layout.pp,
        virtual_pipeline_model_parallel_size=layout.megatron_vpp,
        context_parallel_size=layout.cp,
        expert_model_parallel_size=layout.ep,
        distributed_timeout_minutes=max(1, math.ceil(timeout_s / 60)),
    )

    stage_seed = seed + 100 * parallel_state.get_pipeline_model_parallel_rank()
    _seed_everything(stage_seed)
    model_parallel_cuda_manual_seed(stage_seed)

    return DistributedContext(launch=launch, layout=layout, backend=backend, device=device, cpu_compat=cpu_compat, bridge=bridge)


def _seed_everything(seed: int) -> None:
    random.seed(seed)
    try:
        import numpy as np

        np.random.seed(seed)
    except ImportError:  # numpy is a dependency, but seeding must not be the reason a run fails
        pass
    torch.manual_seed(seed)

LEAVE_TIMEOUT_S = 300.0
"""How long rank 0 waits at the end of a run for the other ranks to leave (`leave_together`): an
engine's shut-down takes seconds; a rank that never comes has failed, and the job with it."""
_LEFT_KEY = "mdapo/left"
_LEAVE_POLL_S = 0.05
_launch_world: Optional[tuple[Any, int, int]] = None
"""The separate placement's launch-wide (store, rank, world size): its trainer and rollout worlds
each have a default group of their own, over a prefix of this one store."""


def leave_together(timeout_s: float = LEAVE_TIMEOUT_S) -> bool:
    """At the end of a run every rank ends the same way: each rank but 0 checks out in the job's
    store, and rank 0 waits for all of them before it goes on to exit.

    Where the ranks rendezvous themselves (srun, or any env:// launch), the store lives in rank 0's
    process (torchrun's agent holds it otherwise), and a rank that uses it after rank 0 has exited
    fails ("Connection was likely closed"): the separate placement's engine owners count themselves
    done there after shutting their engines down, which takes longer than the trainer's exit. False
    when rank 0 stopped waiting after `timeout_s` (it says so; the missing rank has failed). In the
    separate placement, over the whole launch: its two worlds share that store."""
    if _launch_world is not None:
        store, rank, world = _launch_world
    else:
        store, rank, world = dist.distributed_c10d._get_default_store(), dist.get_rank(), dist.get_world_size()
    if world == 1:
        return True
    if rank != 0:
        store.add(_LEFT_KEY, 1)
        return True
    deadline = time.monotonic() + timeout_s
    while (left := int(store.add(_LEFT_KEY, 0))) < world - 1:
        if time.monotonic() > deadline:
            print(f"[megatron-dapo] rank 0 leaves without waiting longer: {left} of the {world - 1} other ranks "
                  f"left within {timeout_s:g} s", flush=True)  # fmt: skip
            return False
        time.sleep(_LEAVE_POLL_S)
    return True


def teardown(keep_process_group: bool = False, together: bool = False) -> None:
    """Destroy Megatron's model-parallel groups and the default process group (safe to call twice).

    With `keep_process_group`, only Megatron's groups go: `init_distributed` can then set up another
    layout over the same processes (tests do this to try several layouts in one launch). With
    `together` (a run every rank ended normally), the ranks first `leave_together`.
    """
    try:
        from megatron.core import parallel_state

        parallel_state.destroy_model_parallel()
    except ImportError:
        pass
    global _role, _launch_world
    _role = "trainer"
    if dist.is_initialized() and not keep_process_group:
        if together:
            leave_together()
        liveness.stop_beating()  # its store goes with the default group
        dist.destroy_process_group()  # every group, the gather group included
        _forget_gather_group()
        _launch_world = None
    elif not dist.is_initialized():
        liveness.stop_beating()
        _forget_gather_group()
