"""Engine processes started under `sigterm_ignored_by_new_processes` outlive a SIGTERM (issue 26, item 4).

Under SLURM a preemption's SIGTERM reaches every process of the step. The engine's processes
(vLLM's engine core and workers, SGLang's scheduler) install handlers that exit on it; started in
the context, they and their own children never see it, while the trainer's handler still runs.
The control: the same processes started outside the context exit on the same SIGTERM. Each case
runs in a fresh interpreter (`_sigterm_child.py` says why).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from megatron_dapo.rollout.engines.process_state import sigterm_ignored_by_new_processes

REPO = Path(__file__).resolve().parents[2]


def _scenario(where: str) -> dict:
    proc = subprocess.run([sys.executable, "-m", "tests.trainer._sigterm_child", where], cwd=REPO, capture_output=True,
                          text=True, timeout=180, env={**os.environ, "PYTHONPATH": str(REPO)})  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_engine_processes_started_in_the_context_outlive_sigterm():
    result = _scenario("inside")
    assert result["started"]  # the context names the process it started
    assert result["alive"] == [True, True]  # the engine-like process and the one it started
    assert result["trainer_handler"] and result["mask_after"] == []  # the trainer still hears SIGTERM
    assert result["stopped_by_sigint"], result


def test_the_same_processes_started_outside_the_context_exit_on_sigterm():
    assert _scenario("outside")["alive"] == [False, False]


@pytest.fixture
def trainer_handler():
    received: list[int] = []
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: received.append(signum))
    yield received
    signal.signal(signal.SIGTERM, previous)


def test_a_sigterm_during_the_start_reaches_the_trainer_afterwards(trainer_handler):
    with sigterm_ignored_by_new_processes():
        os.kill(os.getpid(), signal.SIGTERM)  # blocked in this thread while an engine would start
        time.sleep(0.2)
    deadline = time.monotonic() + 5
    while not trainer_handler and time.monotonic() < deadline:
        time.sleep(0.01)
    assert trainer_handler == [signal.SIGTERM]  # delivered, not lost
