"""For test_engine_sigterm.py: a fresh interpreter starts an engine-like process, with or without
`sigterm_ignored_by_new_processes`, sends it SIGTERM and prints what happened as JSON.

The child stops on SIGTERM as vLLM's engine core does (a handler of its own, installed at start)
and starts a grandchild of the same kind (vLLM's TP workers). A fresh interpreter, because the
first spawn of a process also starts multiprocessing's resource tracker, which unblocks SIGTERM in
the starting thread (the trap vLLM's start fell into): only a process that has spawned nothing yet
shows it.

    python -m tests.trainer._sigterm_child inside|outside
"""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
import sys
import time


def _exit_on_sigterm(signum, frame):
    raise SystemExit(0)


def engine_like(ready, grandchild: bool) -> None:
    """Install a SIGTERM handler that exits, optionally start a grandchild of the same kind, report
    the pids, then idle."""
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    pids = [os.getpid()]
    if grandchild:
        inner = multiprocessing.get_context("spawn").Queue()
        worker = multiprocessing.get_context("spawn").Process(target=engine_like, args=(inner, False))
        worker.start()
        pids += inner.get(timeout=60)
    ready.put(pids)
    time.sleep(120)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def main(where: str) -> dict:
    from megatron_dapo.rollout.engines.process_state import StartedProcesses, sigterm_ignored_by_new_processes

    received: list[int] = []
    signal.signal(signal.SIGTERM, lambda signum, frame: received.append(signum))  # the trainer's handler
    ctx = multiprocessing.get_context("spawn")  # as vLLM and SGLang start theirs
    started = StartedProcesses()

    def start():
        ready = ctx.Queue()  # the first spawn: the resource tracker starts here
        process = ctx.Process(target=engine_like, args=(ready, True))
        process.start()
        return process, ready

    if where == "inside":
        with sigterm_ignored_by_new_processes() as started:
            process, ready = start()
    else:
        process, ready = start()
    pids = ready.get(timeout=60)
    for pid in pids:
        os.kill(pid, signal.SIGTERM)
    time.sleep(1.0)
    result = {"started": started.pids == [process.pid], "alive": [_alive(pid) for pid in pids]}
    os.kill(os.getpid(), signal.SIGTERM)
    deadline = time.monotonic() + 5
    while not received and time.monotonic() < deadline:
        time.sleep(0.01)
    result["trainer_handler"] = received == [signal.SIGTERM]
    result["mask_after"] = sorted(int(s) for s in signal.pthread_sigmask(signal.SIG_BLOCK, set()))
    # The trainer stops them itself: SIGINT, which their handlers still hear; the grandchild's first,
    # awaited (an exiting multiprocessing parent waits for its children), then the child's.
    for pid in reversed(pids):
        if _alive(pid):
            os.kill(pid, signal.SIGINT)
        deadline = time.monotonic() + 60
        while _alive(pid) and time.monotonic() < deadline:
            time.sleep(0.05)
    process.join(10)
    result["stopped_by_sigint"] = process.exitcode is not None
    result["alive_after_sigint"] = [_alive(pid) for pid in pids]
    for pid in pids:
        if _alive(pid):
            os.kill(pid, signal.SIGKILL)
    return result


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1])))
