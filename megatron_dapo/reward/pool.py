"""Reward worker processes: chunks of samples worked on in parallel, every sample under a deadline.

    pool = WorkerPool(num_workers=4, task=task, timeout_s=10.0, start_method=default_start_method())
    outputs, lost = pool.run(count, build, chunk_size)     # build(indices) -> one chunk's message
    pool.close()

`task(chunk, clock)` runs in a worker: it works through the chunk's samples in order, calls
`clock.start(position)` as each one begins and returns one output per sample. What a chunk and an
output are is the task's business (`reward.manager`: token ids or texts in, scores and decoded
texts out); the pool moves them, keeps the workers alive and enforces the deadlines. A reward
function must never stall the step:

* one that hangs is found by the parent, which reads each worker's "current sample started at"
  slot in shared memory (the `SampleClock`); once a sample has run for `timeout_s`, its worker is
  killed and replaced, the sample is reported lost, and the rest of its chunk is worked on again
  on the live workers. No signal is used inside the workers, so this also stops C-level hangs and
  leaves ``SIGALRM`` to reward functions that use it themselves;
* a worker that dies (segfault, ``os._exit``) is treated the same way;
* a task that cannot work at all in a worker (`WorkerCannotWork`: its function or tokenizer does
  not load there) stops the run with the task's message: no other worker could do better.

The pool lives across steps (started by its owner on first use, closed by `close`, garbage
collection or interpreter exit). Workers are started with 'forkserver' where available (never
plain 'fork', which is unsafe once torch has started threads), else 'spawn'; the task travels to
each worker once, when it starts, so it must pickle (functions by reference). Workers are daemonic
so that they can never outlive the trainer; the code they run may therefore start subprocesses
(``subprocess``) but not ``multiprocessing`` children of its own.
"""

from __future__ import annotations

import math
import multiprocessing
import multiprocessing.connection
import multiprocessing.sharedctypes
import os
import signal
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any, Optional

__all__ = ["SampleClock", "WorkerCannotWork", "WorkerPool", "default_chunk_size", "default_start_method"]

# A worker's sample-start slot holds this while no sample is being worked on.
_IDLE = 0.0
# Time a worker may take to start, load what it needs and prepare a chunk before its first sample
# starts; beyond it the worker counts as broken.
_STARTUP_GRACE_S = 120.0
# Loaded by the forkserver only: it ignores SLURM's SIGTERM (so do its workers), see there.
_FORKSERVER_INIT = "megatron_dapo.reward._forkserver_init"


class WorkerCannotWork(Exception):
    """Raised by a task inside a worker that can do no work at all (and neither could another)."""


class SampleClock:
    """A worker's shared slot: when its current sample started (monotonic; 0 = idle) and its position."""

    def __init__(self, slot: Any) -> None:
        self.slot = slot

    def start(self, position: int) -> None:
        """Sample `position` of the chunk starts now (its deadline runs from here)."""
        self.slot[1] = position  # the position first: the parent reads it once it sees a start time
        self.slot[0] = time.monotonic()

    def idle(self) -> None:
        self.slot[0] = _IDLE


def default_start_method() -> str:
    return "forkserver" if "forkserver" in multiprocessing.get_all_start_methods() else "spawn"


def default_chunk_size(count: int, num_workers: int) -> int:
    """About 4 chunks per worker (load balance, little work lost on a hang), at most 256 samples per
    message (keeps the pipe busy in both directions)."""
    return max(1, min(256, math.ceil(count / (4 * num_workers))))


def _exit_when_orphaned(parent_pid: int) -> None:
    # A worker stuck in a hung reward function never reads its pipe again; if the trainer dies
    # (even by SIGKILL) it must not be left spinning. A thread still runs during pure-Python hangs.
    while True:
        time.sleep(1.0)
        if os.getppid() != parent_pid:
            os._exit(1)


