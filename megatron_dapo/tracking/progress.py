"""A training progress bar with ETA on stderr, for the logging rank only.

    with ProgressBar(cfg.trainer.total_steps, initial=resumed_step, enabled=is_logging_rank) as bar:
        for step in range(resumed_step + 1, total_steps + 1):
            ...
            bar.update(step, metrics)

Two renderings, chosen by whether the stream is a terminal:

* **terminal**: a ``tqdm`` bar (``12/100 [03:12<23:30, 16.0s/step, score=0.4531 len=312.5]``),
  redrawn at most once a second. It starts at ``initial`` on resume, and tqdm measures the rate
  over the steps of this process only, so the ETA is not fooled by the steps already done.
* **not a terminal** (CI logs, SLURM ``.out`` files): tqdm's carriage-return redraws would pile up
  into one endless line, so instead a plain line is printed on the first update, each time
  progress crosses a multiple of ``line_every_percent`` (default 5 %: about 20 lines per run), at
  the last step, and after ``heartbeat_s`` seconds without a line (so that a slow run still shows
  it is alive). Each line holds the step, percent, elapsed time, ETA, seconds per step and the
  postfix metrics.

The postfix shows a few key metrics under short labels (:data:`DEFAULT_POSTFIX_KEYS`); a key ending
in ``*`` matches by prefix (``val/acc/mean@*`` matches ``val/acc/mean@16``). Values stay shown until
replaced, so the last validation accuracy remains visible between validation steps.
"""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Callable, Mapping
from typing import Any, Optional, TextIO

from tqdm import tqdm

from megatron_dapo.tracking.loggers import format_value

__all__ = ["DEFAULT_POSTFIX_KEYS", "ProgressBar"]

DEFAULT_POSTFIX_KEYS: Mapping[str, str] = {
    "critic/score/mean": "score",
    "val/acc/mean@*": "val_acc",
    "response_length/mean": "len",
    "perf/tokens_per_s": "tok/s",
}


def _format_interval(seconds: float) -> str:
    return tqdm.format_interval(seconds)


class ProgressBar:
    """Progress over ``total`` steps (see the module docstring for the two renderings).

    Args:
        total: the last step number (steps count from 1).
        initial: steps already done (the resumed checkpoint's step).
        enabled: False on every rank but the logging one: nothing is written.
        desc: label in front of the bar or line.
        file: output stream; ``None`` means ``sys.stderr`` at construction time.
        postfix_keys: metric name (or ``prefix*``) -> short label, in display order.
        line_every_percent: non-terminal mode: print a line at each multiple of this percentage.
        heartbeat_s: non-terminal mode: print a line at least this often while steps advance.
        clock: monotonic seconds (injectable for tests).
    """

    def __init__(
        self,
        total: int,
        *,
        initial: int = 0,
        enabled: bool = True,
        desc: str = "train",
        file: Optional[TextIO] = None,
        postfix_keys: Mapping[str, str] = DEFAULT_POSTFIX_KEYS,
        line_every_percent: float = 5.0,
        heartbeat_s: float = 300.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if total < 1:
            raise ValueError(f"total must be >= 1, got {total}")
        if not 0 <= initial <= total:
            raise ValueError(f"initial must be in [0, {total}], got {initial}")
        if line_every_percent <= 0:
            raise ValueError(f"line_every_percent must be > 0, got {line_every_percent}")
        self.total, self.initial, self.enabled, self.desc = total, initial, enabled, desc
        self.file = sys.stderr if file is None else file
        self.postfix_keys = dict(postfix_keys)
        self.line_every_percent, self.heartbeat_s = line_every_percent, heartbeat_s
        self._clock = clock
        self._postfix: dict[str, str] = {}
        self.step = initial
        self._start = clock()
        self._last_line_time: Optional[float] = None
        self._last_line_step: Optional[int] = None
        self._bar = None
        self.is_terminal = bool(enabled and getattr(self.file, "isatty", lambda: False)())
        if self.is_terminal:
            self._bar = tqdm(
                total=total,
                initial=initial,
                desc=desc,
                unit="step",
                file=self.file,
                dynamic_ncols=True,
                mininterval=1.0,
            )

    def update(self, step: int, metrics: Optional[Mapping[str, Any]] = None) -> None:
        """Record that ``step`` (absolute, not an increment) is done; ``metrics`` feed the postfix."""
        if not self.enabled:
            return
        if metrics:
            self._update_postfix(metrics)
        self.step = step
        if self._bar is not None:
            self._bar.set_postfix_str(self.postfix_text(), refresh=False)
            self._bar.update(step - self._bar.n)
        elif self._line_due(step):
            self._write_line()

    def postfix_text(self) -> str:
        """The current postfix, e.g. ``score=0.4531 val_acc=0.25 len=312.5``."""
        labels = [label for label in self.postfix_keys.values() if label in self._postfix]
        return " ".join(f"{label}={self._postfix[label]}" for label in labels)

    def eta_seconds(self) -> Optional[float]:
        """Seconds left at the rate of this process's steps so far; None before the first step."""
        done = self.step - self.initial
        if done <= 0:
            return None
        return (self.total - self.step) * (self._clock() - self._start) / done

    def close(self) -> None:
        """Finish the bar (terminal) or print the final line if the last update was not printed."""
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        elif self.step != self._last_line_step and self.step > self.initial:
            self._write_line()
        self.enabled = False  # later calls are no-ops

    def __enter__(self) -> "ProgressBar":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def _update_postfix(self, metrics: Mapping[str, Any]) -> None:
        for pattern, label in self.postfix_keys.items():
            if pattern.endswith("*"):
                matches = [key for key in sorted(metrics) if key.startswith(pattern[:-1])]
            else:
                matches = [pattern] if pattern in metrics else []
            for key in matches[-1:]:  # several matches (mean@1, mean@16): the last in sorted order
                value = metrics[key]
                self._postfix[label] = format_value(value if isinstance(value, int) else float(value))

    def _bucket(self, step: int) -> int:
        return math.floor(100.0 * step / self.total / self.line_every_percent)

    def _line_due(self, step: int) -> bool:
        if self._last_line_step is None or step >= self.total:
            return True
        if self._bucket(step) > self._bucket(self._last_line_step):
            return True
        return self._clock() - self._last_line_time >= self.heartbeat_s

    def _write_line(self) -> None:
        now = self._clock()
        elapsed = now - self._start
        done = self.step - self.initial
        eta = self.eta_seconds()
        parts = [
            f"{self.desc} {self.step}/{self.total} ({100.0 * self.step / self.total:.0f}%)",
            f"elapsed {_format_interval(elapsed)}",
            f"eta {_format_interval(eta) if eta is not None else '?'}",
        ]
        if done > 0:
            parts.append(f"{elapsed / done:.3g} s/step")
        postfix = self.postfix_text()
        if postfix:
            parts.append(postfix)
        self.file.write(" | ".join(parts) + "\n")
        self.file.flush()
        self._last_line_time, self._last_line_step = now, self.step
