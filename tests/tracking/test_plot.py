"""plot_metrics: a real PNG from metrics.jsonl, panels with and without their keys, CLI entry point."""

from __future__ import annotations

import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_dapo.tracking import MetricsLogger, read_metrics
from megatron_dapo.tracking.plot import main, metrics_figure, plot_metrics

REPO_ROOT = Path(__file__).resolve().parents[2]
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _write_run(run_dir: Path, steps: int = 12, with_validation: bool = True) -> Path:
    """A run as the trainer logs it: training metrics every step, validation in separate records."""
    with MetricsLogger(run_dir, ["jsonl"]) as logger:
        for step in range(0, steps + 1):
            if with_validation and step % 4 == 0:
                validation = {"val/acc/mean@16": 0.2 + step / 100, "val/acc/mean@2": 0.1 + step / 100, "val/pass@16": 0.6}
                logger.log(validation, step)
            if step:
                logger.log(
                    {
                        "critic/score/mean": step / 20,
                        "critic/rewards/mean": step / 20 - 0.05,
                        "response_length/mean": 200.0 + 10 * step,
                        "response_length/clip_ratio": step / 100,
                    },
                    step,
                )
    return run_dir / "metrics.jsonl"


def _png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == PNG_SIGNATURE
    assert data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


def _lines(ax) -> dict[str, tuple[list, list]]:
    return {line.get_label(): (list(line.get_xdata()), list(line.get_ydata())) for line in ax.get_lines()}


def _says_no_data(ax) -> bool:
    return any(text.get_text() == "no data" for text in ax.texts)


def test_png_written_atomically_and_valid(tmp_path):
    metrics = _write_run(tmp_path)
    out = tmp_path / "plot.png"
    out.write_bytes(b"stale")
    assert plot_metrics(metrics, out, title="tiny run") == out
    assert _png_size(out) == (1500, 420)
    assert out.stat().st_size > 20_000  # three drawn panels, not a blank image
    assert sorted(p.name for p in tmp_path.iterdir()) == ["metrics.jsonl", "plot.png"]  # no temporary left

    import matplotlib.image

    pixels = matplotlib.image.imread(out)
    assert pixels.shape[:2] == (420, 1500) and len({tuple(p) for p in pixels.reshape(-1, pixels.shape[-1])[::97]}) > 10


def test_panels_show_the_logged_series(tmp_path):
    figure = metrics_figure(read_metrics(_write_run(tmp_path)))
    reward, validation, length, clip = figure.axes
    steps = list(range(1, 13))
    assert _lines(reward)["score"] == (steps, [s / 20 for s in steps])
    assert _lines(reward)["reward (with overlong penalty)"][1] == pytest.approx([s / 20 - 0.05 for s in steps])
    # avg@k before pass@k, k in numeric order (2 before 16); only validation steps.
    assert list(_lines(validation)) == ["avg@2", "avg@16", "pass@16"]
    assert _lines(validation)["avg@16"] == ([0, 4, 8, 12], pytest.approx([0.2, 0.24, 0.28, 0.32]))
    assert _lines(length)["mean length"] == (steps, [200.0 + 10 * s for s in steps])
    assert _lines(clip)["clip ratio"][1] == pytest.approx([s / 100 for s in steps])
    assert not any(_says_no_data(ax) for ax in (reward, validation, length))


def test_missing_keys_give_no_data_panels(tmp_path):
    metrics = _write_run(tmp_path, with_validation=False)
    reward, validation, length, _ = metrics_figure(read_metrics(metrics)).axes
    assert _says_no_data(validation) and not _says_no_data(reward) and not _says_no_data(length)
    out = plot_metrics(metrics, tmp_path / "no_val.png")
    assert out.stat().st_size > 10_000 and _png_size(out) == (1500, 420)

    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    assert all(_says_no_data(ax) for ax in metrics_figure([]).axes)
    assert _png_size(plot_metrics(empty, tmp_path / "empty.png")) == (1500, 420)

    with pytest.raises(FileNotFoundError):
        plot_metrics(tmp_path / "absent.jsonl", tmp_path / "x.png")


def test_cli_main_defaults_next_to_the_metrics(tmp_path, capsys):
    _write_run(tmp_path / "run", steps=3)
    assert main([str(tmp_path / "run")]) == 0
    assert capsys.readouterr().out.strip() == str(tmp_path / "run" / "plot.png")
    _png_size(tmp_path / "run" / "plot.png")
    with pytest.raises(SystemExit):
        main([str(tmp_path / "nowhere.jsonl")])


def test_python_dash_m_entry_point(tmp_path):
    metrics = _write_run(tmp_path, steps=3)
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    result = subprocess.run(
        [sys.executable, "-W", "error::RuntimeWarning", "-m", "megatron_dapo.tracking.plot", str(metrics),
         str(tmp_path / "cli.png"), "--title", "cli"],
        capture_output=True, text=True, env=env, timeout=120,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    _png_size(tmp_path / "cli.png")


def _write_async_run(run_dir: Path, steps: int = 6) -> Path:
    with MetricsLogger(run_dir, ["jsonl"]) as logger:
        for step in range(1, steps + 1):
            stale = 0.0 if step == 1 else 0.75
            logger.log(
                {
                    "critic/score/mean": step / 20,
                    "async/staleness_frac_0": 1.0 - stale, "async/staleness_frac_1": stale,
                    "async/staleness_mean": stale, "async/token_staleness_mean": stale / 3, "async/staleness_max": float(step > 1),
                    "async/trainer_wait_s": 2.0 / step, "async/engine_wait_s": 0.5, "weight_sync/seconds": 0.1,
                    "async/overlap_frac": 0.4, "train/num_groups_stale_dropped": float(step % 2), "train/num_groups_carried": 2.0,
                },
                step,
            )  # fmt: skip
    return run_dir / "metrics.jsonl"


def test_an_asynchronous_run_gets_a_second_row(tmp_path):
    figure = metrics_figure(read_metrics(_write_async_run(tmp_path)))
    panels = {ax.get_title(): ax for ax in figure.axes if ax.get_title()}
    assert list(panels) == ["reward", "validation accuracy", "response length",
                            "staleness (share of samples per step)", "async timeline", "prompt groups"]  # fmt: skip
    staleness = panels["staleness (share of samples per step)"]
    bars = {container.get_label(): [patch.get_height() for patch in container] for container in staleness.containers}
    assert bars == {"0 behind": [1.0] + [0.25] * 5, "1 behind": [0.0] + [0.75] * 5}
    bottoms = [patch.get_y() for patch in staleness.containers[1]]
    assert bottoms == [1.0] + [0.25] * 5  # stacked: every step's histogram sums to 1
    twins = {label: values for ax in figure.axes for label, values in _lines(ax).items()}
    assert twins["mean per token"][1] == pytest.approx([0.0] + [0.25] * 5)
    assert twins["generation-training overlap"][1] == [0.4] * 6
    assert _lines(panels["async timeline"])["trainer waits for samples"][1] == pytest.approx([2.0 / s for s in range(1, 7)])
    assert _lines(panels["prompt groups"])["dropped for staleness"][1] == [1.0, 0.0, 1.0, 0.0, 1.0, 0.0]
    out = plot_metrics(tmp_path / "metrics.jsonl", tmp_path / "async.png")
    assert _png_size(out) == (1500, 840)
    # A synchronous run keeps its one row.
    assert _png_size(plot_metrics(_write_run(tmp_path / "sync"), tmp_path / "sync.png")) == (1500, 420)
