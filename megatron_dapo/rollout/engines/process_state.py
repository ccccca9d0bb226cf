"""Keep a colocated inference engine from changing the trainer's process-wide settings.

In the SPMD placement vLLM builds its worker inside the trainer's own process, and its CPU worker
changes things that belong to the whole process (vLLM 0.32, `v1/worker/cpu_worker.py`,
`platforms/cpu.py`): it replaces `torch.set_num_threads` with a stub that only warns, binds the
process's memory to one NUMA node (`init_cpu_memory_env`: a `set_mempolicy` MPOL_BIND), reseeds
torch's global generators (`set_random_seed`), and rewrites environment variables (`LOCAL_WORLD_SIZE`
becomes the engine's TP size, `LD_PRELOAD` gains tcmalloc / libgomp for later child processes,
`VLLM_ENABLE_V1_MULTIPROCESSING=0`, ...). Left in place, Megatron would lose its thread count
setter, allocate only on the engine's node, train with a reseeded generator, and spawn reward
workers with another preload. `preserved_process_state` puts all of it back once the engine is
built (the engine keeps working: it read what it needed while starting).

`temporary_environment` is the one helper for "these variables while an engine starts, then as
before" (SGLang's processes read theirs at start).

`sigterm_ignored_by_new_processes`: under SLURM a SIGTERM (preemption, `--signal=TERM@N`) reaches
every process of the job step, the engine's own processes included (vLLM's engine core and TP
workers, SGLang's scheduler and detokenizer), and those exit on it at once: the running `generate`
fails, or the trainer's exit save finds no engine. Processes started in this context keep SIGTERM
blocked for their whole life, so the trainer alone decides when they stop (it saves, then shuts
the engine down). A blocked signal, not an ignored one: an ignored disposition would be replaced by
the handlers vLLM and SGLang install in their processes, whereas a blocked one is inherited through
fork and exec (multiprocessing's spawn) and by every thread and process those start, whatever
handler they install; and the trainer's own SIGTERM during the start is delivered after it, not
lost as it would be with SIG_IGN.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import multiprocessing
import platform
import random
import signal
from dataclasses import dataclass, field
from multiprocessing import resource_tracker
from typing import Iterator, Mapping, Optional

import torch

# set_mempolicy / get_mempolicy syscall numbers (not exported by Python's os module).
_MEMPOLICY_SYSCALLS = {"x86_64": (238, 239), "aarch64": (237, 236), "ppc64le": (261, 260), "s390x": (270, 269)}
_NODEMASK_WORDS = 16  # 1024 NUMA nodes


@dataclass(frozen=True)
class MemoryPolicy:
    mode: int
    nodemask: tuple[int, ...]


def _libc() -> Optional[ctypes.CDLL]:
    if platform.system() != "Linux" or platform.machine() not in _MEMPOLICY_SYSCALLS:
        return None
    try:
        return ctypes.CDLL(None, use_errno=True)
    except OSError:
        return None


def get_memory_policy() -> Optional[MemoryPolicy]:
    """This thread's NUMA memory policy (Linux), or None where it cannot be read."""
    libc = _libc()
    if libc is None:
        return None
    _, get_number = _MEMPOLICY_SYSCALLS[platform.machine()]
    mode = ctypes.c_int(0)
    mask = (ctypes.c_ulong * _NODEMASK_WORDS)()
    if libc.syscall(get_number, ctypes.byref(mode), mask, ctypes.c_ulong(_NODEMASK_WORDS * 64), None, ctypes.c_ulong(0)) != 0:
        return None
    return MemoryPolicy(mode.value, tuple(mask))


def set_memory_policy(policy: MemoryPolicy) -> bool:
    """Restore a policy read by `get_memory_policy`; False if the kernel refused it."""
    libc = _libc()
    if libc is None:
        return False
    set_number, _ = _MEMPOLICY_SYSCALLS[platform.machine()]
    if policy.mode == 0:  # MPOL_DEFAULT takes no node mask
        return libc.syscall(set_number, ctypes.c_int(0), None, ctypes.c_ulong(0)) == 0
    mask = (ctypes.c_ulong * _NODEMASK_WORDS)(*policy.nodemask)
    # The kernel reads maxnode - 1 bits: pass one more than the mask holds.
    return libc.syscall(set_number, ctypes.c_int(policy.mode), mask, ctypes.c_ulong(_NODEMASK_WORDS * 64 + 1)) == 0


