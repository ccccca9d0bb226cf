"""Atomic, resumable Megatron distributed checkpoints (see `core` for saving / loading, `layout` for disk).

    from megatron_dapo.checkpoint import save_checkpoint, load_checkpoint, find_latest

Importing this package does not import Megatron-Core (the save / load functions do, when called,
after `distributed.init_distributed`); `find_latest` and the other path helpers are pure Python.
"""

from megatron_dapo.checkpoint.layout import (
    CHECKPOINT_FORMAT,
    find_latest,
    is_complete_checkpoint,
    list_checkpoints,
    read_metadata,
    resolve_checkpoint_dir,
    step_dir_name,
)

__all__ = [
    "CHECKPOINT_FORMAT",
    "CheckpointCorruptError",
    "CheckpointError",
    "CheckpointLayoutError",
    "CheckpointMismatchError",
    "LoadedCheckpoint",
    "NoIntactCheckpointError",
    "UnsafeCheckpointError",
    "find_latest",
    "is_complete_checkpoint",
    "list_checkpoints",
    "load_checkpoint",
    "load_latest_checkpoint",
    "read_metadata",
    "resolve_checkpoint_dir",
    "save_checkpoint",
    "step_dir_name",
]


def __getattr__(name: str):
    # core imports torch and torch_dist imports Megatron: load them on first use only.
    if name in ("CheckpointCorruptError", "CheckpointError", "NoIntactCheckpointError", "UnsafeCheckpointError"):
        from megatron_dapo.checkpoint import errors

        return getattr(errors, name)
    if name in ("LoadedCheckpoint", "load_checkpoint", "load_latest_checkpoint", "save_checkpoint"):
        from megatron_dapo.checkpoint import core

        return getattr(core, name)
    if name in ("CheckpointLayoutError", "CheckpointMismatchError"):
        from megatron_dapo.checkpoint import torch_dist

        return getattr(torch_dist, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
