"""Functions the test-harness tests (tests/test_torchrun_utils.py) start in child processes."""

import time


def hang_after_result() -> None:
    from tests.support.torchrun_utils import write_rank_result

    write_rank_result({"wrote": True})
    time.sleep(3600)  # as a rank stuck at exit would


def finish() -> dict:
    return {"done": True}


def one_rank_fails() -> None:
    import os

    if os.environ["RANK"] == "1":
        raise RuntimeError("rank 1 failed on purpose")
    time.sleep(3600)  # stopped by the launcher once rank 1 has failed


def environment() -> dict:
    import os

    import torch

    keys = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    return {"env": {k: os.environ.get(k) for k in keys}, "threads": torch.get_num_threads()}


if __name__ == "__main__":  # `python -m tests.support.harness_worker CODE`: both streams, then exit with CODE
    import os
    import sys

    import torch

    print(f"out rank={os.environ.get('RANK')} threads={torch.get_num_threads()} argv={sys.argv[1:]}")
    print(f"err {os.getcwd()}", file=sys.stderr)
    sys.exit(int(sys.argv[1]))
