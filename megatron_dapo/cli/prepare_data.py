"""`megatron-dapo prepare-data`: a prompt dataset in the verl/DAPO schema from a {question, answer} jsonl.

    megatron-dapo prepare-data --input questions.jsonl --output data/train.parquet \
        --val-output data/val.parquet --val-size 200 --seed 0

The library is `megatron_dapo.data.prepare`. Exit code 2 on bad input (the line and the field).
"""

from __future__ import annotations

import argparse

DEFAULT_DATA_SOURCE = "math_dapo"
"""`data.prepare.DEFAULT_DATA_SOURCE`, written here so that --help imports no data library."""

DESCRIPTION = """\
Turn a jsonl of {"question": ..., "answer": ...} objects (one per line) into a prompt dataset in the
verl/DAPO schema, the format `megatron-dapo train` reads (data.train_files / data.val_files) and verl
reads too. Each output record:

  {"data_source": "math_dapo",
   "prompt": [{"role": "user", "content": "<DAPO instruction>\\n\\n<question>\\n\\n<reminder>"}],
   "ability": "MATH",
   "reward_model": {"style": "rule", "ground_truth": "<answer>"},
   "extra_info": {"index": <line order in the input, from 0>, "split": "train",
                  "question": "<question>", "answer": "<answer>"}}

The DAPO instruction asks for a last line "Answer: $Answer", which the DAPO math reward scores
against reward_model.ground_truth. Answers that are JSON numbers are written as strings.
--output and --val-output end in .parquet or .jsonl; files are written atomically.
With --val-output and --val-size N, N random questions (--seed) are held out as a validation set.
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = DESCRIPTION
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.add_argument("--input", required=True, help='jsonl with one {"question": ..., "answer": ...} object per line')
    parser.add_argument("--output", required=True, help="dataset to write: .parquet or .jsonl")
    parser.add_argument("--data-source", default=DEFAULT_DATA_SOURCE, help=f"data_source of every record (default {DEFAULT_DATA_SOURCE!r})")
    parser.add_argument("--split", default="train", help="extra_info.split of the --output records (default 'train')")
    parser.add_argument("--val-output", default=None, help="also write a held-out validation set here (.parquet or .jsonl)")
    parser.add_argument("--val-size", type=int, default=None, help="questions to hold out for --val-output")
    parser.add_argument("--val-split", default="test", help="extra_info.split of the validation records (default 'test', as verl)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random hold-out (default 0)")


def run(args: argparse.Namespace) -> int:
    from megatron_dapo.data.prepare import prepare_dataset

    written = prepare_dataset(
        args.input, args.output, data_source=args.data_source, split=args.split, val_output=args.val_output,
        val_size=args.val_size, val_split=args.val_split, seed=args.seed,
    )  # fmt: skip
    for path, count in written:
        print(f"wrote {count} records to {path}")
    return 0
