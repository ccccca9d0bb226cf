"""What differs between the Megatron-Core releases megatron-dapo supports, in one place.

The package calls these functions wherever the releases disagree, so that no other module reads
Megatron's version or catches an ImportError to find out. Each function says which releases do
what; `megatron_dapo/compat/versions.py` holds the tested range and the API probes, and
tests/compat/test_megatron_core.py runs each function against the installed release (CI runs it on
0.16.1 and 0.19.2; `make test-megatron-range` on 0.17.1 and 0.18.2 too).

Differences the package meets (read in each release's source; the tests run them):
- Common state of a torch_dist checkpoint (the non-tensor part: scheduler values, plain objects).
  0.16 to 0.18 keep it in `common.pt` beside the DCP files and cannot load a checkpoint without
  that file; 0.19 stores it inside the DCP files as the ShardedObject "common_state" and still
  reads a `common.pt` it finds (its "legacy" format). The HF -> Megatron conversion writes the
  checkpoint itself, so it writes the common state the way the installed release would.
- `megatron.core.utils.get_batch_on_this_cp_rank` took `(batch, cp_group)` up to 0.17 and
  `(batch, is_hybrid_cp, cp_group, ...)` from 0.18 on. The package has its own CP split
  (`distributed/context_parallel.py`); only the test comparing the two calls Megatron's.
"""

from __future__ import annotations

import io
from functools import lru_cache
from pathlib import Path
from typing import Any, Optional

import torch

__all__ = [
    "COMMON_STATE_FILE",
    "COMMON_STATE_KEY",
    "COMMON_STATE_IN_CHECKPOINT_FROM",
    "common_state_in_checkpoint",
    "installed_release",
    "store_common_state",
]

COMMON_STATE_FILE = "common.pt"
"""Where releases before 0.19 keep a checkpoint's common state (Megatron's COMMON_STATE_FNAME)."""
COMMON_STATE_KEY = "common_state"
"""The ShardedObject key under which 0.19+ keeps it inside the DCP files."""
COMMON_STATE_IN_CHECKPOINT_FROM = (0, 19)
"""The first release that stores the common state inside the DCP files."""


@lru_cache(maxsize=None)
def installed_release() -> tuple[int, ...]:
    """The installed Megatron-Core release as numbers: "0.19.2" -> (0, 19, 2)."""
    from megatron.core.package_info import __version__

    from megatron_dapo.compat.versions import release

    return release(__version__)


def common_state_in_checkpoint(release: Optional[tuple[int, ...]] = None) -> bool:
    """Whether `release` (default: the installed one) keeps the common state inside the DCP files."""
    return (release or installed_release()) >= COMMON_STATE_IN_CHECKPOINT_FROM


def store_common_state(
    common: dict[str, Any], dist_dir: Path, dcp_state: dict[str, Any], release: Optional[tuple[int, ...]] = None
) -> None:
    """Store a checkpoint's common state as `release` (default: the installed one) writes it.

    0.19+: a pickled one-element list under the "common_state" ShardedObject's key in `dcp_state`
    (the DCP entries about to be written; Megatron stores every ShardedObject that way and its
    loader unpickles it with weights_only=True). Earlier: `dist_dir/common.pt`, written now.
    """
    if common_state_in_checkpoint(release):
        from megatron.core.dist_checkpointing.mapping import ShardedObject

        buffer = io.BytesIO()
        torch.save([common], buffer)
        buffer.seek(0)
        dcp_state[ShardedObject(COMMON_STATE_KEY, None, (1,), (0,)).unique_key] = buffer
    else:
        torch.save(common, Path(dist_dir) / COMMON_STATE_FILE)
