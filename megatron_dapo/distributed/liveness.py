"""Waits for other ranks that end when those ranks arrive or die, not after a fixed timeout.

Ranks wait long for each other in a few places: after generating (a replica leader's engine takes a
whole generation batch while its replica's other ranks, and faster replicas, wait to gather), and at
start (the leader starts its engine, minutes for a large model, while its replica waits). A fixed
timeout there is wrong both ways: hours for a rank whose node is gone (a dead process closes its
sockets and gloo notices, but a frozen process or a lost node sends nothing, and gloo waits out its
timeout), and too short for a batch that legitimately takes longer. So these waits watch the ranks
they wait for instead.

* Every rank beats: a daemon thread adds 1 to its counter ``beat/<rank>`` in the job's store (the
  c10d store behind the default process group, which torchrun or `init_distributed` set up) every
  `window_s / 6` seconds, from `init_distributed` to `teardown`. The thread lives as long as its
  process, and stops with it, whether that dies, is frozen, or loses its node.
* `await_ranks(ranks, stream)` is a barrier in the store: this rank records its arrival at the
  stream's next meeting and polls the arrival count (a few ms at first, then every 0.25 s) until
  every rank of `ranks` is there. Every `window_s / 4` it reads the beats of the ranks not yet
  there: one whose count has not moved for `window_s` seconds (this rank's clock: no clock is
  compared across nodes) is gone, and the wait raises `RankUnresponsive` naming it, within about
  1.5 x `window_s` of its last beat. A rank that beats is waited for as long as it takes, up to
  `limit_s` (`rollout.gather_timeout_s`), the bound for a rank alive but stuck (a hang, not a death).

The store itself lives in one process (rank 0's under SLURM, torchrun's agent under torchrun): if
that is the one gone, store calls hang rather than fail (a TCP peer that vanished sends nothing), so
the waiting rank makes each call through a helper thread and gives up after `window_s` too
(`RankUnresponsive`, naming the store).

A meeting can also be called off (`call_off`, e.g. on SIGTERM: the trainer then leaves a
generation batch at once instead of finishing it): its outcome is one store key, set once, either
"done" by a rank that sees every rank arrived or "off" by a rank that calls it off first, so every
rank of the meeting takes the same way out (`MeetingCalledOff`, or on as usual). Only meetings
waited for inside `calling_off_when(predicate)` call themselves off (when `predicate()` turns true);
a rank elsewhere can call off the next one with `call_off` (the trainer's SIGTERM handler, while its
rank generates), and ask whether another rank did with `called_off` (an spmd engine's ranks, between
engine steps: one store read).

`window_s` is `rollout.liveness_window_s` (`configure`). The cost: one store operation per poll per
waiting rank, and, per check, one per rank not yet arrived (the engine leaders, typically); every
rank writes one counter every `window_s / 6` seconds. The data itself still moves in collectives,
once every rank is known to be there.
"""

from __future__ import annotations

import contextlib
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Mapping, Optional, Sequence

import torch.distributed as dist

DEFAULT_WINDOW_S = 60.0
"""`rollout.liveness_window_s`: how long a rank may go without a beat before it counts as gone."""
BEATS_PER_WINDOW = 6
CHECKS_PER_WINDOW = 4
MAX_POLL_S = 0.25

_PREFIX = "mdapo_liveness/"


class RankUnresponsive(RuntimeError):
    """A rank that others wait for stopped beating (its process or node is gone)."""


class MeetingCalledOff(RuntimeError):
    """The meeting was called off before it completed (`call_off`): every rank of it gets this."""


GATHER = "gather"
"""The stream of the world's meetings before the gathers after generating (`objects.await_everyone`)."""

CALLED_OFF = 1 << 30
"""Added to a meeting's arrival count when it is called off: the waiting ranks see it at their next poll."""


@dataclass
class Settings:
    window_s: float = DEFAULT_WINDOW_S
    limit_s: float = 3 * 3600.0


_settings = Settings()


def configure(window_s: Optional[float] = None, limit_s: Optional[float] = None) -> Settings:
    """Set the liveness window and the bound on a wait for a live rank (None: unchanged); returns them."""
    for name, value in (("rollout.liveness_window_s", window_s), ("rollout.gather_timeout_s", limit_s)):
        if value is not None and not value > 0:
            raise ValueError(f"{name} must be > 0, got {value}")
    if window_s is not None:
        _settings.window_s = float(window_s)
        if _heart is not None:
            _heart.poked.set()  # a shorter window takes effect at once, not after the old interval
    if limit_s is not None:
        _settings.limit_s = float(limit_s)
    return _settings


def settings() -> Settings:
    return _settings


# ---------------------------------------------------------------------------------------------
# Pure decisions
# ---------------------------------------------------------------------------------------------


