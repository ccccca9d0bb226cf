"""`megatron-dapo sft`: the supervised warm start, on every rank (torchrun, srun or alone).

    megatron-dapo sft configs/tiny_cpu.yaml [key=value ...]        (or --config configs/tiny_cpu.yaml)

Uses the config's `sft` section (train_files with a 'response' field, total_steps, batch_size, lr,
output_dir) and writes a Megatron checkpoint under `sft.output_dir/checkpoints` that a DAPO run
starts from with `model.megatron_checkpoint`. The library is `megatron_dapo.trainer.sft`. There is
no --resume: a warm start that stopped is run again.
"""

from __future__ import annotations

import argparse

from megatron_dapo.cli.job import add_config_arguments, guarded, resolve_config_argument


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.epilog = "Uses the config's `sft` section: train_files (with a 'response' field), total_steps, batch_size, lr, output_dir."
    add_config_arguments(parser)


def run(args: argparse.Namespace) -> int:
    from megatron_dapo.config import load_config
    from megatron_dapo.trainer.sft import run_sft
    from megatron_dapo.checkpoint.disk_full import stop_on_full_disk

    def job() -> None:
        resolve_config_argument(args)
        cfg = load_config(args.config, args.overrides)
        # One message, not a traceback per writer; the warm start has no --resume: it is run again.
        with stop_on_full_disk(cfg.sft.output_dir, key="sft.output_dir", then="then run the warm start again"):
            run_sft(cfg)

    return guarded(job)
