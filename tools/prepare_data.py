#!/usr/bin/env python
"""Write a prompt dataset in the verl/DAPO schema from a jsonl of {question, answer} objects.

    python tools/prepare_data.py --input questions.jsonl --output data/train.parquet \\
        --val-output data/val.parquet --val-size 200 --seed 0

The command `megatron-dapo prepare-data` (see its --help), for a checkout that is not installed.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # runs from a checkout without installing

from megatron_dapo.cli.main import main as megatron_dapo  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    """`megatron-dapo prepare-data ARGV` (default: this script's arguments)."""
    return megatron_dapo(["prepare-data", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    sys.exit(main())
