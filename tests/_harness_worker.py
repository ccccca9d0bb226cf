"""Functions the test-harness tests (tests/test_torchrun_utils.py) start in child processes."""

import time


def hang_after_result() -> None:
    from torchrun_utils import write_rank_result

    write_rank_result({"wrote": True})
    time.sleep(3600)  # as a rank stuck at exit would


def finish() -> dict:
    return {"done": True}
