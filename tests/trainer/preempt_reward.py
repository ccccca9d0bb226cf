"""A test reward for preemption: parity_reward's scores, plus a deterministic SIGTERM.

* MDAPO_TEST_REWARD_CALLS=<file>: every call appends one byte to the file, so its size counts the
  samples scored so far (over all steps, in whichever process scores);
* MDAPO_TEST_SIGTERM_AT_CALL=<N>: the N-th call sends SIGTERM to the trainer process (the reward
  pool worker's parent, or this process when it scores in-process), i.e. while a generation batch
  is being scored, a point fixed by the data rather than by timing;
* MDAPO_TEST_SIGTERM_ON_LOAD=1: loading this file in the trainer sends it SIGTERM, i.e. during
  start-up (the trainer loads the reward function after the model and before the engine).
"""

import multiprocessing
import os
import signal

from tests.support.reward_functions import count_call, parity_score


def _trainer_pid() -> int:
    parent = multiprocessing.parent_process()  # the trainer that started this pool worker
    return parent.pid if parent is not None else os.getpid()


if os.environ.get("MDAPO_TEST_SIGTERM_ON_LOAD") == "1" and multiprocessing.parent_process() is None:
    os.kill(os.getpid(), signal.SIGTERM)


def compute_score(solution_str, ground_truth, **_):
    if count_call(at="MDAPO_TEST_SIGTERM_AT_CALL"):
        os.kill(_trainer_pid(), signal.SIGTERM)
    return parity_score(solution_str, ground_truth)
