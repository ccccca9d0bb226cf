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
import signal
import sys
import threading

from megatron_dapo.cli.main import rank_suffix

EXIT_SIGTERM = 143  # 128 + SIGTERM, also the trainer's exit code after a preemption checkpoint


class StoppedOutsideTraining(SystemExit):
    """SIGTERM while no training loop was there to checkpoint (start-up, shut-down): exit 143.

    A SystemExit, so that library code catching `Exception` while loading does not swallow it."""

    def __init__(self) -> None:
        super().__init__(EXIT_SIGTERM)


def _raise_stopped(signum, frame) -> None:
    raise StoppedOutsideTraining()


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
    (a `config.ConfigError` otherwise: one line and exit code 2)."""
    from megatron_dapo.errors import ConfigError

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
    parser.add_argument(
        "--overwrite", action="store_true",
        help="start afresh in a trainer.output_dir that holds a previous run: delete its checkpoints, metrics and "
        "TensorBoard logs first (without --resume or --overwrite a non-empty output directory is refused)",
    )  # fmt: skip


def guarded(fn) -> int:
    """Run the job `fn` (every rank); 0 when it returns. SIGTERM outside a training loop (which
    installs its own handler, see `trainer.loop.DAPOTrainer.fit`): one line and exit code 143,
    instead of the signal's default action. Errors pass on to the one handler (`cli.main.run_command`)."""
    main_thread = threading.current_thread() is threading.main_thread()  # signal handlers live there only
    previous = signal.signal(signal.SIGTERM, _raise_stopped) if main_thread else None
    try:
        fn()
        return 0
    except StoppedOutsideTraining:
        if main_thread:
            signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a second SIGTERM must not cut the clean-up short
        _close_process_groups()
        print(f"megatron-dapo: stopped by SIGTERM{rank_suffix()} outside the training loop (start-up or shut-down): "
              f"no checkpoint written; exit code {EXIT_SIGTERM}", file=sys.stderr, flush=True)  # fmt: skip
        return EXIT_SIGTERM
    finally:
        if main_thread:
            signal.signal(signal.SIGTERM, previous)


def _close_process_groups() -> None:
    """Best effort: leave no process group alive at exit (the job is stopping; errors do not matter)."""
    if "torch.distributed" not in sys.modules:
        return
    try:
        from megatron_dapo.distributed.setup import teardown

        teardown()
    except Exception:  # noqa: BLE001 - e.g. interrupted half-way through importing Megatron
        pass


def run(args: argparse.Namespace) -> int:
    from megatron_dapo.config import load_config
    from megatron_dapo.checkpoint.disk_full import stop_on_full_disk
    from megatron_dapo.trainer.startup import launch_world_size, preflight

    def job() -> None:
        resolve_config_argument(args)
        cfg = load_config(args.config, args.overrides)
        # Every check that needs no model runs before the trainer is imported: it loads torch,
        # Megatron and transformers (~10 s on a laptop), which a refused config never needs.
        layout_text = preflight(cfg, launch_world_size(), resume=args.resume, overwrite=args.overwrite)
        from megatron_dapo.trainer.loop import train

        with stop_on_full_disk(cfg.trainer.output_dir):
            train(cfg, resume=args.resume, overwrite=args.overwrite, layout_text=layout_text)

    return guarded(job)

