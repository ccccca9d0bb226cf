"""What a run writes under `trainer.output_dir`, and the rules for a previous run found there.

    checkpoints/     `checkpointing.py` (the actor and the trainer state, one directory per step)
    metrics.jsonl    one line per logged step (`tracking.MetricsLogger`), with tensorboard/ and wandb/
    plot.png         the run's curves, redrawn after every checkpoint and at the end
    config.yaml      the configuration the run resolved

A fresh run never writes on top of a previous one: it needs `--resume` (continue it) or
`--overwrite` (delete what that run wrote, and nothing else).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Callable, Optional

from omegaconf import OmegaConf

from megatron_dapo.checkpoint.layout import atomic_write_text
from megatron_dapo.config import Config, config_to_dict
from megatron_dapo.errors import ConfigError
from megatron_dapo.tracking.loggers import METRICS_FILE, TENSORBOARD_DIR, WANDB_RUN_ID_FILE, MetricsLogger
from megatron_dapo.tracking.plot import PLOT_FILE, plot_metrics

CHECKPOINTS_DIR = "checkpoints"
RESOLVED_CONFIG_FILE = "config.yaml"
_WANDB_DIR = "wandb"  # wandb.init(dir=output_dir) writes here
# `--overwrite` removes these and nothing else.
_RUN_FILES = (METRICS_FILE, PLOT_FILE, RESOLVED_CONFIG_FILE, WANDB_RUN_ID_FILE)
_RUN_DIRS = (CHECKPOINTS_DIR, TENSORBOARD_DIR, _WANDB_DIR)


class OutputDirectoryError(ConfigError):
    """`trainer.output_dir` holds a previous run (and neither --resume nor --overwrite was given), or
    cannot be created."""


def checkpoints_dir(output_dir: os.PathLike | str) -> Path:
    return Path(output_dir) / CHECKPOINTS_DIR


def check_output_dir(output_dir, *, resume: bool, overwrite: bool) -> list[str]:
    """Refuse to start a fresh run on top of a previous one (pure: reads the directory only).

    A fresh run (no `resume`) into a non-empty directory would mix its metrics, TensorBoard events
    and checkpoints with the old run's (and `keep_last` would then prune by step number across both
    runs); it needs `overwrite`. Also refuses `resume` with `overwrite`, an output_dir that is a
    file, and one that cannot be created. Returns the names found in the directory.
    """
    path = Path(output_dir)
    if resume and overwrite:
        raise OutputDirectoryError("--resume continues the run in trainer.output_dir and --overwrite deletes it: give one")
    if path.exists() and not path.is_dir():
        raise OutputDirectoryError(f"'trainer.output_dir'={path} is a file, not a directory: choose another trainer.output_dir")
    entries = sorted(p.name for p in path.iterdir()) if path.is_dir() else []
    if entries and not resume and not overwrite:
        shown = ", ".join(entries[:6]) + (f", ... ({len(entries) - 6} more)" if len(entries) > 6 else "")
        raise OutputDirectoryError(
            f"'trainer.output_dir'={path} is not empty ({shown}): a new run there would mix with the previous one. "
            "Continue that run with --resume, replace it with --overwrite (deletes its checkpoints, metrics and "
            "TensorBoard logs), or set trainer.output_dir to another directory"
        )
    existing = path
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not path.exists() and not os.access(existing, os.W_OK | os.X_OK):
        raise OutputDirectoryError(
            f"'trainer.output_dir'={path} cannot be created ({existing} is not writable): set trainer.output_dir "
            "to a directory you can write (the GPU recipes use $SCRATCH)"
        )
    return entries


def clear_previous_run(output_dir) -> list[str]:
    """`--overwrite`: delete what an earlier run wrote under `output_dir` (checkpoints, metrics,
    TensorBoard and W&B files, plot, resolved config); other files stay. Returns the names removed."""
    path = Path(output_dir)
    removed = []
    for name in (*_RUN_DIRS, *_RUN_FILES):
        target = path / name
        if target.is_dir() and not target.is_symlink():
            shutil.rmtree(target)
        elif target.exists() or target.is_symlink():
            target.unlink()
        else:
            continue
        removed.append(name)
    return removed


def write_resolved_config(cfg: Config, output_dir: Path) -> Path:
    """`output_dir/config.yaml`: the configuration this run resolved (call it on the logging rank)."""
    path = Path(output_dir) / RESOLVED_CONFIG_FILE
    atomic_write_text(path, OmegaConf.to_yaml(OmegaConf.create(config_to_dict(cfg))))
    return path


def open_metrics_logger(cfg: Config, output_dir: Path, *, enabled: bool, resume_step: Optional[int]) -> MetricsLogger:
    """The run's `MetricsLogger` (`trainer.loggers`); writes only where `enabled` (the logging rank).

    `resume_step`: the checkpoint's step (later lines of an interrupted attempt are dropped). A fresh
    record (None) first removes the metrics and TensorBoard events of an earlier attempt that left
    no checkpoint (`--resume` with nothing to resume from): they would mix with this run's."""
    t = cfg.trainer
    if enabled and resume_step is None:
        (Path(output_dir) / METRICS_FILE).unlink(missing_ok=True)
        shutil.rmtree(Path(output_dir) / TENSORBOARD_DIR, ignore_errors=True)
    return MetricsLogger(
        output_dir, t.loggers, experiment_name=t.experiment_name, config=config_to_dict(cfg), enabled=enabled,
        resume_step=resume_step,
    )  # fmt: skip


def metrics_file_state(output_dir: Path) -> Optional[tuple[int, int]]:
    """(size, modification time in ns) of the run's `metrics.jsonl`, None without one: equal
    states mean nothing was logged in between (every line is flushed as it is logged)."""
    try:
        stat = (Path(output_dir) / METRICS_FILE).stat()
    except FileNotFoundError:
        return None
    return stat.st_size, stat.st_mtime_ns


def plot_run(cfg: Config, output_dir: Path, say: Callable[[str], None] = print) -> Optional[Path]:
    """Redraw `plot.png` from `metrics.jsonl` (call it on the logging rank); None without metrics or matplotlib."""
    metrics_file = Path(output_dir) / METRICS_FILE
    if not metrics_file.exists():
        return None
    try:
        return plot_metrics(metrics_file, Path(output_dir) / PLOT_FILE, title=cfg.trainer.experiment_name)
    except ImportError as error:  # matplotlib is an optional extra
        say(f"plot skipped: {error}")
        return None
