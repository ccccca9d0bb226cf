#!/usr/bin/env python
"""Write a prompt dataset in the verl/DAPO schema from a jsonl of {question, answer} objects.

    python tools/prepare_data.py --input questions.jsonl --output data/train.parquet \
        --val-output data/val.parquet --val-size 200 --seed 0

Same as `megatron-dapo prepare-data`; see megatron_dapo/data/prepare.py and --help for the schema.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # runs from a checkout without installing

from megatron_dapo.data.prepare import add_arguments, run  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="prepare_data.py")
    add_arguments(parser)  # sets the description (the schema) and the formatter
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
