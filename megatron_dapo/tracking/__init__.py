"""Metrics tracking: the per-step logger (console, jsonl, TensorBoard, W&B), phase timer, progress bar, plot.

    from megatron_dapo.tracking import MetricsLogger, PhaseTimer, ProgressBar, plot_metrics

Nothing heavy is imported here: TensorBoard, W&B and matplotlib load when a backend or plot needs
them. ``plot_metrics`` is resolved lazily so that ``python -m megatron_dapo.tracking.plot`` runs the
module once, as ``__main__``.
"""

from megatron_dapo.tracking.loggers import (
    BACKENDS,
    METRICS_FILE,
    LoggerBackendUnavailable,
    MetricsLogger,
    format_metrics_table,
    read_metrics,
    truncate_metrics_after,
)
from megatron_dapo.tracking.progress import ProgressBar
from megatron_dapo.tracking.timer import PhaseTimer
from megatron_dapo.tracking.plot import plot_metrics

__all__ = [
    "BACKENDS",
    "METRICS_FILE",
    "LoggerBackendUnavailable",
    "MetricsLogger",
    "PhaseTimer",
    "ProgressBar",
    "format_metrics_table",
    "plot_metrics",
    "read_metrics",
    "truncate_metrics_after",
]


def __getattr__(name: str):
    if name == "plot_metrics":
        return plot_metrics
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
