"""Wall-clock time per phase of a training step, reported as ``timing_s/<phase>`` metrics.

    timer = PhaseTimer(synchronize=torch.cuda.synchronize if torch.cuda.is_available() else None)
    with timer.phase("step"):
        with timer.phase("gen"):
            ...
        with timer.phase("update"):
            ...
    logger.log({**step_metrics, **timer.metrics()}, step)
    timer.reset()

Phases are independent accumulators: a phase entered several times in one step (generation is
repeated by dynamic sampling) sums its durations, and phases may nest (``step`` encloses the
others). GPU work is asynchronous, so a phase measured without synchronising can end before its
kernels do and charge their time to the next phase; pass ``synchronize`` to make the boundaries exact.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Optional

__all__ = ["PhaseTimer"]


class PhaseTimer:
    """Accumulates seconds per named phase until :meth:`reset`.

    Args:
        prefix: metric-name prefix of :meth:`metrics` (the ecosystem's ``timing_s/``).
        clock: monotonic clock in seconds (injectable so that tests need not sleep).
        synchronize: called at both ends of every phase before the clock is read (e.g.
            ``torch.cuda.synchronize``), so that asynchronous device work is charged to its phase.
    """

    def __init__(
        self,
        prefix: str = "timing_s/",
        *,
        clock: Callable[[], float] = time.perf_counter,
        synchronize: Optional[Callable[[], object]] = None,
    ) -> None:
        self.prefix = prefix
        self._clock = clock
        self._synchronize = synchronize
        self._seconds: dict[str, float] = {}
        self._open: set[str] = set()

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Time the body of the ``with`` block and add it to ``name`` (also when the body raises)."""
        if not name:
            raise ValueError("phase name must be a non-empty string")
        if name in self._open:
            # The inner interval would be counted twice: a bug in the caller, not a measurement.
            raise RuntimeError(f"phase {name!r} is already running; phases of the same name cannot nest")
        self._open.add(name)
        start = self._now()
        try:
            yield
        finally:
            self.add(name, self._now() - start)
            self._open.discard(name)

    def add(self, name: str, seconds: float) -> None:
        """Add ``seconds`` measured elsewhere (e.g. by a rollout engine) to phase ``name``."""
        if seconds < 0:
            raise ValueError(f"phase {name!r}: negative duration {seconds}")
        self._seconds[name] = self._seconds.get(name, 0.0) + float(seconds)

    def seconds(self, name: str) -> float:
        """Seconds accumulated by ``name`` since the last reset (0.0 if it never ran)."""
        return self._seconds.get(name, 0.0)

    def metrics(self) -> dict[str, float]:
        """``{prefix + phase: seconds}`` for every phase that ran since the last reset, in first-run order."""
        return {self.prefix + name: value for name, value in self._seconds.items()}

    def reset(self) -> None:
        """Forget all accumulated time (call once per step, after logging)."""
        if self._open:
            raise RuntimeError(f"cannot reset while phases are running: {sorted(self._open)}")
        self._seconds.clear()

    def _now(self) -> float:
        if self._synchronize is not None:
            self._synchronize()
        return self._clock()
