"""SIGTERM calls a generation batch off at once, on every rank alike (issue 26, item 4).

When the step's start is on disk already, the trainer need not finish a generation batch on
SIGTERM: the leader's generate is left from the signal handler (`SigtermFlag.interruptible`) and
the ranks waiting in the gather meeting leave it (`liveness.calling_off_when`), every rank with the
same outcome (`_sigterm_generation_worker.py`: rank 0 generates for 20 s, SIGTERM to both after 2 s).
The control (the loop without these wrappers) finishes the batch first.
"""

from __future__ import annotations

from pathlib import Path

from tests.support.torchrun_utils import run_torchrun_function

WORKER = Path(__file__).with_name("_sigterm_generation_worker.py")
GENERATE_S = 20.0


def _run(armed: bool) -> list[dict]:
    result = run_torchrun_function(WORKER, "main", nproc=2, timeout=240, kwargs={"generate_s": GENERATE_S, "armed": armed})
    result.check()
    assert all(r is not None for r in result.rank_results), result.tail()
    return result.rank_results


def test_sigterm_calls_the_generation_batch_off_on_every_rank_at_once():
    ranks = _run(armed=True)
    for r in ranks:
        assert r["received"] and r["outcome"].startswith("called off"), ranks
        assert r["after_sigterm_s"] < 3.0, ranks  # not after the 20 s batch
    assert "while generating" in ranks[0]["outcome"]  # left from inside the engine's generate


def test_the_control_finishes_the_batch_first():
    ranks = _run(armed=False)
    for r in ranks:
        assert r["outcome"] == "gathered 8", ranks
        assert r["batch_s"] >= GENERATE_S - 1, ranks
