"""`megatron-dapo train` and `megatron-dapo sft`: the jobs, on every rank (torchrun, srun or alone).

    megatron-dapo train --config configs/tiny_cpu.yaml [--resume] [key=value ...]
    torchrun --nproc_per_node 2 -m megatron_dapo.cli train --config configs/tiny_cpu.yaml parallel.tp=2
    srun python -m megatron_dapo.cli train --config configs/dapo_qwen2.5_7b.yaml --resume   (see slurm/)

A run writes under `trainer.output_dir`: metrics.jsonl, tensorboard/, checkpoints/step_N (atomic,
`checkpoints/latest`), plot.png and the resolved config.yaml. `--resume` continues from the latest
checkpoint there (same data order and generation seeds, so the steps equal an uninterrupted run's),
or starts from step 0 when there is none, so that a requeued SLURM job can always pass it. SIGTERM
(SLURM preemption) finishes the step, writes a checkpoint and exits with code 143.
"""

from __future__ import annotations

import argparse
import sys


def add_common_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", required=True, help="YAML config (e.g. configs/tiny_cpu.yaml)")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. trainer.total_steps=5 parallel.tp=2")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.epilog = __doc__
    add_common_arguments(parser)
    parser.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in trainer.output_dir (if any)")


def guarded(fn) -> int:
    """Configuration and data errors: one clear line and exit code 2 (1 when dynamic sampling runs
    dry), not a traceback."""
    from megatron_dapo.config import ConfigError
    from megatron_dapo.data.dataset import DatasetError

    from megatron_dapo.algorithm.sampling import DynamicSamplingExhausted

    try:
        fn()
    except (ConfigError, DatasetError, FileNotFoundError) as error:
        print(f"megatron-dapo: error: {error}", file=sys.stderr)
        return 2
    except DynamicSamplingExhausted as error:  # the data, not the program: say what to change
        print(f"megatron-dapo: stopped: {error}", file=sys.stderr)
        return 1
    return 0


def run(args: argparse.Namespace) -> int:
    from megatron_dapo.config import load_config
    from megatron_dapo.trainer import train

    return guarded(lambda: train(load_config(args.config, args.overrides), resume=args.resume))

