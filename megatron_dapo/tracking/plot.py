"""A PNG of a run's reward, validation accuracy and response length per step, from ``metrics.jsonl``.

    plot_metrics("outputs/run/metrics.jsonl", "outputs/run/plot.png", title="dapo tiny")
    python -m megatron_dapo.tracking.plot outputs/run/metrics.jsonl outputs/run/plot.png

Three panels side by side:

* reward: ``critic/score/mean`` (the task score) and, dashed, ``critic/rewards/mean`` (score plus
  the overlong penalty) when logged;
* validation accuracy: every ``val/acc/mean@<k>`` (avg@k) and ``val/pass@<k>`` key, one line with
  markers each (validation runs only every few steps);
* response length: ``response_length/mean`` in tokens, and ``response_length/clip_ratio`` (the
  share of responses cut at the length limit) on a second y axis.

A panel whose keys are absent says "no data"; records sharing a step are merged. Drawing uses
matplotlib's Agg canvas directly (no pyplot, so no GUI backend and no global figure state), and the
file is written to a temporary name then renamed, so a reader never sees half a PNG.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Optional, Union

from megatron_dapo.checkpoint.layout import fsync_dir
from megatron_dapo.tracking.loggers import METRICS_FILE, read_metrics

__all__ = ["PLOT_FILE", "main", "metrics_figure", "plot_metrics"]

PathLike = Union[str, os.PathLike]
PLOT_FILE = "plot.png"

_SCORE, _REWARD = "critic/score/mean", "critic/rewards/mean"
_LENGTH, _CLIP = "response_length/mean", "response_length/clip_ratio"
_VAL_PREFIXES = (("val/acc/mean@", "avg@"), ("val/pass@", "pass@"))


def _merge_by_step(records: list[dict[str, Any]]) -> dict[int, dict[str, Any]]:
    merged: dict[int, dict[str, Any]] = {}
    for record in records:
        merged.setdefault(record["step"], {}).update(record)  # a later record of a step wins
    return dict(sorted(merged.items()))


def _series(rows: dict[int, dict[str, Any]], key: str) -> tuple[list[int], list[float]]:
    """Steps where ``key`` was logged and its values (NaN kept: matplotlib draws a gap)."""
    steps = [step for step, row in rows.items() if key in row]
    return steps, [float(rows[step][key]) for step in steps]


def _has_finite(values: list[float]) -> bool:
    return any(math.isfinite(value) for value in values)


def _validation_keys(rows: dict[int, dict[str, Any]]) -> list[tuple[str, str]]:
    """(metric key, legend label) of the validation accuracy keys, avg@k before pass@k, k ascending."""
    found = {key for row in rows.values() for key in row}
    keys = []
    for order, (prefix, label) in enumerate(_VAL_PREFIXES):
        for key in found:
            suffix = key[len(prefix) :]
            if key.startswith(prefix) and suffix:
                sort_k = (0, int(suffix), "") if suffix.isdigit() else (1, 0, suffix)
                keys.append(((order, sort_k), key, label + suffix))
    return [(key, label) for _, key, label in sorted(keys)]


def _no_data(ax) -> None:
    ax.text(0.5, 0.5, "no data", transform=ax.transAxes, ha="center", va="center", color="0.5", fontsize=12)


def _draw_reward(ax, rows) -> None:
    ax.set_title("reward")
    drawn = False
    for key, style, label in ((_SCORE, "-", "score"), (_REWARD, "--", "reward (with overlong penalty)")):
        steps, values = _series(rows, key)
        if _has_finite(values):
            ax.plot(steps, values, style, marker="." if len(steps) < 50 else None, label=label)
            drawn = True
    if drawn:
        ax.set_ylabel("mean per response")
        ax.legend(loc="best", fontsize=8)
    else:
        _no_data(ax)


def _draw_validation(ax, rows) -> None:
    ax.set_title("validation accuracy")
    drawn = False
    for key, label in _validation_keys(rows):
        steps, values = _series(rows, key)
        if _has_finite(values):
            ax.plot(steps, values, marker="o", label=label)
            drawn = True
    if drawn:
        ax.set_ylabel("accuracy")
        ax.legend(loc="best", fontsize=8)
    else:
        _no_data(ax)


def _draw_length(ax, rows) -> None:
    ax.set_title("response length")
    steps, values = _series(rows, _LENGTH)
    clip_steps, clip_values = _series(rows, _CLIP)
    handles = []
    if _has_finite(values):
        handles += ax.plot(steps, values, color="C0", marker="." if len(steps) < 50 else None, label="mean length")
        ax.set_ylabel("tokens")
    if _has_finite(clip_values):
        twin = ax.twinx()
        handles += twin.plot(clip_steps, clip_values, color="C3", linestyle=":", label="clip ratio")
        twin.set_ylabel("clip ratio", color="C3")
        twin.set_ylim(0.0, max(1e-3, 1.1 * max(v for v in clip_values if math.isfinite(v))))
    if handles:
        ax.legend(handles=handles, labels=[h.get_label() for h in handles], loc="best", fontsize=8)
    else:
        _no_data(ax)


def _require_matplotlib() -> None:
    try:
        import matplotlib  # noqa: F401
    except ImportError as error:
        raise ImportError(
            "plotting metrics needs matplotlib: pip install matplotlib (or pip install 'megatron-dapo[plot]')"
        ) from error


def metrics_figure(records: Sequence[dict[str, Any]], *, title: str = ""):
    """The three-panel matplotlib ``Figure`` (Agg canvas) of ``records`` as :func:`read_metrics` returns them.

    Axes order: reward, validation accuracy, response length (its clip-ratio twin axis is the
    figure's fourth axes when drawn).
    """
    _require_matplotlib()  # matplotlib is optional: imported only to draw
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    rows = _merge_by_step(list(records))
    figure = Figure(figsize=(15, 4.2), dpi=100, layout="constrained")
    FigureCanvasAgg(figure)
    axes = figure.subplots(1, 3)
    for ax, draw in zip(axes, (_draw_reward, _draw_validation, _draw_length)):
        draw(ax, rows)
        ax.set_xlabel("step")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
    if title:
        figure.suptitle(title)
    return figure


def plot_metrics(metrics_path: PathLike, output_png: PathLike, *, title: str = "") -> Path:
    """Draw the reward, validation accuracy and response length panels of a run into ``output_png``.

    ``metrics_path`` is a ``metrics.jsonl`` file or the run directory holding one. Missing keys
    give "no data" panels rather than errors; a missing file raises ``FileNotFoundError``.
    Returns the path of the written PNG.
    """
    _require_matplotlib()
    figure = metrics_figure(read_metrics(metrics_path), title=title)
    output_png = Path(output_png)
    output_png.parent.mkdir(parents=True, exist_ok=True)
    tmp = output_png.with_name(f".{output_png.name}.tmp-{os.getpid()}")
    try:
        figure.savefig(tmp, format="png")
        os.replace(tmp, output_png)
    finally:
        tmp.unlink(missing_ok=True)
    fsync_dir(output_png.parent)
    return output_png


def main(argv: Optional[Sequence[str]] = None) -> int:
    """``python -m megatron_dapo.tracking.plot METRICS [OUTPUT] [--title T]``; prints the PNG path."""
    parser = argparse.ArgumentParser(
        prog="python -m megatron_dapo.tracking.plot",
        description="Plot reward, validation accuracy and response length per step from metrics.jsonl.",
    )
    parser.add_argument("metrics", help="metrics.jsonl, or the run directory that holds it")
    parser.add_argument("output", nargs="?", help=f"PNG to write (default: {PLOT_FILE} next to the metrics)")
    parser.add_argument("--title", default="", help="figure title")
    args = parser.parse_args(argv)
    metrics = Path(args.metrics)
    if args.output:
        output = Path(args.output)
    else:
        output = (metrics if metrics.is_dir() else metrics.parent) / PLOT_FILE
    if not (metrics / METRICS_FILE if metrics.is_dir() else metrics).exists():
        parser.error(f"no metrics file at {metrics}")
    print(plot_metrics(metrics, output, title=args.title))
    return 0


if __name__ == "__main__":
    sys.exit(main())
