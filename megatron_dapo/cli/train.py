"""`megatron-dapo train`: the DAPO job, on every rank (torchrun, srun or alone).

    megatron-dapo train configs/tiny_cpu.yaml [--resume] [key=value ...]     (or --config configs/tiny_cpu.yaml)
    torchrun --nproc_per_node 2 -m megatron_dapo.cli train --config configs/tiny_cpu.yaml parallel.tp=2
    srun python -m megatron_dapo.cli train --config configs/dapo_qwen2.5_7b.yaml --resume   (see slurm/)

A run writes under `trainer.output_dir`: metrics.jsonl, tensorboard/, checkpoints/step_N (atomic,
`checkpoints/latest`), plot.png and the resolved config.yaml. `--resume` continues from the latest
intact checkpoint there (same data order and generation seeds, so the steps equal an uninterrupted
run's; damaged checkpoints are skipped and named), or starts from step 0 when there is none, so that
a requeued SLURM job can always pass it. A run without --resume refuses a non-empty output
directory; `--overwrite` deletes the previous run's checkpoints, metrics and TensorBoard logs there
first.

SIGTERM (SLURM preemption, a time limit) ends the job with exit code 143:
- during generation or before the update: after the current generation batch, a checkpoint of the
  state at the step's start (the step is redone, with the same prompts and seeds, on --resume);
- during or after the update: the step is finished and checkpointed;
- during start-up (loading the model, starting the engine) or shut-down: at once, with one line,
  and no checkpoint (nothing was trained since the last one).
"""

from __future__ import annotations

import argparse

from megatron_dapo.cli.job import add_config_arguments, guarded, resolve_config_argument


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.epilog = __doc__
    add_config_arguments(parser)
    parser.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in trainer.output_dir (if any)")
    parser.add_argument(
        "--overwrite", action="store_true",
        help="start afresh in a trainer.output_dir that holds a previous run: delete its checkpoints, metrics and "
        "TensorBoard logs first (without --resume or --overwrite a non-empty output directory is refused)",
    )  # fmt: skip


def run(args: argparse.Namespace) -> int:
    from megatron_dapo.config import load_config
    from megatron_dapo.checkpoint.disk_full import stop_on_full_disk
    from megatron_dapo.trainer.startup import launch_world_size, preflight

    def job() -> None:
        resolve_config_argument(args)
        cfg = load_config(args.config, args.overrides)
        # Every check that needs no model runs before the trainer is imported: it loads torch,
        # Megatron and transformers (~10 s on a laptop), which a refused config never needs.
        layout = preflight(cfg, launch_world_size(), resume=args.resume, overwrite=args.overwrite)
        from megatron_dapo.trainer.loop import train

        with stop_on_full_disk(cfg.trainer.output_dir):
            train(cfg, resume=args.resume, overwrite=args.overwrite, layout=layout)

    return guarded(job)

