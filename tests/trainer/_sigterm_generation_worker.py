"""Worker for test_sigterm_generation.py (run with tests/support/torchrun_utils.py; not collected).

Two data-parallel replicas (two ranks, each its replica's leader), as the trainer's generation loop
runs them: rank 0's "engine" generates for `generate_s` seconds under the trainer's
`SigtermFlag.interruptible`, rank 1's is done at once; both then gather the samples
(`trainer.samples.gather_samples`) under `liveness.calling_off_when(flag received)`. Two seconds in,
rank 1 sends SIGTERM to both processes, as SLURM does. With `armed=False` (the control: the loop as
it was) neither wrapper is entered. Each rank records how long after the SIGTERM its batch ended,
and how.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from pathlib import Path

from tests.support.torchrun_utils import RESULT_DIR_ENV, write_rank_result


def main(generate_s: float, armed: bool) -> None:
    from megatron_dapo.distributed import ParallelLayout, init_distributed, liveness, teardown
    from megatron_dapo.trainer.preemption import SigtermFlag
    from megatron_dapo.trainer.samples import gather_samples
    from tests.support.samples import make_samples

    ctx = init_distributed(ParallelLayout(), timeout_s=60, seed=1, gather_timeout_s=120)
    rank = ctx.rank
    results = Path(os.environ[RESULT_DIR_ENV])
    (results / f"pid{rank}").write_text(str(os.getpid()))
    liveness.configure(window_s=10)
    flag = SigtermFlag()
    sent = {}
    out: dict = {"rank": rank, "outcome": None}
    with flag:
        import torch.distributed as dist

        dist.barrier()
        if rank == 1:  # SLURM's scancel --signal=TERM: every process of the step
            def send():
                pids = [int((results / f"pid{r}").read_text()) for r in range(2)]
                (results / "sent").write_text(str(time.time()))
                for pid in pids:
                    os.kill(pid, signal.SIGTERM)

            threading.Timer(2.0, send).start()
        started = time.time()
        try:
            with liveness.calling_off_when(lambda: flag.received) if armed else contextlib.nullcontext():
                with flag.interruptible() if armed else contextlib.nullcontext():
                    time.sleep(generate_s if rank == 0 else 0.0)  # the engine's generate
                gathered = gather_samples(make_samples(seed=rank, num_prompts=2, n=2), order_key=rank)
            out["outcome"] = f"gathered {len(gathered)}"
        except liveness.MeetingCalledOff as error:
            out["outcome"] = f"called off: {error}"
        ended = time.time()
        out["received"] = flag.received
        out["after_sigterm_s"] = ended - float((results / "sent").read_text())
        out["batch_s"] = ended - started
    write_rank_result(out)
    # As the trainer ends a preempted run (loop.train: TrainingInterrupted is orderly): rank 0 hosts
    # the job's store here and must not exit while rank 1 still reads the meeting's outcome from it
    # (CI: rank 1's poll got "Connection reset by peer" when rank 0, called off first, had gone).
    teardown(together=True)
