"""Generation seeds that depend only on where a batch sits in the run.

A seed is a function of (run seed `rollout.seed`, step, generation batch within the step, rollout
replica), never of wall-clock or of how many batches came before in this process: a resumed run
samples exactly what the uninterrupted run sampled, and a redone step (SIGTERM before its update)
samples what it sampled the first time.
"""

from __future__ import annotations

_PRIME = 2**31 - 1  # seeds stay positive 31-bit integers, which every engine accepts
_VALIDATION_STEP = -1  # validation gets its own stream, the same at every evaluation


def generation_seed(run_seed: int, step: int, gen_index: int, replica: int) -> int:
    """The seed of generation batch `gen_index` of step `step` on rollout replica `replica`."""
    return (run_seed * 1_000_003 + (step + 1) * 10_007 + gen_index * 101 + replica) % _PRIME


def validation_seed(run_seed: int, replica: int) -> int:
    """The seed of replica `replica`'s share of the validation set (the same at every evaluation)."""
    return generation_seed(run_seed, _VALIDATION_STEP, 0, replica)