def _worker_main(conn: Any, slot: Any, task: Callable[[Any, SampleClock], list[Any]]) -> None:
    """Worker loop: receive (chunk id, chunk); send back (chunk id, outputs, None), or
    (chunk id, None, message) when the task cannot work here at all."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's business; it kills us
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # so is SLURM's SIGTERM, sent to every process of the job
    threading.Thread(target=_exit_when_orphaned, args=(os.getppid(),), daemon=True).start()
    clock = SampleClock(slot)
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):
            return
        if message is None:
            return
        chunk_id, chunk = message
        try:
            outputs = task(chunk, clock)
        except WorkerCannotWork as error:
            conn.send((chunk_id, None, str(error)))
            continue
        finally:
            clock.idle()
        conn.send((chunk_id, outputs, None))


class _Worker:
    def __init__(self, context: Any, task: Callable[[Any, SampleClock], list[Any]]) -> None:
        self.conn, child_conn = context.Pipe(duplex=True)
        # [0]: monotonic start time of the sample in hand (0 = idle); [1]: its position in the chunk.
        self.progress = multiprocessing.sharedctypes.RawArray("d", 2)
        self.process = context.Process(
            target=_worker_main, args=(child_conn, self.progress, task), name="megatron-dapo-reward", daemon=True
        )
        self.process.start()
        child_conn.close()
        self.indices: Optional[list[int]] = None  # samples of the chunk in flight
        self.chunk_id = -1
        self.dispatched_at = 0.0

    def kill(self) -> None:
        if self.process.is_alive():
            self.process.kill()
        self.process.join(timeout=5.0)
        self.conn.close()


def _shutdown(workers: list[_Worker]) -> None:
    """Ask every worker to exit, give them a moment together, then kill what is left."""
    for worker in workers:
        try:
            worker.conn.send(None)
        except (OSError, ValueError):
            pass
    deadline = time.monotonic() + 2.0
    for worker in workers:
        worker.process.join(timeout=max(0.0, deadline - time.monotonic()))
        worker.kill()
    workers.clear()


class WorkerPool:
    """Persistent worker processes running `task` on chunks, with per-sample deadlines enforced from the parent."""

    def __init__(
        self,
        num_workers: int,
        task: Callable[[Any, SampleClock], list[Any]],
        timeout_s: float,
        start_method: str,
        preload: Sequence[str] = (),
    ) -> None:
        """`preload`: modules the forkserver imports once for all workers (the task's, the tokenizer's)."""
        if start_method == "forkserver":
            # Workers fork from one server process that imported these modules once, instead of
            # each paying the imports. Has no effect if the forkserver already runs.
            multiprocessing.get_context("forkserver").set_forkserver_preload(["__main__", __name__, _FORKSERVER_INIT, *preload])
        self.num_workers = num_workers
        self.task = task
        self.timeout_s = timeout_s
        self.context = multiprocessing.get_context(start_method)
        self.workers: list[_Worker] = []
        self._next_chunk_id = 0
        # Closed at garbage collection or interpreter exit, whichever comes first.
        self._closer = weakref.finalize(self, _shutdown, self.workers)

    def close(self) -> None:
        """Stop the worker processes; idempotent. The owner makes a new pool to work again."""
        self._closer()

    def reset(self) -> None:
        """Kill every worker (after an interruption left the pipes in an unknown state)."""
        for worker in self.workers:
            worker.kill()
        self.workers.clear()

    def run(
        self, count: int, build: Callable[[list[int]], Any], chunk_size: Optional[int] = None
    ) -> tuple[list[Optional[Any]], dict[int, str]]:
        """Work on `count` samples whose chunks `build(indices)` makes (`chunk_size` None: `default_chunk_size`).

        Returns the per-sample outputs of the task (None where lost) and {index: reason} for the
        samples lost to a timeout or a crashed worker.
        """
        try:
            return self._run(count, build, chunk_size or default_chunk_size(count, self.num_workers))
        except BaseException:
            self.reset()
            raise

    def _run(
        self, count: int, build: Callable[[list[int]], Any], chunk_size: int
    ) -> tuple[list[Optional[Any]], dict[int, str]]:
        outputs: list[Optional[Any]] = [None] * count
        lost: dict[int, str] = {}
        pending: deque[list[int]] = deque(
            list(range(start, min(start + chunk_size, count))) for start in range(0, count, chunk_size)
        )
        start_failures = 0
        while pending or any(w.indices is not None for w in self.workers):
            while len(self.workers) < self.num_workers:
                self.workers.append(_Worker(self.context, self.task))
            for worker in list(self.workers):
                if worker.indices is None and pending:
                    worker.indices = pending.popleft()
                    worker.chunk_id, self._next_chunk_id = self._next_chunk_id, self._next_chunk_id + 1
                    worker.progress[0], worker.progress[1] = _IDLE, -1.0
                    worker.dispatched_at = time.monotonic()
                    try:
                        worker.conn.send((worker.chunk_id, build(worker.indices)))
                    except OSError:  # the process died while idle
                        start_failures = self._recover(worker, pending, lost, "the worker process died", start_failures)

            busy = [w for w in self.workers if w.indices is not None]
            now = time.monotonic()
            deadlines = [w.progress[0] + self.timeout_s for w in busy if w.progress[0] != _IDLE]
            wait_s = min([self.timeout_s, *(d - now for d in deadlines)])
            ready = multiprocessing.connection.wait([w.conn for w in busy], timeout=max(0.0, wait_s) + 0.01)

            for worker in busy:
                if worker.conn in ready:
                    try:
                        chunk_id, chunk_outputs, fatal = worker.conn.recv()
                    except (EOFError, OSError):
                        start_failures = self._recover(worker, pending, lost, "the worker process died", start_failures)
                        continue
                    assert chunk_id == worker.chunk_id, "reward worker answered out of turn"
                    if fatal is not None:
                        raise RuntimeError(fatal)
                    for position, index in enumerate(worker.indices):  # type: ignore[arg-type]
                        outputs[index] = chunk_outputs[position]
                    worker.indices = None
                    start_failures = 0
                    continue
                sample_start, now = worker.progress[0], time.monotonic()
                if sample_start != _IDLE and now - sample_start > self.timeout_s:
                    reason = f"timed out after {self.timeout_s:g} s (worker killed and replaced)"
                    start_failures = self._recover(worker, pending, lost, reason, start_failures)
                elif not worker.process.is_alive():
                    start_failures = self._recover(worker, pending, lost, "the worker process died", start_failures)
                elif worker.progress[1] < 0 and now - worker.dispatched_at > self.timeout_s + _STARTUP_GRACE_S:
                    reason = "the worker never started scoring (start-up, loading or decoding hangs)"
                    start_failures = self._recover(worker, pending, lost, reason, start_failures)
        return outputs, lost

    def _recover(
        self, worker: _Worker, pending: deque[list[int]], lost: dict[int, str], reason: str, start_failures: int
    ) -> int:
        """Kill `worker`, lose the sample it was on, requeue the rest of its chunk."""
        indices = worker.indices
        assert indices is not None
        worker.kill()  # from here on its progress slot no longer changes
        self.workers.remove(worker)
        position = int(worker.progress[1])
        if 0 <= position < len(indices):
            lost[indices[position]] = reason
            rest = indices[:position] + indices[position + 1 :]
            start_failures = 0
        else:
            # Died before its first sample: no sample to blame. Retry, but not forever.
            rest = indices
            start_failures += 1
            if start_failures >= 3:
                raise RuntimeError(
                    f"reward worker processes fail before scoring anything ({reason}; exit code "
                    f"{worker.process.exitcode}); check that the reward function and tokenizer load in a fresh process"
                )
        if rest:
            pending.appendleft(rest)
        return start_failures
