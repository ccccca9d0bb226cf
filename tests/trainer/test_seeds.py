"""Generation seeds depend only on (run seed, step, generation batch, replica)."""

from __future__ import annotations

import itertools

from megatron_dapo.trainer.seeds import generation_seed, validation_seed


def test_seeds_are_pinned_and_distinct():
    # Pinned: a change here changes what every run samples (and breaks resuming an older run's steps).
    assert generation_seed(1, 0, 0, 0) == 1_010_010
    assert generation_seed(1, 3, 2, 1) == 1_000_003 + 4 * 10_007 + 2 * 101 + 1
    assert validation_seed(7, 1) == generation_seed(7, -1, 0, 1) == 7 * 1_000_003 + 1
    seeds = {generation_seed(1, step, gen, replica) for step, gen, replica in itertools.product(range(20), range(5), range(4))}
    assert len(seeds) == 20 * 5 * 4
    assert all(0 <= s < 2**31 - 1 for s in seeds)
    assert 0 <= generation_seed(10**9, 10**6, 3, 7) < 2**31 - 1
