"""What a `megatron-dapo` process pays to end: the interpreter's exit vs `exit_without_teardown`.

Every rank of every command imports torch, Megatron-Core and transformers (the trainer's imports,
`megatron_dapo.trainer.loop`). Python's normal exit then clears every module and collects their
objects; `megatron_dapo.cli.main.exit_without_teardown` (what the `megatron-dapo` command and
`python -m megatron_dapo.cli` end with) joins the threads, runs the exit handlers, flushes and
leaves. This script is one such process: it imports what a trainer rank imports, builds nothing,
and ends one way or the other. Time it as a whole process, the two ways in turn:

    /usr/bin/time -f "%U %S %e" python benchmarks/bench_exit.py --exit normal
    /usr/bin/time -f "%U %S %e" python benchmarks/bench_exit.py --exit fast

The difference of the two is the exit's cost (the imports are the same on both sides).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--exit", choices=("normal", "fast"), required=True,
                        help="normal: sys.exit (the interpreter's teardown); fast: exit_without_teardown")  # fmt: skip
    args = parser.parse_args()
    import megatron_dapo.trainer.loop  # noqa: F401  (what a trainer rank imports)
    from megatron_dapo.cli.main import exit_without_teardown

    if args.exit == "fast":
        exit_without_teardown(0)
    sys.exit(0)


if __name__ == "__main__":
    main()
