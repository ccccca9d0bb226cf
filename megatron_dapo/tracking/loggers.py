"""Per-step metrics to the console, a JSON-lines file, TensorBoard and (optionally) Weights & Biases.

    with MetricsLogger(cfg.trainer.output_dir, cfg.trainer.loggers, config=resolved,
                       enabled=is_logging_rank, resume_step=ckpt_step) as logger:
        logger.log({"critic/score/mean": 0.41, "timing_s/gen": 12.3, ...}, step)

Backends (names as in ``trainer.loggers``):

* ``console``: an aligned table of the step's metrics grouped by prefix (``critic/``, ``actor/``,
  ``response_length/``, ``timing_s/``, ``val/`` ...), several metrics per line, numbers to 4
  significant digits. Printed every ``console_every`` steps and whenever the metrics hold ``val/``
  keys (validation is rare and worth seeing). Written with ``tqdm.write`` so that a progress bar
  on the terminal is cleared and redrawn rather than torn.
* ``jsonl``: ``<output_dir>/metrics.jsonl``, one JSON object per ``log`` call, ``"step"`` first.
  Each line is flushed and fsynced before ``log`` returns, so a crash loses at most the line being
  written (a torn last line is dropped by the readers and repaired on the next open). JSON has no
  NaN or infinity: non-finite values are written as ``null`` and :func:`read_metrics` returns them
  as ``float("nan")`` (the sign of an infinity is lost; such values mean the run diverged anyway).
* ``tensorboard``: ``torch.utils.tensorboard.SummaryWriter`` under ``<output_dir>/tensorboard``,
  one scalar per metric, the resolved config as a text summary.
* ``wandb``: ``wandb.init(project=$WANDB_PROJECT or experiment_name, name=experiment_name,
  config=config, dir=output_dir, id=<run id>, resume="allow")``. The run id is kept in
  ``<output_dir>/wandb_run_id`` so that a resumed run continues the same W&B run. Credentials and
  offline mode are W&B's own business (``wandb login``, ``WANDB_API_KEY``, ``WANDB_MODE=offline``).

Resume: pass ``resume_step`` (the step of the checkpoint the run restarts from). Lines of
``metrics.jsonl`` with a later step are dropped (:func:`truncate_metrics_after`) and TensorBoard
purges events after it, so a resumed run records every step exactly once. A fresh run
(``resume_step=None``) removes the event files an earlier run left in ``tensorboard/``.

Only the logging rank writes: elsewhere the trainer passes ``enabled=False`` and every call is a
no-op that creates no file and imports nothing (backend names are still checked, so a typo fails
on every rank alike).
"""

from __future__ import annotations

import json
import math
import operator
import os
import sys
import uuid
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Optional, Protocol, TextIO, Union

from tqdm import tqdm

from megatron_dapo.checkpoint.layout import atomic_write_text

__all__ = [
    "BACKENDS",
    "LoggerBackendUnavailable",
    "MetricsLogger",
    "METRICS_FILE",
    "format_metrics_table",
    "format_value",
    "read_metrics",
    "truncate_metrics_after",
]

PathLike = Union[str, os.PathLike]
Number = Union[int, float]

METRICS_FILE = "metrics.jsonl"
TENSORBOARD_DIR = "tensorboard"
WANDB_RUN_ID_FILE = "wandb_run_id"
BACKENDS = ("console", "jsonl", "tensorboard", "wandb")

# Console groups in the order a reader scans a DAPO step: outcome, update, lengths, data, cost.
_GROUP_ORDER = ("critic", "actor", "response_length", "prompt_length", "train", "rollout", "val", "timing_s", "perf")
_UNGROUPED = "misc"


class LoggerBackendUnavailable(ImportError):
    """A backend listed in ``trainer.loggers`` needs a package that is not installed."""


# --------------------------------------------------------------------------------------------
# Formatting
# --------------------------------------------------------------------------------------------


def format_value(value: Number) -> str:
    """Integers in full, floats to 4 significant digits (``0.4531``, ``1.234e+04``), ``nan``/``inf``."""
    if isinstance(value, int):
        return str(value)
    if math.isnan(value):
        return "nan"
    if math.isinf(value):
        return "inf" if value > 0 else "-inf"
    return f"{value:.4g}"


def _split_group(key: str) -> tuple[str, str]:
    group, sep, rest = key.partition("/")
    return (group, rest) if sep and rest else (_UNGROUPED, key)


def _group_rank(group: str) -> tuple[int, str]:
    return (_GROUP_ORDER.index(group), "") if group in _GROUP_ORDER else (len(_GROUP_ORDER), group)


