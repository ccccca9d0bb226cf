"""Leader placement: the replica's ranks meet around every engine sleep and wake (issue 26, item 2).

The leader alone sleeps and wakes the engine, whose memory lies on the other ranks' GPUs too. Two
ranks (one TP-2 replica, real Megatron groups over gloo) run the real `start_engine` and
`GpuHandover` with a fake engine whose creation, sleep and wake take a second, and a fake offloader
that takes a second on rank 1 (`_handover_barrier_worker.py`). From the shared, timestamped log:
no rank onloads before the leader's sleep has returned, and the engine neither starts nor wakes
before every rank has put its actor state away, at start, in a step and around a checkpoint. The
control run without the meetings (the code before them) breaks each of these orders.
"""

from __future__ import annotations

import json
from pathlib import Path

from tests.support.torchrun_utils import run_torchrun_function

WORKER = Path(__file__).with_name("_handover_barrier_worker.py")

# Which actor move each engine call must follow (every rank's) or precede (every rank's): the
# k-th call of one with the k-th of the other.
ENGINE_AFTER_ACTOR_AWAY = {"engine:create": "offload:all", "engine:wake:weights": "offload:grads+optimizer", "engine:wake:kv_cache": "offload:params"}


def _run(tmp_path: Path, barrier: bool) -> list[dict]:
    """The worker's shared log of one run, as a list of events."""
    log = tmp_path / f"events-{barrier}.jsonl"
    result = run_torchrun_function(WORKER, "main", nproc=2, timeout=240, kwargs={"log": str(log), "barrier": barrier})
    result.check()
    assert [r and r.get("error") for r in result.rank_results] == [None, None], result.tail()
    assert result.rank_results[0]["groups"] == [[0, 1]]
    return [json.loads(line) for line in log.read_text().splitlines()]


def _order_violations(events: list[dict]) -> list[str]:
    def times(rank: int, prefix: str, edge: str) -> list[float]:
        return [e["t"] for e in events if e["rank"] == rank and e["event"].startswith(prefix) and e["edge"] == edge]

    problems = []
    sleeps_end = times(0, "engine:sleep", "end")
    for rank in (0, 1):
        onloads = times(rank, "onload:", "begin")
        assert len(onloads) == len(sleeps_end) == 3, (rank, onloads, sleeps_end)  # start, step, checkpoint
        problems += [f"rank {rank} onloaded {s - o:.2f} s before the engine slept" for o, s in zip(onloads, sleeps_end) if o < s]
        for engine_call, actor_move in ENGINE_AFTER_ACTOR_AWAY.items():
            starts, away = times(0, engine_call, "begin"), times(rank, actor_move, "end")
            assert len(starts) == len(away) > 0, (engine_call, starts, away)
            problems += [f"{engine_call} {a - s:.2f} s before rank {rank}'s {actor_move} ended" for s, a in zip(starts, away) if s < a]
    return problems


def test_no_rank_onloads_before_the_engine_sleeps_and_no_engine_wakes_before_every_rank_is_away(tmp_path):
    events = _run(tmp_path, barrier=True)
    assert _order_violations(events) == []


def test_without_the_meetings_the_orders_break(tmp_path):
    """The control (the hand-over before this fix): rank 1 onloads while the engine still sleeps, and
    the engine starts and wakes while rank 1 still offloads."""
    problems = _order_violations(_run(tmp_path, barrier=False))
    assert any("onloaded" in p for p in problems), problems
    for engine_call in ENGINE_AFTER_ACTOR_AWAY:
        assert any(p.startswith(engine_call) for p in problems), (engine_call, problems)
