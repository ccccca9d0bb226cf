"""A test reward for the SLURM preemption test: parity_reward's scores, plus a mark and a pause.

MDAPO_TEST_MARK_AT_CALL=<N> and MDAPO_TEST_MARK=<file>: the N-th call (counted in
MDAPO_TEST_REWARD_CALLS=<file>, one byte a call) creates the mark file and then pauses
MDAPO_TEST_MARK_PAUSE_S seconds (default 10), so that a SIGTERM the test sends through SLURM on
seeing the mark reaches every process of the job step while this generation batch is still being
scored: a point fixed by the data, whatever SLURM's delivery takes.
"""

import os
import time

from tests.support.reward_functions import count_call, parity_score


def compute_score(solution_str, ground_truth, **_):
    if count_call(at="MDAPO_TEST_MARK_AT_CALL"):
        open(os.environ["MDAPO_TEST_MARK"], "w").close()
        time.sleep(float(os.environ.get("MDAPO_TEST_MARK_PAUSE_S", "10")))
    return parity_score(solution_str, ground_truth)
