"""A test reward that preempts the whole launch the way SLURM does: parity_reward's scores, plus a
SIGTERM to every rank at a call fixed by the data.

* MDAPO_TEST_REWARD_CALLS=<file>: every call appends one byte (the file's size counts the calls);
* MDAPO_TEST_SIGTERM_ALL_AT_CALL=<N>: the N-th call sends SIGTERM to every process the launcher
  (torchrun) started, i.e. the trainer that owns this reward worker and its sibling ranks, as
  `scancel --signal=TERM` reaches every task of a job step (this worker is not one of them), then
  pauses MDAPO_TEST_SIGTERM_PAUSE_S seconds (default 2): the other ranks, waiting for this batch,
  see the signal before this rank is done scoring it.
"""

import multiprocessing
import os
import signal
import time

from tests.support.reward_functions import count_call, parity_score


def _ranks() -> list[int]:
    trainer = multiprocessing.parent_process().pid  # the rank that owns this pool worker
    with open(f"/proc/{trainer}/stat") as f:
        launcher = int(f.read().rsplit(")", 1)[1].split()[1])
    ranks = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    if int(f.read().rsplit(")", 1)[1].split()[1]) == launcher:
                        ranks.append(int(entry))
            except (FileNotFoundError, ProcessLookupError, IndexError):
                continue
    return ranks


def compute_score(solution_str, ground_truth, **_):
    if count_call(at="MDAPO_TEST_SIGTERM_ALL_AT_CALL"):
        for pid in _ranks():
            os.kill(pid, signal.SIGTERM)
        time.sleep(float(os.environ.get("MDAPO_TEST_SIGTERM_PAUSE_S", "2")))
    return parity_score(solution_str, ground_truth)
