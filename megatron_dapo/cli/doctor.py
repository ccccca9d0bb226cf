"""`megatron-dapo doctor`: check the machines of a job before it queues, in under a minute.

    megatron-dapo doctor --config configs/dapo_qwen2.5_32b.yaml                     # this machine
    megatron-dapo doctor --config configs/dapo_qwen2.5_32b.yaml --world-size 32     # its layout for 32 GPUs
    srun --ntasks-per-node=8 megatron-dapo doctor --config configs/dapo_qwen2.5_32b.yaml   # every node
    torchrun --nproc_per_node 2 -m megatron_dapo.cli doctor --config configs/tiny_cpu.yaml

What it checks and how: `megatron_dapo.doctor.preflight`. Exit status: 0 nothing failed (warnings
allowed), 1 a check failed (the same on every rank: a result, not an error), 2 bad arguments.
"""

from __future__ import annotations

import argparse
import textwrap

from megatron_dapo.cli.main import check_flags, sort_trailing_options

DESCRIPTION = (
    "Check this machine (or, under srun / torchrun, every machine of the job) before a job queues: "
    "config layout vs world size, torch/CUDA/NCCL, GPUs per task, GPU memory vs the memory plan, "
    "Transformer Engine and flash attention, vLLM / SGLang / Megatron-Core versions and APIs, /dev/shm, "
    "locked-memory limit and host RAM vs the pinned memory offload takes, free disk at trainer.output_dir, "
    "GLOO/NCCL socket interfaces, and (world > 1) a gloo and NCCL all-reduce across all ranks with its "
    "bandwidth. Prints one table (rank 0); takes under a minute."
)

EPILOG = """\
examples:
  megatron-dapo doctor --config configs/dapo_qwen2.5_7b.yaml                 # this node, world of 1
  megatron-dapo doctor --config configs/dapo_qwen2.5_32b.yaml --world-size 32
  srun --nodes=4 --ntasks-per-node=8 --gpus-per-node=8 megatron-dapo doctor --config configs/dapo_qwen2.5_32b.yaml
  torchrun --nproc_per_node 2 -m megatron_dapo.cli doctor --config configs/tiny_cpu.yaml

status: pass; warn (runs, but slower or at risk: read the line); FAIL (the job would fail: fix it
first); skip (does not apply here, e.g. GPU checks on a CPU machine).
exit status: 0 no check failed (warnings allowed), 1 a check failed (every rank exits 1), 2 bad arguments.
MEGATRON_DAPO_UNTESTED_VERSIONS=1 turns an engine version outside its tested range into a warning.
"""


def _add_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", default=None, help="YAML config of the job (or give it first among the overrides; default: built-in defaults)")
    parser.add_argument(
        "--world-size",
        type=int,
        default=None,
        help="check the layout and memory plan for this many processes (default: the processes launched)",
    )
    parser.add_argument(
        "--model",
        default=None,
        type=str.lower,
        help="a built-in model shape for the memory plan when model.hf_dir is not here (see megatron-dapo plan --help)",
    )
    parser.add_argument(
        "--timeout-s",
        type=float,
        default=180.0,
        help="how long a rank waits for the others to arrive, and for each collective (default 180: ranks "
        "reach the meeting after their own checks, which take longer on a busy shared file system)",
    )
    parser.add_argument("--bandwidth-mib", type=int, default=16, help="MiB all-reduced per timed round (default 16)")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options may come before or after the overrides (`doctor --config F key=value --world-size 8`)."""
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.description = textwrap.fill(DESCRIPTION, 100)
    parser.epilog = EPILOG
    _add_options(parser)
    parser.add_argument(
        "overrides",
        nargs=argparse.REMAINDER,
        help="dotted overrides as for train, e.g. parallel.tp=2 trainer.output_dir=/scratch/run",
    )



def run(args: argparse.Namespace) -> int:
    args = sort_trailing_options(args, _add_options, "megatron-dapo doctor")
    check_flags(args, at_least={"world_size": 1, "bandwidth_mib": 1}, above={"timeout_s": 0})
    config, overrides = args.config, list(args.overrides)
    if config is None and overrides and "=" not in overrides[0]:
        config, overrides = overrides[0], overrides[1:]  # `doctor FILE key=value`, as plan takes it

    from megatron_dapo.doctor.preflight import DoctorOptions, run_doctor

    return run_doctor(DoctorOptions(config, tuple(overrides), args.world_size, args.model, args.timeout_s, args.bandwidth_mib))