def format_metrics_table(metrics: Mapping[str, Number], step: int, *, width: int = 110) -> str:
    """The console table of one step: a header line, then one block per metric group.

    Each block starts with the group name; its metrics (the key without the group prefix, then the
    value) are laid out in aligned columns, as many per line as fit in ``width`` characters, and
    continue on indented lines. Groups follow the order critic, actor, response_length,
    prompt_length, train, rollout, val, timing_s, perf, then others alphabetically; keys within a
    group are sorted.
    """
    groups: dict[str, list[tuple[str, str]]] = {}
    for key, value in metrics.items():
        group, name = _split_group(key)
        groups.setdefault(group, []).append((name, format_value(value)))
    header = f"── step {step} "
    lines = [header + "─" * max(0, width - len(header))]
    if not groups:
        return "\n".join(lines + ["(no metrics)"])
    label_width = max(len(group) for group in groups) + 2
    gap = "   "
    for group in sorted(groups, key=_group_rank):
        cells = sorted(groups[group])
        name_width = max(len(name) for name, _ in cells)
        value_width = max(len(value) for _, value in cells)
        cell_width = name_width + 1 + value_width
        per_line = max(1, (width - label_width + len(gap)) // (cell_width + len(gap)))
        for start in range(0, len(cells), per_line):
            row = gap.join(
                f"{name:<{name_width}} {value:>{value_width}}" for name, value in cells[start : start + per_line]
            )
            label = group if start == 0 else ""
            lines.append(f"{label:<{label_width}}{row}".rstrip())
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------
# metrics.jsonl reading and resume truncation
# --------------------------------------------------------------------------------------------


def _parse_jsonl(path: Path) -> list[tuple[str, dict[str, Any]]]:
    """(line text with its newline, parsed object) for every complete line of a metrics file.

    A last line without a newline that does not parse is a write torn by a crash: it is dropped
    with a warning. Any other unparsable line, or one without an integer ``step``, is corruption
    and raises ``ValueError`` with the line number.
    """
    text = path.read_text(encoding="utf-8")
    raw_lines = text.splitlines(keepends=True)
    parsed = []
    for number, line in enumerate(raw_lines, start=1):
        if not line.strip():
            continue
        torn = number == len(raw_lines) and not line.endswith("\n")
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as error:
            if torn:
                warnings.warn(f"{path}: ignoring the torn last line {number} (a write interrupted by a crash)")
                break
            raise ValueError(f"{path}:{number}: not valid JSON ({error})") from None
        step = obj.get("step") if isinstance(obj, dict) else None
        if not isinstance(step, int) or isinstance(step, bool):
            raise ValueError(
                f"{path}:{number}: expected a JSON object with an integer 'step', got {line.strip()[:80]!r}"
            )
        parsed.append((line if line.endswith("\n") else line + "\n", obj))
    return parsed


def read_metrics(path: PathLike) -> list[dict[str, Any]]:
    """Every record of a ``metrics.jsonl`` file in file order; ``null`` values come back as NaN.

    A directory is read as ``<path>/metrics.jsonl``. Several records may share a step (the trainer
    may log training and validation metrics separately).
    """
    path = Path(path)
    if path.is_dir():
        path = path / METRICS_FILE
    return [
        {key: (math.nan if value is None else value) for key, value in obj.items()} for _, obj in _parse_jsonl(path)
    ]


def truncate_metrics_after(path: PathLike, step: int) -> None:
    """Drop the records of ``path`` with a step greater than ``step`` (and a torn last line).

    Used on resume from the checkpoint of ``step`` so that the steps replayed after it are recorded
    once. The file is rewritten atomically (temporary file, fsync, rename): a crash leaves the old
    or the new content. A missing file is left missing.
    """
    path = Path(path)
    if path.is_dir():
        path = path / METRICS_FILE
    if not path.exists():
        return
    original = path.read_text(encoding="utf-8")
    kept = "".join(line for line, obj in _parse_jsonl(path) if obj["step"] <= step)
    if kept != original:
        atomic_write_text(path, kept)


# --------------------------------------------------------------------------------------------
# Backends
# --------------------------------------------------------------------------------------------


class _Backend(Protocol):
    def log(self, metrics: Mapping[str, Number], step: int) -> None: ...

    def close(self) -> None: ...


class _ConsoleBackend:
    def __init__(self, stream: TextIO, every: int, width: int) -> None:
        self.stream, self.every, self.width = stream, every, width

    def log(self, metrics: Mapping[str, Number], step: int) -> None:
        has_validation = any(key.startswith("val/") for key in metrics)
        if step % self.every and not has_validation:
            return

        # tqdm.write clears any progress bar drawn on the terminal, prints, then redraws it.
        tqdm.write(format_metrics_table(metrics, step, width=self.width), file=self.stream)
        self.stream.flush()

    def close(self) -> None:
        self.stream.flush()


class _JsonlBackend:
    def __init__(self, path: Path) -> None:
        self.path = path
        _drop_torn_last_line(path)
        self._file = open(path, "a", encoding="utf-8")

    def log(self, metrics: Mapping[str, Number], step: int) -> None:
        record = {"step": step}
        record.update({key: value if math.isfinite(value) else None for key, value in metrics.items()})
        self._file.write(json.dumps(record, allow_nan=False) + "\n")
        self._file.flush()
        os.fsync(self._file.fileno())  # one fsync per step: negligible next to an RL step

    def close(self) -> None:
        self._file.close()


def _drop_torn_last_line(path: Path) -> None:
    """Cut a last line without newline (a crash mid-write) so that appending starts a fresh line."""
    if not path.exists():
        return
    data = path.read_bytes()
    if data and not data.endswith(b"\n"):
        with open(path, "r+b") as handle:
            handle.truncate(data.rfind(b"\n") + 1)


class _TensorBoardBackend:
    def __init__(self, log_dir: Path, config: Optional[Mapping[str, Any]], resume_step: Optional[int]) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as error:
            raise LoggerBackendUnavailable(
                "trainer.loggers includes 'tensorboard' but TensorBoard is not installed "
                f"({error}): pip install tensorboard (or pip install 'megatron-dapo[plot]'), "
                "or remove 'tensorboard' from trainer.loggers"
            ) from error
        # purge_step hides the events a crashed run wrote after the checkpoint it resumes from.
        purge_step = None if resume_step is None else resume_step + 1
        if resume_step is None:
            remove_stale_event_files(log_dir)
        self._writer = SummaryWriter(log_dir=str(log_dir), purge_step=purge_step, flush_secs=30)
        if config:
            text = json.dumps(config, indent=2, sort_keys=True, default=str)
            # TensorBoard renders text summaries as markdown: indent to keep it verbatim.
            self._writer.add_text("config", "\n".join("    " + line for line in text.splitlines()), global_step=0)

    def log(self, metrics: Mapping[str, Number], step: int) -> None:
        for key, value in metrics.items():
            self._writer.add_scalar(key, value, global_step=step)
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


def remove_stale_event_files(log_dir: Path) -> list[Path]:
    """Delete the TensorBoard event files an earlier run left in `log_dir` (a fresh run's directory).

    TensorBoard shows every event file of a directory as one run, so an old run's curves would be
    drawn into the new one's (and a longer old run would show steps the new run never made)."""
    removed = []
    if log_dir.is_dir():
        for path in sorted(log_dir.glob("events.out.tfevents.*")):
            if path.is_file():
                path.unlink()
                removed.append(path)
    return removed


class _WandbBackend:
    def __init__(
        self,
        output_dir: Path,
        experiment_name: str,
        config: Optional[Mapping[str, Any]],
        resume_step: Optional[int],
    ) -> None:
        try:
            import wandb
        except ImportError as error:
            raise LoggerBackendUnavailable(
                "trainer.loggers includes 'wandb' but the wandb package is not installed: "
                "pip install wandb, or remove 'wandb' from trainer.loggers"
            ) from error
        id_file = output_dir / WANDB_RUN_ID_FILE
        run_id = None
        if resume_step is not None and id_file.exists():
            run_id = id_file.read_text().strip() or None
        if run_id is None:
            run_id = uuid.uuid4().hex[:16]  # W&B ids: unique per project, no / \ # ? % :
            atomic_write_text(id_file, run_id + "\n")
        self._run = wandb.init(
            project=os.environ.get("WANDB_PROJECT") or experiment_name,
            name=experiment_name,
            config=dict(config) if config else None,
            dir=str(output_dir),
            id=run_id,
            resume="allow",
        )

    def log(self, metrics: Mapping[str, Number], step: int) -> None:
        self._run.log(dict(metrics), step=step)

    def close(self) -> None:
        self._run.finish()


# --------------------------------------------------------------------------------------------
# The composite logger
# --------------------------------------------------------------------------------------------


def _as_number(key: str, value: Any) -> Number:
    """A plain int or float from Python, numpy or 0-d torch numbers; anything else is a caller bug."""
    if isinstance(value, (bool, int)):
        return int(value)
    if isinstance(value, float):  # numpy.float64 included: it subclasses float
        return float(value)
    item = getattr(value, "item", None)  # numpy scalars and one-element tensors
    if callable(item):
        try:
            plain = item()
        except (ValueError, RuntimeError):
            plain = None  # a tensor with several elements
        if isinstance(plain, (bool, int, float)):
            return _as_number(key, plain)
    raise TypeError(f"metric {key!r}: expected a number, got {type(value).__name__} {value!r:.60}")


def _as_step(step: Any) -> int:
    """A plain int from Python, numpy or integer-tensor steps; floats and bools are caller bugs."""
    if not isinstance(step, bool):
        try:
            return operator.index(step)
        except TypeError:
            pass
    raise TypeError(f"step must be an integer, got {step!r}")


class MetricsLogger:
    """Sends each step's metrics to the configured backends (see the module docstring).

    Args:
        output_dir: run directory; ``metrics.jsonl``, ``tensorboard/`` and ``wandb/`` go under it.
        backends: names from ``trainer.loggers``: console, jsonl, tensorboard, wandb.
        experiment_name: W&B run name and default project.
        config: the resolved config (a plain dict), recorded by TensorBoard and W&B.
        enabled: False on every rank but the logging one: all calls are then no-ops.
        console_every: print the console table every N steps (and at validation steps).
        stream: where the console table goes; None means ``sys.stdout`` at construction time.
        resume_step: the checkpoint step a resumed run restarts from (None for a fresh run); later
            records are dropped from ``metrics.jsonl`` and hidden in TensorBoard.
        console_width: characters per console line.

    Raises:
        ValueError: an unknown backend name or ``console_every < 1``.
        LoggerBackendUnavailable: tensorboard or wandb requested but not installed.
    """

    def __init__(
        self,
        output_dir: PathLike,
        backends: Sequence[str] = ("console", "jsonl", "tensorboard"),
        *,
        experiment_name: str = "dapo",
        config: Optional[Mapping[str, Any]] = None,
        enabled: bool = True,
        console_every: int = 1,
        stream: Optional[TextIO] = None,
        resume_step: Optional[int] = None,
        console_width: int = 110,
    ) -> None:
        if isinstance(backends, str):
            backends = [backends]  # a lone name, not its characters
        unknown = [name for name in backends if name not in BACKENDS]
        if unknown:
            raise ValueError(f"trainer.loggers: unknown logger(s) {unknown}; valid: {', '.join(BACKENDS)}")
        if console_every < 1:
            raise ValueError(f"console_every must be >= 1, got {console_every}")
        self.output_dir = Path(output_dir)
        self.enabled = enabled
        self.backend_names = tuple(dict.fromkeys(backends))  # drop repeats, keep order
        self._backends: dict[str, _Backend] = {}
        self._closed = False
        if not enabled:
            return
        self.output_dir.mkdir(parents=True, exist_ok=True)
        try:
            for name in self.backend_names:
                self._backends[name] = self._open_backend(
                    name, experiment_name, config, console_every, stream, resume_step, console_width
                )
        except BaseException:
            self.close()  # release the backends opened before the failing one
            raise

    def _open_backend(
        self, name, experiment_name, config, console_every, stream, resume_step, console_width
    ) -> _Backend:
        if name == "console":
            return _ConsoleBackend(sys.stdout if stream is None else stream, console_every, console_width)
        if name == "jsonl":
            path = self.output_dir / METRICS_FILE
            if resume_step is not None:
                truncate_metrics_after(path, resume_step)
            return _JsonlBackend(path)
        if name == "tensorboard":
            return _TensorBoardBackend(self.output_dir / TENSORBOARD_DIR, config, resume_step)
        return _WandbBackend(self.output_dir, experiment_name, config, resume_step)

    @property
    def metrics_path(self) -> Path:
        """Where the jsonl backend writes (whether or not it is enabled)."""
        return self.output_dir / METRICS_FILE

    def log(self, metrics: Mapping[str, Any], step: int) -> None:
        """Record ``metrics`` (name -> number) for ``step`` on every backend.

        Values may be Python, numpy or one-element torch numbers. Raises ``TypeError`` for a value
        that is not a number and ``ValueError`` for a negative step or a metric named ``step``.
        """
        if not self.enabled:
            return
        if self._closed:
            raise RuntimeError("MetricsLogger.log called after close()")
        step = _as_step(step)
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        if "step" in metrics:
            raise ValueError("'step' is reserved for the step number; pass it as the `step` argument")
        clean = {str(key): _as_number(str(key), value) for key, value in metrics.items()}
        for backend in self._backends.values():
            backend.log(clean, step)

    def close(self) -> None:
        """Flush and close every backend (idempotent)."""
        if self._closed:
            return
        self._closed = True
        errors = []
        for backend in self._backends.values():
            try:
                backend.close()
            except Exception as error:  # close the others before reporting
                errors.append(error)
        if errors:
            raise errors[0]

    def __enter__(self) -> "MetricsLogger":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()
