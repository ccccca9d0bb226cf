"""`megatron-dapo` command line: one entry point, one subcommand per job.

Each command is one module of this package exposing `add_arguments(parser)` and `run(args) -> int`,
and returns through `run_command`, the one error handler. The command modules import the library
inside `run` (this package is the only place with such lazy imports), so `--help` imports no torch
and an optional engine that is not installed never breaks an unrelated command.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import warnings
from typing import NoReturn

from megatron_dapo import errors
from megatron_dapo.compat.megatron_core import quiet_known_notices

# name -> (module, one-line help). Order is the order shown by --help.
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "demo": (
        "megatron_dapo.cli.demo",
        "the main job on a CPU: a tiny model learns arithmetic (workspace, SFT warm start, then DAPO)",
    ),
    "train": ("megatron_dapo.cli.train", "DAPO training (every rank; torchrun / srun / one process), --resume to continue"),
    "sft": ("megatron_dapo.cli.sft", "supervised warm start with the actor's update step (cross-entropy), the DAPO run's starting point"),
    "prepare-data": ("megatron_dapo.cli.prepare_data", "write the verl/DAPO dataset schema from a jsonl of {question, answer}"),
    "plan": ("megatron_dapo.cli.plan", "per-GPU memory plan of a config on a cluster shape, and the largest micro-batch token budget"),
    "doctor": ("megatron_dapo.cli.doctor", "pre-flight of this node or, under srun/torchrun, every node of a job: versions, GPUs, memory, disk, network"),
    "config": ("megatron_dapo.cli.config", "print the resolved configuration of a YAML file + overrides, or its error"),
    "convert": ("megatron_dapo.cli.convert", "convert checkpoints: hf-to-megatron (streaming, any TP/PP) or megatron-to-hf"),
    "check-sync": ("megatron_dapo.cli.check_sync", "check the actor -> rollout engine weight sync: bit-exact tensors, log-prob mismatch"),
    "smoke": ("megatron_dapo.cli.smoke", "one-command check of the GPU paths (doctor, check-sync dense/MoE, an r3 step, a weight push): one table"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="megatron-dapo",
        description="DAPO reinforcement learning on Megatron-Core. Run `megatron-dapo <command> --help` for details.",
    )
    commands = parser.add_subparsers(dest="command", metavar="<command>")
    for name, (module_name, help_text) in SUBCOMMANDS.items():
        sub = commands.add_parser(name, help=help_text, description=help_text)
        sub.set_defaults(_module=module_name)
        importlib.import_module(module_name).add_arguments(sub)
    return parser


def _quiet_known_warnings() -> None:
    """torch.distributed and Megatron-Core deprecation notices about APIs they call themselves: not
    the user's concern, and they bury the training table (PYTHONWARNINGS=default shows them)."""
    if not sys.warnoptions:
        quiet_known_notices()
        for module in (r"torch\.distributed", r"megatron", r"megatron_dapo\.distributed\.cpu_compat"):
            warnings.filterwarnings("ignore", category=FutureWarning, module=module)
            warnings.filterwarnings("ignore", category=DeprecationWarning, module=module)
        # Megatron-Core's import-time notices that Transformer Engine / apex are missing (six on every CPU
        # start): the start-up line of model/gpu_kernels.py names the layer implementation and the reason.
        for message in MISSING_KERNEL_WARNINGS:
            warnings.filterwarnings("ignore", message=message, category=UserWarning, module=r"megatron\.core")


MISSING_KERNEL_WARNINGS = (
    r"Transformer Engine and Apex are not installed\. Falling back to ",
    r"Apex is not installed\. Falling back to Torch Norm",
)
"""Start of the messages megatron-core 0.16.1 warns with when TE / apex are missing (regexes)."""


def _is_override(item: str) -> bool:
    """A dotted KEY=VALUE override (not an option, not a stray word)."""
    return not item.startswith("-") and "=" in item


