"""Launcher of test_async_training.py's slow-trainer run (run by torchrun as a script; not collected):
the actor's update sleeps `MDAPO_TEST_UPDATE_SLEEP_S` seconds more each step, then the CLI runs as
usual. The engines, on their own ranks, would run far ahead of such a trainer if nothing bounded them."""

from __future__ import annotations

import functools
import os
import sys
import time


def main() -> int:
    from megatron_dapo.actor import policy

    pause = float(os.environ["MDAPO_TEST_UPDATE_SLEEP_S"])
    update = policy.MegatronActor.update

    @functools.wraps(update)
    def slow_update(self, *args, **kwargs):
        time.sleep(pause)
        return update(self, *args, **kwargs)

    policy.MegatronActor.update = slow_update
    from megatron_dapo.cli.main import main as cli_main

    return cli_main(sys.argv[1:])


if __name__ == "__main__":
    sys.exit(main())
