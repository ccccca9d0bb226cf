"""Worker for test_liveness_gather.py (run with tests/support/torchrun_utils.py; not collected).

Two ranks under `init_distributed`. One of them is the rank the other waits for: in "gather" rank 1
"generates" while rank 0 waits in the trainer's gather (`trainer.samples.gather_samples`); in
"barrier" rank 0 is a TP-2 replica's leader "starting its engine" while rank 1 waits in the
replica's meeting (`handover.ReplicaBarrier`). The awaited rank then either takes `delay_s` and
arrives ("slow": alive, beating) or freezes itself with SIGSTOP ("frozen": what a lost node looks
like to the others: no beat, and no closed socket for gloo to notice). The waiting rank records how
long it waited and what ended the wait, then SIGKILLs a frozen peer and leaves at once.
`liveness=False` is the control: the wait is the gloo collective alone, as before the liveness
meeting.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

from tests.support.torchrun_utils import RESULT_DIR_ENV, write_rank_result


def _start_together(rank: int, world: int) -> None:
    """A file barrier before any process group exists (imports finish seconds apart on a busy machine)."""
    directory = Path(os.environ[RESULT_DIR_ENV])
    (directory / f"ready{rank}").write_text(str(os.getpid()))
    while not all((directory / f"ready{r}").exists() for r in range(world)):
        time.sleep(0.05)


def main(where: str, case: str, window_s: float, gather_timeout_s: float, delay_s: float, liveness_on: bool = True) -> None:
    from megatron_dapo.distributed import ParallelLayout, enable_cpu_compat, init_distributed, liveness

    enable_cpu_compat()
    import megatron.core.parallel_state  # noqa: F401 - the slow import, before the start line
    import torch.distributed as dist

    from megatron_dapo.distributed.setup import gather_group
    from megatron_dapo.trainer.handover import ReplicaBarrier
    from megatron_dapo.trainer.samples import gather_samples
    from tests.support.samples import make_samples

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    _start_together(rank, world)
    layout = ParallelLayout(tp=2) if where == "barrier" else ParallelLayout()
    ctx = init_distributed(layout, timeout_s=60, seed=1, gather_timeout_s=gather_timeout_s)
    liveness.configure(window_s=window_s)
    if not liveness_on:
        liveness.await_ranks = lambda *args, **kwargs: 0.0  # the waits as they were: the collective alone
        liveness.beating = lambda: False
    barrier = ReplicaBarrier.create(ctx.layout, "vllm", gather_timeout_s) if where == "barrier" else None
    awaited = 1 if where == "gather" else 0
    dist.barrier(group=gather_group())  # start together, whatever the start-up skew
    out: dict = {"rank": rank, "error": None}

    def meet():
        if where == "gather":
            local = make_samples(seed=rank, num_prompts=2, n=2)
            return len(gather_samples(local, order_key=rank))
        barrier.wait("waiting for the leader's engine to start")
        return None

    if rank == awaited:
        if case == "frozen":
            os.kill(os.getpid(), signal.SIGSTOP)  # until the other rank kills it
        time.sleep(delay_s)  # generating, or starting the engine
        out["result"] = meet()
        write_rank_result(out)
    else:
        started = time.monotonic()
        try:
            out["result"] = meet()
        except Exception as error:  # noqa: BLE001 - the test reads what ended the wait, and when
            out["error"] = f"{type(error).__name__}: {error}"
        out["waited_s"] = time.monotonic() - started
        write_rank_result(out)
        if case == "frozen":
            peer = int((Path(os.environ[RESULT_DIR_ENV]) / f"ready{awaited}").read_text())
            os.kill(peer, signal.SIGKILL)
            os._exit(0)  # the gloo groups lost a member: leave without their clean-up
    dist.barrier(group=gather_group())
    from megatron_dapo.distributed import teardown

    teardown()
