"""Process groups (TP/PP/CP/DP) and the CPU compatibility layer for Megatron-Core.

`layout` is pure Python; `setup.init_distributed` enables the CPU layer (on CUDA-less machines)
before Megatron is first imported, so import Megatron after calling it.
"""

from megatron_dapo.distributed.cpu_compat import cpu_compat_enabled, enable_cpu_compat
from megatron_dapo.distributed.layout import ParallelLayout
from megatron_dapo.distributed.setup import (
    DistributedContext,
    LaunchEnv,
    init_distributed,
    parse_slurm_hostlist,
    resolve_launch_env,
    teardown,
)

__all__ = [
    "DistributedContext",
    "LaunchEnv",
    "ParallelLayout",
    "cpu_compat_enabled",
    "enable_cpu_compat",
    "init_distributed",
    "parse_slurm_hostlist",
    "resolve_launch_env",
    "teardown",
]
