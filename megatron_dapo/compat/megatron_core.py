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
- Notices a user cannot act on (`QUIET_NOTICES`, silenced by `quiet_known_notices` at every
  command's start; PYTHONWARNINGS or a logging configuration of your own shows them): 0.19 logs that
  GPTModel is deprecated for HybridModel (GPTModel is unchanged and still what the package builds;
  moving to HybridModel is due before a release removes it), that DDP computes the parameter layout
  itself when none is passed (what every earlier release did), and warns that its multi-modal
  MimoModelConfig is experimental (imported with megatron.core, never used here). PyPI's CUDA build of
  torch, on a machine without the CUDA runtime (a CPU machine on Python 3.12), logs "No CUDA runtime is
  found" when torch.utils.cpp_extension is imported.
- `RouterGatingLinearFunction` named `te_general_gemm` without defining it when Transformer Engine
  is missing up to 0.18 (a NameError in every MoE router on CPU); 0.19 defines it.
  `distributed/cpu_compat.py` defines it where it is missing.
"""

from __future__ import annotations

import io
import logging
import re
import warnings
from functools import lru_cache
from pathlib import Path
from typing import Any, Optional

__all__ = [
    "COMMON_STATE_FILE",
    "COMMON_STATE_KEY",
    "COMMON_STATE_IN_CHECKPOINT_FROM",
    "common_state_in_checkpoint",
    "installed_release",
    "QUIET_NOTICES",
    "quiet_known_notices",
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
    import torch  # here, not at the top: the CLI imports this module before torch (quiet_known_notices)
    if common_state_in_checkpoint(release):
        from megatron.core.dist_checkpointing.mapping import ShardedObject

        buffer = io.BytesIO()
        torch.save([common], buffer)
        buffer.seek(0)
        dcp_state[ShardedObject(COMMON_STATE_KEY, None, (1,), (0,)).unique_key] = buffer
    else:
        torch.save(common, Path(dist_dir) / COMMON_STATE_FILE)


QUIET_NOTICES: tuple[tuple[str, str], ...] = (
    # (logger name, or "warnings" for a Python warning; regex of the message's start)
    ("megatron.core.models.gpt.gpt_model", r"GPTModel IS DEPRECATED\."),
    ("megatron.core.distributed.distributed_data_parallel", r"DistributedDataParallel: full_param_layout not provided"),
    ("warnings", r"MimoModelConfig is experimental"),
    ("torch.utils.cpp_extension", r"No CUDA runtime is found"),
)
"""Notices of the supported releases that say nothing a user can act on (see the module docstring)."""


class _DropMessages(logging.Filter):
    def __init__(self, patterns: list[str]):
        super().__init__()
        self.patterns = [re.compile(p) for p in patterns]

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not any(p.match(message) for p in self.patterns)


def quiet_known_notices() -> None:
    """Silence `QUIET_NOTICES` in this process; call it before torch and Megatron are imported (the
    loggers are created here if their modules are not imported yet). Idempotent."""
    by_logger: dict[str, list[str]] = {}
    for name, pattern in QUIET_NOTICES:
        if name == "warnings":
            warnings.filterwarnings("ignore", message=pattern, category=UserWarning)
        else:
            by_logger.setdefault(name, []).append(pattern)
    for name, patterns in by_logger.items():
        logger = logging.getLogger(name)
        if not any(isinstance(f, _DropMessages) for f in logger.filters):
            logger.addFilter(_DropMessages(patterns))
