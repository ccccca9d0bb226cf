"""What the job commands (train, sft, demo) share: the config arguments and the SIGTERM guard."""

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


def add_config_arguments(parser: argparse.ArgumentParser) -> None:
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
