"""The two kinds of failure a command reports in one line instead of a traceback.

Every command runs under one handler (`megatron_dapo.cli.main.run_command`), which maps:
- `InputError`: what the user gave is wrong (a config key or value, a flag, a data file, a path, a
  model the tables do not know, a layout that does not divide) -> "megatron-dapo: error: ...", exit 2;
- `StopError`: the run cannot go on for a reason the user can act on (the disk is full, dynamic
  sampling ran dry, no intact checkpoint, a library outside its tested range) -> the same prefix, exit 1;
- anything else is a bug: Python's traceback, exit 1.

Both are mixins, so a library error keeps the built-in base its callers catch
(`class ConfigError(InputError, ValueError)`, `class DiskFullError(StopError, OSError)`).
This module imports nothing, so library code can use it without slowing `--help`.
"""

from __future__ import annotations

EXIT_FAILURE = 1
"""A runtime failure: a `StopError`, or an unexpected exception (with its traceback)."""
EXIT_USAGE = 2
"""Bad input: an `InputError`, a missing file named on the command line, argparse's own errors."""


class InputError(Exception):
    """What the user gave is wrong; the message says what to change. Exit code 2."""


class StopError(Exception):
    """The run cannot go on for a reason the user can act on; the message says what to do. Exit code 1."""


class ConfigError(InputError, ValueError):
    """A configuration problem, reported before anything expensive starts (exit code 2). Here rather
    than in config.py so that modules below the config (data, model, checkpoint, plan) can raise it
    without importing the schema; `megatron_dapo.config.ConfigError` is the same class."""


def exit_code(error: BaseException) -> int | None:
    """The exit code a command returns for `error`, or None when it is a bug (show the traceback).

    A `StopError` wins over `InputError` and `FileNotFoundError` (a damaged checkpoint is both a
    missing file and a reason to stop); a missing file named by the user is bad input."""
    if isinstance(error, StopError):
        return EXIT_FAILURE
    if isinstance(error, (InputError, FileNotFoundError)):
        return EXIT_USAGE
    return None


def describe(error: BaseException) -> str:
    """One line for the user: the message, or for an OSError without one its strerror and path."""
    if isinstance(error, OSError) and error.strerror:  # not "[Errno 28] ..."
        return error.strerror + (f": {error.filename}" if error.filename and str(error.filename) not in error.strerror else "")
    return str(error)
