"""Process groups (TP/PP/CP/DP) and the CPU compatibility layer for Megatron-Core.

`layout` is pure Python; `setup.init_distributed` enables the CPU layer (on CUDA-less machines)
before Megatron is first imported, so import Megatron after calling it.

The names below resolve on first use: `config.py` applies the layout rules when a config loads,
and that must not import torch (`setup` does).
"""

from importlib import import_module
from typing import Any

_HOMES = {
    "DistributedContext": "setup",
    "LaunchEnv": "setup",
    "ParallelLayout": "layout",
    "cpu_compat_enabled": "cpu_compat",
    "enable_cpu_compat": "cpu_compat",
    "init_distributed": "setup",
    "parse_slurm_hostlist": "setup",
    "resolve_launch_env": "setup",
    "teardown": "setup",
}

__all__ = sorted(_HOMES)


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(import_module(f"{__name__}.{home}"), name)