@dataclass
class BeatWatch:
    """Which ranks have gone silent, from their beat counters as read over time (pure).

    `update(beats, now)` takes the counters read at `now` (None: never beaten yet) and returns the
    ranks whose counter has not changed for more than `window_s` of the reader's clock, the first
    reading of a rank counting as a change."""

    window_s: float
    _seen: dict[int, tuple[Optional[int], float]] = field(default_factory=dict)

    def update(self, beats: Mapping[int, Optional[int]], now: float) -> list[int]:
        silent = []
        for rank, beat in beats.items():
            last = self._seen.get(rank)
            if last is None or last[0] != beat:
                self._seen[rank] = (beat, now)
            elif now - last[1] > self.window_s:
                silent.append(rank)
        return sorted(silent)


def poll_interval(waited_s: float) -> float:
    """Seconds to the next look at the arrival count after `waited_s` of waiting: short at first
    (the usual hand-over meeting ends in milliseconds), then `MAX_POLL_S` (pure)."""
    return min(MAX_POLL_S, 0.001 + waited_s / 8)


def beat_interval(window_s: float) -> float:
    return window_s / BEATS_PER_WINDOW


def check_interval(window_s: float) -> float:
    return window_s / CHECKS_PER_WINDOW


# ---------------------------------------------------------------------------------------------
# The store, the beat, the wait
# ---------------------------------------------------------------------------------------------


class _BoundedStore:
    """Calls into a store, each abandoned after `timeout_s` (then `RankUnresponsive`): one daemon
    thread makes the calls, so that a call the store never answers blocks only that thread."""

    def __init__(self, store: Any) -> None:
        self.store = store
        self._requests: "queue.Queue[tuple]" = queue.Queue()
        threading.Thread(target=self._serve, name="mdapo-liveness-store", daemon=True).start()

    def _serve(self) -> None:
        while True:
            method, args, box, done = self._requests.get()
            try:
                box.append((True, getattr(self.store, method)(*args)))
            except BaseException as error:  # noqa: BLE001 - handed to the caller
                box.append((False, error))
            done.set()

    def call(self, timeout_s: float, method: str, *args: Any) -> Any:
        box: list = []
        done = threading.Event()
        self._requests.put((method, args, box, done))
        if not done.wait(timeout_s):
            raise RankUnresponsive(
                f"the job's store (rank 0's process, or the launcher's) did not answer a {method} within "
                f"rollout.liveness_window_s={timeout_s:g} s: its process or node is gone"
            )
        ok, value = box[0]
        if not ok:
            raise value
        return value


def _job_store() -> Optional[Any]:
    if not (dist.is_available() and dist.is_initialized()):
        return None
    return dist.PrefixStore(_PREFIX, dist.distributed_c10d._get_default_store())


class _Heart:
    def __init__(self, store: Any, rank: int) -> None:
        # Connections of their own (clones): a call that hangs blocks neither the other nor the
        # process group's own use of the store.
        self.store, self.rank = store.clone(), rank
        self.waits = _BoundedStore(store.clone())
        self.stopped = threading.Event()
        self.poked = threading.Event()  # stop, or a new window: look again now
        self.thread = threading.Thread(target=self._run, name="mdapo-liveness-beat", daemon=True)

    def _run(self) -> None:
        key = f"beat/{self.rank}"
        while not self.stopped.is_set():
            try:
                self.store.add(key, 1)
            except Exception:  # noqa: BLE001 - a store that failed once may answer again; if it is
                pass  # gone, the waiting ranks find out from their own calls
            self.poked.wait(beat_interval(_settings.window_s))
            self.poked.clear()


_heart: Optional[_Heart] = None
_meetings: dict[str, int] = {}
_waiting_in: dict[str, int] = {}  # stream -> the meeting this rank waits in now
_call_off_when: Optional[Callable[[], bool]] = None


@contextlib.contextmanager
def calling_off_when(predicate: Callable[[], bool]) -> Iterator[None]:
    """While the body runs, a meeting this rank waits in is called off as soon as `predicate()` is
    true (checked at every poll; `predicate` must be cheap)."""
    global _call_off_when
    previous, _call_off_when = _call_off_when, predicate
    try:
        yield
    finally:
        _call_off_when = previous


def call_off(stream: str) -> bool:
    """Call off `stream`'s meeting this rank waits in, or else its next one. True when that meeting
    is off (now or already), False when it had completed (every rank arrived first) or without a
    beat. Safe in a signal handler of the main thread (the store calls go through a helper thread)."""
    if _heart is None:
        return False
    n = _waiting_in.get(stream, _meetings.get(stream, 0))
    outcome = _heart.waits.call(_settings.window_s, "compare_set", f"outcome/{stream}/{n}", "", "off")
    if outcome != b"off":
        return False
    _heart.waits.call(_settings.window_s, "add", f"count/{stream}/{n}", CALLED_OFF)  # wakes the waiters
    return True


def called_off(stream: str) -> bool:
    """Whether `stream`'s meeting this rank waits in, or else its next one, is called off already
    (by any rank): one store read of its arrival count, no wait and no arrival. False without a
    beat. For a rank busy elsewhere that should stop as soon as another rank called the meeting off
    (an spmd engine's vote between its steps: `SigtermFlag.votes_to_call_off`). Safe in any thread
    (the store call goes through the helper thread; `RankUnresponsive` if the store does not answer)."""
    if _heart is None:
        return False
    n = _waiting_in.get(stream, _meetings.get(stream, 0))
    return int(_heart.waits.call(_settings.window_s, "add", f"count/{stream}/{n}", 0)) >= CALLED_OFF


