"""A test reward for the SLURM preemption test: parity_reward's scores, plus a mark and a pause.

MDAPO_TEST_MARK_AT_CALL=<N> and MDAPO_TEST_MARK=<file>: the N-th call (counted in
MDAPO_TEST_REWARD_CALLS=<file>, one byte a call) creates the mark file and then pauses
MDAPO_TEST_MARK_PAUSE_S seconds (default 10), so that a SIGTERM the test sends through SLURM on
seeing the mark reaches every process of the job step while this generation batch is still being
scored: a point fixed by the data, whatever SLURM's delivery takes.
"""

import os
import time


def compute_score(solution_str, ground_truth, **_):
    calls_file = os.environ.get("MDAPO_TEST_REWARD_CALLS")
    if calls_file:
        fd = os.open(calls_file, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, b".")
            calls = os.fstat(fd).st_size
        finally:
            os.close(fd)
        if calls == int(os.environ.get("MDAPO_TEST_MARK_AT_CALL", "0")):
            open(os.environ["MDAPO_TEST_MARK"], "w").close()
            time.sleep(float(os.environ.get("MDAPO_TEST_MARK_PAUSE_S", "10")))
    acc = (len(solution_str) + int(ground_truth)) % 2 == 0  # as tests/trainer/parity_reward.py
    return {"score": 1.0 if acc else -1.0, "acc": acc, "pred": str(len(solution_str))}
