"""`megatron-dapo train` and `megatron-dapo sft`: the jobs, on every rank (torchrun, srun or alone).

    megatron-dapo train configs/tiny_cpu.yaml [--resume] [key=value ...]     (or --config configs/tiny_cpu.yaml)
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
    parser.add_argument(
        "--config", default=None,
        help="YAML config (e.g. configs/tiny_cpu.yaml); may also be given as the first positional argument, "
        "as with `megatron-dapo config` and `plan`",
    )  # fmt: skip
    parser.add_argument(
        "overrides", nargs="*", metavar="[CONFIG] KEY=VALUE",
        help="the config file (unless --config names it), then dotted overrides, e.g. trainer.total_steps=5 parallel.tp=2",
    )  # fmt: skip


def resolve_config_argument(args: argparse.Namespace) -> None:
    """Accept `train CONFIG k=v ...` as well as `train --config CONFIG k=v ...`: a first positional
    argument that is not a dotted override is the config file. Exactly one config must be given
    (a `config.ConfigError` otherwise, which `guarded` turns into one line and exit code 2)."""
    from megatron_dapo.config import ConfigError

    positional = list(args.overrides)
    if positional and "=" not in positional[0]:
        if args.config is not None:
            raise ConfigError(f"two config files: --config {args.config} and {positional[0]!r} (give one)")
        args.config = positional.pop(0)
    if args.config is None:
        raise ConfigError("no config file: give one, e.g. `megatron-dapo train configs/tiny_cpu.yaml` (or --config FILE)")
    for item in positional:
        if "=" not in item:
            raise ConfigError(f"{item!r} is not a KEY=VALUE override (only the first positional argument may be the config file)")
    args.overrides = positional


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
    from megatron_dapo.runtime import DiskFullError

    try:
        fn()
    except (ConfigError, DatasetError, FileNotFoundError) as error:
        print(f"megatron-dapo: error: {error}", file=sys.stderr)
        return 2
    except DynamicSamplingExhausted as error:  # the data, not the program: say what to change
        print(f"megatron-dapo: stopped: {error}", file=sys.stderr)
        return 1
    except DiskFullError as error:  # `runtime.stop_on_full_disk`: the first write that failed, and what to do
        print(f"megatron-dapo: stopped: {error.strerror}", file=sys.stderr)
        return 1
    return 0


def run(args: argparse.Namespace) -> int:
    from megatron_dapo.config import load_config
    from megatron_dapo.runtime import stop_on_full_disk
    from megatron_dapo.trainer import train

    def job() -> None:
        resolve_config_argument(args)
        cfg = load_config(args.config, args.overrides)
        with stop_on_full_disk(cfg.trainer.output_dir):
            train(cfg, resume=args.resume)

    return guarded(job)