def start_beating(store: Optional[Any] = None, rank: Optional[int] = None) -> bool:
    """Start this rank's beat (idempotent; after torch.distributed is initialised). False without it.
    `store` / `rank`: another store and rank than the job's (tests)."""
    global _heart
    store = store if store is not None else _job_store()
    if store is None:
        return False
    if _heart is None or not _heart.thread.is_alive():
        _heart = _Heart(store, dist.get_rank() if rank is None else rank)
        _heart.store.add(f"beat/{_heart.rank}", 1)  # the first beat before anyone can wait for it
        _heart.thread.start()
    return True


def stop_beating() -> None:
    """Stop the beat (teardown); the meetings' counts start again with the next process group."""
    global _heart
    if _heart is not None:
        _heart.stopped.set()
        _heart.poked.set()
        _heart.thread.join(timeout=5)
        _heart = None
    _meetings.clear()


def beating() -> bool:
    return _heart is not None and _heart.thread.is_alive()


def await_ranks(
    ranks: Sequence[int],
    stream: str,
    *,
    what: str = "",
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> float:
    """Return once every rank of `ranks` (this one among them) has called this for `stream`'s next
    meeting; raise `RankUnresponsive` if one of those not yet there stops beating, or TimeoutError
    after `limit_s` (see the module doc). Every rank of `ranks` calls it the same number of times per
    stream. `what` names the wait in errors. Returns the seconds waited; without a beat (no
    `init_distributed`), returns 0 at once and the collective that follows does the waiting."""
    if _heart is None or len(ranks) <= 1:
        return 0.0
    me, window = _heart.rank, _settings.window_s
    ranks = list(ranks)

    def store(method: str, *args: Any) -> Any:
        return _heart.waits.call(window, method, *args)

    if me not in ranks:
        raise ValueError(f"rank {me} waits in a meeting of ranks {list(ranks)}")
    n = _meetings.get(stream, 0)
    _meetings[stream] = n + 1
    count_key, arrived_key = f"count/{stream}/{n}", f"arrived/{stream}/{n}"
    outcome_key = f"outcome/{stream}/{n}"
    if me == ranks[0] and n >= 2:  # every rank has left meeting n - 2 once any has reached n
        for old in (f"count/{stream}/{n - 2}", f"arrived/{stream}/{n - 2}", f"outcome/{stream}/{n - 2}"):
            store("delete_key", old)
    _waiting_in[stream] = n
    try:
        store("append", arrived_key, f"{me},")
        arrived = store("add", count_key, 1)
        waited = _wait(store, ranks, stream, count_key, arrived_key, arrived, what, clock, sleep)
    finally:
        _waiting_in.pop(stream, None)
    # Every rank is there, or the meeting was called off: one outcome for all (the first to set it).
    if store("compare_set", outcome_key, "", "done") == b"off":
        raise MeetingCalledOff(f"{what or stream}: called off (a rank was asked to stop) after {waited:.1f} s")
    return waited


def _wait(
    store: Callable[..., Any], ranks: list[int], stream: str, count_key: str, arrived_key: str, arrived: int,
    what: str, clock: Callable[[], float], sleep: Callable[[float], None],
) -> float:  # fmt: skip
    """`await_ranks`'s polling until the arrival count reaches len(ranks) (or the meeting is called off)."""
    me, window = _heart.rank, _settings.window_s
    watch = BeatWatch(window)
    started = clock()
    next_check = started + check_interval(window)
    while arrived < len(ranks):
        if _call_off_when is not None and _call_off_when():
            call_off(stream)  # the count jumps past len(ranks): the next poll ends the wait
        now = clock()
        waited = now - started
        if waited > _settings.limit_s:
            raise TimeoutError(
                f"{what or stream}: ranks {_missing(store, arrived_key, ranks)} still beat but did not arrive within "
                f"rollout.gather_timeout_s={_settings.limit_s:g} s (alive but stuck?)"
            )
        if now >= next_check:
            missing = _missing(store, arrived_key, ranks)
            silent = watch.update({r: int(store("add", f"beat/{r}", 0)) or None for r in missing}, now)
            if silent:
                raise RankUnresponsive(
                    f"{what or stream}: rank(s) {silent} stopped beating for more than rollout.liveness_window_s="
                    f"{window:g} s while rank {me} waited {waited:.0f} s for them: their process or node is gone"
                )
            next_check = now + check_interval(window)
        sleep(poll_interval(waited))
        arrived = store("add", count_key, 0)
    return clock() - started


def _missing(store: Callable[..., Any], arrived_key: str, ranks: Sequence[int]) -> list[int]:
    there = {int(r) for r in store("get", arrived_key).decode().split(",") if r}
    return [r for r in ranks if r not in there]
