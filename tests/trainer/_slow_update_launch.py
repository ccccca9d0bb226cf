"""Launcher of test_async_training.py's slowed runs (run by torchrun as a script; not collected): the
actor's update sleeps `MDAPO_TEST_UPDATE_SLEEP_S` seconds more each step, and the embedded engine
`MDAPO_TEST_DECODE_SLEEP_S` more at each decode step (either unset: not slowed); then the CLI runs
as usual. The engines, on their own ranks, would run far ahead of a slow trainer if nothing bounded
them; a slow engine is still generating when the trainer pushes (partial rollouts)."""

from __future__ import annotations

import functools
import os
import sys
import time


def _slowed(function, pause: float):
    @functools.wraps(function)
    def slow(*args, **kwargs):
        time.sleep(pause)
        return function(*args, **kwargs)

    return slow


def main() -> int:
    from megatron_dapo.actor import policy
    from megatron_dapo.rollout.engines import embedded

    if os.environ.get("MDAPO_TEST_UPDATE_SLEEP_S"):
        policy.MegatronActor.update = _slowed(policy.MegatronActor.update, float(os.environ["MDAPO_TEST_UPDATE_SLEEP_S"]))
    if os.environ.get("MDAPO_TEST_DECODE_SLEEP_S"):  # the decode loop samples once a step through this global
        embedded.sample_next_tokens = _slowed(embedded.sample_next_tokens, float(os.environ["MDAPO_TEST_DECODE_SLEEP_S"]))
    from megatron_dapo.cli.main import main as cli_main

    return cli_main(sys.argv[1:])


if __name__ == "__main__":
    sys.exit(main())