def main(argv: list[str] | None = None) -> int:
    _quiet_known_warnings()
    parser = build_parser()
    args, extra = parser.parse_known_args(sys.argv[1:] if argv is None else argv)
    if not getattr(args, "_module", None):
        parser.print_help()
        return 2
    # `train CONFIG --resume k=v`: argparse stops filling the `overrides` positional at the first
    # option, so overrides after an option come back unparsed. They are overrides all the same.
    unknown = [item for item in extra if not (isinstance(getattr(args, "overrides", None), list) and _is_override(item))]
    if unknown:
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    if extra:
        args.overrides = [*args.overrides, *extra]
    return run_command(importlib.import_module(args._module).run, args)


def run_command(run, args: argparse.Namespace) -> int:
    """Run one command under the one error handler every command shares (`megatron_dapo.errors`):
    bad input -> "megatron-dapo: error: ..." and exit 2, a reason to stop -> the same prefix and
    exit 1, anything else -> the traceback (a bug). Multi-rank runs name the rank that failed."""
    try:
        return int(run(args) or 0)
    except Exception as error:
        code = errors.exit_code(error)
        if code is None:
            raise
        print(f"megatron-dapo: error{rank_suffix()}: {errors.describe(error)}", file=sys.stderr, flush=True)
        return code


def check_flags(args: argparse.Namespace, at_least: dict[str, float] | None = None, above: dict[str, float] | None = None) -> None:
    """The one check of numeric flags every command uses: `at_least` {dest: minimum}, `above`
    {dest: exclusive bound}; a flag left at None is not checked. One InputError (exit 2) names every
    flag out of bounds, its value and the bound."""
    bad = []
    for bounds, sign, fails in ((at_least or {}, ">=", lambda v, b: v < b), (above or {}, ">", lambda v, b: v <= b)):
        for dest, bound in bounds.items():
            value = getattr(args, dest)
            if value is not None and fails(value, bound):
                bad.append(f"--{dest.replace('_', '-')} must be {sign} {bound:g}, got {value:g}")
    if bad:
        raise errors.InputError("; ".join(bad))


def sort_trailing_options(args: argparse.Namespace, add_options, prog: str) -> argparse.Namespace:
    """Options that followed a positional ended up in `args.overrides` (argparse's REMAINDER takes
    everything after the first override): parse them out with the options `add_options` declares."""
    if not any(item.startswith("-") for item in args.overrides):
        return args
    rest = argparse.ArgumentParser(prog=prog, add_help=False, argument_default=argparse.SUPPRESS)
    add_options(rest)
    rest.add_argument("overrides", nargs="*")
    parsed = vars(rest.parse_intermixed_args(args.overrides))
    args.overrides = []
    for key, value in parsed.items():
        setattr(args, key, value)
    return args


def rank_suffix() -> str:
    """" (rank N)" in a job of several ranks (torchrun / srun), else empty: which process said it."""
    rank = os.environ.get("RANK") or os.environ.get("SLURM_PROCID")
    world = os.environ.get("WORLD_SIZE") or os.environ.get("SLURM_NTASKS")
    return f" (rank {rank})" if rank is not None and world not in (None, "1") else ""


def entry() -> NoReturn:
    """The `megatron-dapo` command and `python -m megatron_dapo.cli` (what torchrun and srun start):
    run the command, then leave without the interpreter's teardown (`exit_without_teardown`)."""
    exit_without_teardown(main())


def exit_without_teardown(code: int) -> NoReturn:
    """Leave as the interpreter's exit would, less its final teardown: wait for non-daemon threads,
    run the exit handlers (multiprocessing's children, engines' and loggers' clean-up, torch's hooks),
    flush the standard streams, and end the process. Clearing the modules of torch, Megatron-Core and
    transformers and collecting their objects then costs ~2 s of CPU per process (measured in
    docs/PERF.md) for nothing anyone sees; every file this package writes is closed or flushed before
    the command returns. Only after a command returned: an exception unwinds as usual, and a command
    that imported no torch (--help, config) exits the normal way."""
    if "torch" not in sys.modules:
        sys.exit(code)
    import atexit
    import threading

    # What the interpreter's exit does first: the threading module's own exit hooks (they stop idle
    # executor workers, such as those of torch's compile pool: joined without them, an exit waits
    # forever), then a join of the non-daemon threads. Private, but the very call the interpreter's
    # own exit makes (Python 3.11 to 3.13).
    threading._shutdown()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe or stream: nothing left to say
            pass
    os._exit(code)


if __name__ == "__main__":
    entry()