def _set_environment(values: Mapping[str, Optional[str]]) -> None:
    """Set each variable of `values` in os.environ; None unsets it. Unchanged values are not rewritten."""
    for name, value in values.items():
        if value is None:
            os.environ.pop(name, None)
        elif os.environ.get(name) != value:
            os.environ[name] = value


@contextlib.contextmanager
def temporary_environment(values: Mapping[str, Optional[str]]) -> Iterator[None]:
    """`values` in os.environ (None: unset) while the body runs, then each of them as it was.

    For engines whose processes, started in the body, read their settings from the environment.
    """
    saved = {name: os.environ.get(name) for name in values}
    _set_environment(values)
    try:
        yield
    finally:
        _set_environment(saved)


@contextlib.contextmanager
def preserved_process_state() -> Iterator[None]:
    """Run the body, then restore environment, torch threads and their setter, RNGs and NUMA policy."""
    environment = dict(os.environ)
    threads, interop_setter, thread_setter = torch.get_num_threads(), torch.set_num_interop_threads, torch.set_num_threads
    cpu_rng = torch.get_rng_state()
    cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
    python_rng = random.getstate()
    try:
        import numpy

        numpy_rng = numpy.random.get_state()
    except ImportError:  # pragma: no cover - numpy comes with torch here
        numpy, numpy_rng = None, None
    memory_policy = get_memory_policy()
    try:
        yield
    finally:
        torch.set_num_threads = thread_setter
        torch.set_num_interop_threads = interop_setter
        if torch.get_num_threads() != threads:
            torch.set_num_threads(threads)
        _set_environment({**dict.fromkeys(os.environ), **environment})  # what the body added goes
        torch.set_rng_state(cpu_rng)
        if cuda_rng is not None:
            torch.cuda.set_rng_state_all(cuda_rng)
        random.setstate(python_rng)
        if numpy is not None:
            numpy.random.set_state(numpy_rng)
        if memory_policy is not None and get_memory_policy() != memory_policy:
            set_memory_policy(memory_policy)


@dataclass
class StartedProcesses:
    """The multiprocessing children of this process started in a `sigterm_ignored_by_new_processes` body."""

    processes: list = field(default_factory=list)

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.processes]

    def interrupt(self) -> list[int]:
        """Send SIGINT to those still running (the stop signal they still hear); returns their pids.

        vLLM's engine core and workers stop cleanly on SIGINT as on SIGTERM; without it vLLM's own
        shutdown, whose SIGTERM stays blocked, waits its grace period and then kills them."""
        sent = []
        for process in self.processes:
            if process.is_alive():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(process.pid, signal.SIGINT)
                    sent.append(process.pid)
        return sent


@contextlib.contextmanager
def sigterm_ignored_by_new_processes() -> Iterator[StartedProcesses]:
    """Processes started in the body (and all they start) never receive SIGTERM; this process does.

    SIGTERM is blocked in the calling thread while the body runs, so children forked or spawned from
    it inherit the block (see the module doc); afterwards the thread's mask is as before, and a
    SIGTERM that came meanwhile reaches the trainer's handler then (or at once, through another of
    its threads). Yields the multiprocessing children started in the body (`StartedProcesses`)."""
    # multiprocessing's resource tracker, started on the first spawn, unblocks SIGINT and SIGTERM
    # in the starting thread once it is up (Python 3.11, `resource_tracker.ensure_running`): start it
    # before the block. The processes spawned here (and theirs) then share it and start no other.
    resource_tracker.ensure_running()
    before = {p.pid for p in multiprocessing.active_children()}
    started = StartedProcesses()
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    try:
        yield started
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)
        started.processes = [p for p in multiprocessing.active_children() if p.pid not in before]
