"""The errors of checkpointing, in a module of their own: `core` and `optimizer_state` (which
`core` imports for the optimizer formats) both raise them."""

from megatron_dapo.errors import StopError

__all__ = ["CheckpointCorruptError", "CheckpointError", "NoIntactCheckpointError", "UnsafeCheckpointError"]


class CheckpointError(StopError, RuntimeError):
    """A save or load step failed (on this rank or another one)."""


class CheckpointCorruptError(CheckpointError, FileNotFoundError):
    """A checkpoint's files are missing, cut short or differ from their checksums.

    Also a FileNotFoundError (no usable checkpoint where one was named), which the command line
    reports in one line."""


class NoIntactCheckpointError(CheckpointCorruptError):
    """Resuming found checkpoints, but every one of them is damaged (the message lists why)."""


class UnsafeCheckpointError(CheckpointError):
    """A checkpoint file would run code when loaded (a pickle that is not data): refused unread.

    Not a CheckpointCorruptError: `--resume` does not quietly fall back past it; someone wrote into
    the checkpoint directory, and the user must look."""
