"""A PNG of a run's reward, validation accuracy and response length per step (and its asynchronous
training), from ``metrics.jsonl``.

    plot_metrics("outputs/run/metrics.jsonl", "outputs/run/plot.png", title="dapo tiny")
    python -m megatron_dapo.tracking.plot outputs/run/metrics.jsonl outputs/run/plot.png

Three panels side by side:

* reward: ``critic/score/mean`` (the task score) and, dashed, ``critic/rewards/mean`` (score plus
  the overlong penalty) when logged;
* validation accuracy: every ``val/acc/mean@<k>`` (avg@k) and ``val/pass@<k>`` key, one line with
  markers each (validation runs only every few steps);
* response length: ``response_length/mean`` in tokens, and ``response_length/clip_ratio`` (the
  share of responses cut at the length limit) on a second y axis.

An asynchronous run (`trainer.max_staleness > 0`: its ``async/staleness_frac_<s>`` keys) gets a
second row:

* staleness: the share of the train batch's samples at each staleness 0..k, stacked per step (the
  histogram of every step), with ``async/staleness_mean`` and, with partial rollouts,
  ``async/token_staleness_mean`` (dashed) on a second y axis;
* async timeline: seconds per step the trainer waited for samples, the engines waited for work
  or weights, and the push took on the trainer's critical path (``weight_sync/seconds``), with the
  share of the step in which generation and training overlapped on a second y axis;
* groups: prompt groups dropped for staleness and carried over to the next step, per step.

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


_STALENESS_FRAC = "async/staleness_frac_"
_ASYNC_TIMES = (
    ("async/trainer_wait_s", "trainer waits for samples"),
    ("async/engine_wait_s", "engines wait for work / weights"),
    ("weight_sync/seconds", "push (trainer's critical path)"),
)
_GROUPS = (("train/num_groups_stale_dropped", "dropped for staleness"), ("train/num_groups_carried", "carried over"))


def _is_async(rows: dict[int, dict[str, Any]]) -> bool:
    return any(key.startswith(_STALENESS_FRAC) for row in rows.values() for key in row)


def _twin_lines(ax, rows, series, ylabel: str, color: str = "k") -> list:
    """Lines of `series` ((key, style, label), ...) on a second y axis of `ax`; their handles."""
    drawn = [(key, style, label) for key, style, label in series if _has_finite(_series(rows, key)[1])]
    if not drawn:
        return []
    twin = ax.twinx()
    handles = []
    for key, style, label in drawn:
        steps, values = _series(rows, key)
        handles += twin.plot(steps, values, style, color=color, marker="." if len(steps) < 50 else None, label=label)
    twin.set_ylabel(ylabel)
    return handles


def _legend(ax, handles) -> None:
    if handles:
        ax.legend(handles=handles, labels=[h.get_label() for h in handles], loc="best", fontsize=8)
    else:
        _no_data(ax)


def _draw_staleness(ax, rows) -> None:
    ax.set_title("staleness (share of samples per step)")
    levels = sorted({int(key[len(_STALENESS_FRAC) :]) for row in rows.values() for key in row if key.startswith(_STALENESS_FRAC)})
    handles, bottom = [], {}
    for level in levels:
        steps, values = _series(rows, f"{_STALENESS_FRAC}{level}")
        values = [v if math.isfinite(v) else 0.0 for v in values]
        base = [bottom.get(step, 0.0) for step in steps]
        handles.append(ax.bar(steps, values, bottom=base, width=0.8, color=f"C{level}", alpha=0.5, label=f"{level} behind"))
        for step, value in zip(steps, values):
            bottom[step] = bottom.get(step, 0.0) + value
    if handles:
        ax.set_ylim(0.0, 1.05)
        ax.set_ylabel("share of samples")
    handles += _twin_lines(
        ax, rows, (("async/staleness_mean", "-", "mean (oldest token)"), ("async/token_staleness_mean", "--", "mean per token")),
        "versions behind",
    )  # fmt: skip
    _legend(ax, handles)


def _per_step_lines(ax, rows, series: Sequence[tuple[str, str]], ylabel: str, first_color: int = 0) -> list:
    """One line per (key, label) of `series` that has values, colours from C<first_color> on; the handles."""
    handles = []
    for index, (key, label) in enumerate(series):
        steps, values = _series(rows, key)
        if _has_finite(values):
            handles += ax.plot(steps, values, color=f"C{first_color + index}", marker="." if len(steps) < 50 else None, label=label)
    if handles:
        ax.set_ylabel(ylabel)
    return handles


def _draw_async_timeline(ax, rows) -> None:
    ax.set_title("async timeline")
    handles = _per_step_lines(ax, rows, _ASYNC_TIMES, "seconds per step")
    handles += _twin_lines(ax, rows, (("async/overlap_frac", ":", "generation-training overlap"),), "share of the step", color="C3")
    _legend(ax, handles)


def _draw_groups(ax, rows) -> None:
    ax.set_title("prompt groups")
    _legend(ax, _per_step_lines(ax, rows, _GROUPS, "groups per step", first_color=3))


def _require_matplotlib() -> None:
    try:
        import matplotlib  # noqa: F401
    except ImportError as error:
        raise ImportError(
            "plotting metrics needs matplotlib: pip install matplotlib (or pip install 'megatron-dapo[plot]')"
        ) from error


def metrics_figure(records: Sequence[dict[str, Any]], *, title: str = ""):
    """The matplotlib ``Figure`` (Agg canvas) of ``records`` as :func:`read_metrics` returns them:
    three panels, and three more below for an asynchronous run (module doc).

    Axes order: reward, validation accuracy, response length, then (asynchronous runs) staleness,
    async timeline, prompt groups; the twin axes drawn (clip ratio, ...) follow them.
    """
    _require_matplotlib()  # matplotlib is optional: imported only to draw
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    rows = _merge_by_step(list(records))
    panels = [_draw_reward, _draw_validation, _draw_length]
    if _is_async(rows):
        panels += [_draw_staleness, _draw_async_timeline, _draw_groups]
    figure = Figure(figsize=(15, 4.2 * (len(panels) // 3)), dpi=100, layout="constrained")
    FigureCanvasAgg(figure)
    axes = figure.subplots(len(panels) // 3, 3).reshape(-1)
    for ax, draw in zip(axes, panels):
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
