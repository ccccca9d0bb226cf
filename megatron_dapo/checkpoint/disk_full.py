"""A full disk: one message instead of every writer's traceback.

A run (metrics, checkpoints, the plot) or a conversion that fills its disk breaks several writers
at once, on several threads and ranks; `stop_on_full_disk` turns any failure whose chain holds a
no-space error into one `DiskFullError` naming the directory, the free space and what to do.
It lives beside the checkpoint writers because they are the largest writes; the trainer and the
conversion both use it.
"""

from __future__ import annotations

import errno
import os
import shutil
from contextlib import contextmanager
from pathlib import Path
from typing import Optional

from megatron_dapo.errors import StopError

_NO_SPACE_ERRNOS = (errno.ENOSPC, errno.EDQUOT)
# PyTorch's zip writer (torch.save) reports a short write as "[enforce fail at inline_container.cc:...]
# unexpected pos N vs M" and loses the errno: a full disk or a quota.
_SHORT_WRITE_MARKERS = ("unexpected pos",)


class DiskFullError(StopError, OSError):
    """Writing the run's output failed for lack of space (ENOSPC, a quota, PyTorch's short write)."""


def _exception_chain(error: BaseException) -> list[BaseException]:
    """`error`, its causes and contexts, and the per-rank errors a torch.distributed.checkpoint
    `CheckpointException` carries (its `failures`: rank -> exception or (exception, traceback))."""
    seen: list[BaseException] = []
    pending = [error]
    while pending:
        current = pending.pop()
        if current is None or any(current is s for s in seen):
            continue
        seen.append(current)
        pending += [current.__cause__, current.__context__]
        failures = getattr(current, "failures", None)
        if isinstance(failures, dict):
            for value in failures.values():
                pending.append(value[0] if isinstance(value, tuple) and value else value)
    return [e for e in seen if isinstance(e, BaseException)]


def _free_bytes(directory: Path) -> Optional[int]:
    for candidate in (directory, *directory.parents):
        try:
            return shutil.disk_usage(candidate).free
        except OSError:
            continue
    return None


RESUME_ADVICE = "then continue with --resume: it starts from the last complete checkpoint (an interrupted save is never used)"


def disk_full_error(
    error: BaseException, output_dir: os.PathLike | str, key: str = "trainer.output_dir", then: str = RESUME_ADVICE
) -> Optional[DiskFullError]:
    """A `DiskFullError` saying what to do when `error` (or anything it carries) is a write that
    failed for lack of space under `output_dir`, else None.

    Looks for ENOSPC / EDQUOT anywhere in the chain (the metrics file, a checkpoint writer on another
    thread, the plot) and for PyTorch's short-write error: the first failure and everything it broke
    on the way out are one problem."""
    directory = Path(output_dir)
    chain = _exception_chain(error)
    no_space = next((e for e in chain if isinstance(e, OSError) and e.errno in _NO_SPACE_ERRNOS), None)
    if no_space is None and not any(marker in str(e) for e in chain for marker in _SHORT_WRITE_MARKERS):
        return None
    free = _free_bytes(directory)
    what = "no space left" if no_space is None or no_space.errno == errno.ENOSPC else "disk quota exceeded"
    where = f" (writing {no_space.filename})" if no_space is not None and no_space.filename else ""
    left = "" if free is None else f"; {free / 2**20:.1f} MiB free now"
    return DiskFullError(
        errno.ENOSPC,
        f"{what} on the disk of {key}={directory}{where}{left}. Free some space or set "
        f"{key} to a larger disk (moving the directory there), {then}",
    )


@contextmanager
def stop_on_full_disk(output_dir: os.PathLike | str, key: str = "trainer.output_dir", then: str = RESUME_ADVICE):
    """Turn a failure caused by a full disk under `output_dir` (the config's `key`) into one
    `DiskFullError` (see `disk_full_error`) whose advice ends with `then`; any other error passes unchanged."""
    try:
        yield
    except (KeyboardInterrupt, SystemExit, GeneratorExit):
        raise
    except BaseException as error:  # torch.distributed.checkpoint's CheckpointException is a BaseException
        full = disk_full_error(error, output_dir, key, then)
        if full is None:
            raise
        raise full from None
