"""Write prompt datasets in the verl/DAPO schema: from a {question, answer} jsonl, or the arithmetic demo's.

`megatron-dapo prepare-data` / tools/prepare_data.py wrap each question in the DAPO-Math instruction
template (the text of the DAPO-Math-17k dataset, which asks for a final ``Answer: ...`` line that
the DAPO math reward reads) and write parquet or jsonl that `PromptDataset.load` and verl read.
Writes are atomic: a temporary file in the same directory, then a rename.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
from pathlib import Path
from typing import Iterator, Sequence, Union

from megatron_dapo.data.arithmetic import dapo_prompt, make_problems
from megatron_dapo.data.dataset import DatasetError, iter_records

__all__ = [
    "DEFAULT_DATA_SOURCE",
    "PREPARE_DESCRIPTION",
    "add_arguments",
    "make_record",
    "read_question_answers",
    "read_records",
    "run",
    "split_train_val",
    "write_arithmetic_dataset",
    "write_records",
]

# verl routes "math_dapo" to the DAPO math reward; our reward manager passes it to custom functions.
DEFAULT_DATA_SOURCE = "math_dapo"
ARITHMETIC_DATA_SOURCE = "synthetic/arithmetic"
_WRITE_SUFFIXES = (".parquet", ".jsonl")

PREPARE_DESCRIPTION = """\
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


def make_record(question: str, answer: str, *, index: int, split: str, data_source: str = DEFAULT_DATA_SOURCE) -> dict:
    """One record of the verl/DAPO schema: the question in the DAPO instruction template, the answer as ground truth."""
    return {
        "data_source": data_source,
        "prompt": [{"role": "user", "content": dapo_prompt(question)}],
        "ability": "MATH",
        "reward_model": {"style": "rule", "ground_truth": answer},
        "extra_info": {"index": index, "split": split, "question": question, "answer": answer},
    }


def write_records(records: Sequence[dict], path: Union[str, Path]) -> Path:
    """Write `records` to `path` (.parquet or .jsonl, by suffix) atomically; return the path.

    Parent directories are created. An empty list is refused: the trainer cannot use an empty file.
    """
    path = Path(path)
    suffix = path.suffix.lower()
    if suffix not in _WRITE_SUFFIXES:
        raise DatasetError(f"{path}: cannot write {suffix or 'a file without suffix'!r}; use {' or '.join(_WRITE_SUFFIXES)}")
    if not records:
        raise DatasetError(f"{path}: refusing to write an empty dataset")
    path.parent.mkdir(parents=True, exist_ok=True)
    handle, temporary = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        if suffix == ".parquet":
            os.close(handle)
            import pyarrow as pa
            import pyarrow.parquet as pq

            pq.write_table(pa.Table.from_pylist(list(records)), temporary)
            with open(temporary, "rb") as written:
                os.fsync(written.fileno())  # the rename must not publish a file whose data is still in flight
        else:
            with os.fdopen(handle, "w", encoding="utf-8") as out:
                for record in records:
                    out.write(json.dumps(record, ensure_ascii=False) + "\n")
                out.flush()
                os.fsync(out.fileno())
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise
    return path


def read_records(path: Union[str, Path]) -> list[dict]:
    """Every record of a .parquet, .jsonl or .json file as a dict (nested structs become dicts)."""
    return [record for _, record in iter_records(path)]


def _text_field(record: dict, key: str, where: str) -> str:
    if key not in record:
        raise DatasetError(f"{where}: missing {key!r} (each line must be an object with 'question' and 'answer'); found keys {sorted(record)}")
    value = record[key]
    if value is None:
        raise DatasetError(f"{where}: {key!r} is null; give it a string (or drop the line)")
    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        raise DatasetError(f"{where}: {key!r} must be a string or a number, got {type(value).__name__}")
    text = value if isinstance(value, str) else str(value)
    if not text.strip():
        raise DatasetError(f"{where}: {key!r} is empty")
    return text


def read_question_answers(path: Union[str, Path]) -> list[tuple[str, str]]:
    """(question, answer) pairs from {"question", "answer"} records (.jsonl; .json and .parquet read
    too, through `dataset.iter_records`); other keys are ignored.

    Raises DatasetError naming the line for bad JSON, a missing or empty field; also for a missing
    or empty file.
    """
    path = Path(path)
    if not path.is_file():
        raise DatasetError(f"{path}: input file not found")
    pairs = []
    for location, record in iter_records(path, name="input"):
        where = f"{path} {location}"
        pairs.append((_text_field(record, "question", where), _text_field(record, "answer", where)))
    if not pairs:
        raise DatasetError(f"{path}: no questions in the input (empty file)")
    return pairs


def split_train_val(num: int, val_size: int, seed: int) -> tuple[list[int], list[int]]:
    """Positions ``0..num-1`` split into (train, val): `val_size` random ones held out, both in input order."""
    if not 0 < val_size < num:
        raise DatasetError(f"--val-size must be between 1 and {num - 1} (the input has {num} questions), got {val_size}")
    held_out = set(random.Random(seed).sample(range(num), val_size))
    return [i for i in range(num) if i not in held_out], sorted(held_out)


# ----------------------------------------------------------------------------- arithmetic demo data


def _distinct_problem_count(max_operand: int) -> int:
    """Distinct questions `make_problems` can produce with ops "+-": all a+b, and a-b with a >= b."""
    values = max_operand + 1
    return values * values + values * (values + 1) // 2


def _problem_stream(seed: int, max_operand: int) -> Iterator:
    """Endless deterministic arithmetic problems (chunks of `make_problems` with derived seeds)."""
    chunk = 0
    while True:
        yield from make_problems(1024, seed=seed * 1_000_003 + chunk, max_operand=max_operand)
        chunk += 1


def write_arithmetic_dataset(
    out_dir: Union[str, Path], num_train: int, num_val: int, seed: int, max_operand: int = 50
) -> tuple[Path, Path]:
    """Write the arithmetic demo's ``train.parquet`` and ``val.parquet`` under `out_dir`; return their paths.

    The validation questions are distinct and never appear in the training set (training questions
    may repeat), so validation accuracy measures generalisation rather than recall. Deterministic in
    (num_train, num_val, seed, max_operand).
    """
    if num_train < 1 or num_val < 1:
        raise ValueError(f"need num_train >= 1 and num_val >= 1, got {num_train} and {num_val}")
    universe = _distinct_problem_count(max_operand)
    if num_val >= universe:
        raise ValueError(
            f"max_operand={max_operand} allows only {universe} distinct problems; num_val={num_val} would leave none for training"
        )
    val_problems, held_out = [], set()
    for problem in _problem_stream(seed * 2 + 1, max_operand):
        if len(val_problems) == num_val:
            break
        if problem.question not in held_out:
            held_out.add(problem.question)
            val_problems.append(problem)
    train_problems = []
    for problem in _problem_stream(seed * 2, max_operand):
        if len(train_problems) == num_train:
            break
        if problem.question not in held_out:
            train_problems.append(problem)
    out_dir = Path(out_dir)

    def records(problems, split):
        return [
            make_record(p.question, p.answer, index=i, split=split, data_source=ARITHMETIC_DATA_SOURCE)
            for i, p in enumerate(problems)
        ]

    train_path = write_records(records(train_problems, "train"), out_dir / "train.parquet")
    val_path = write_records(records(val_problems, "test"), out_dir / "val.parquet")
    return train_path, val_path


# ----------------------------------------------------------------------------- command line


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Arguments of `megatron-dapo prepare-data` / tools/prepare_data.py (and the schema in --help)."""
    parser.description = PREPARE_DESCRIPTION
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.add_argument("--input", required=True, help='jsonl with one {"question": ..., "answer": ...} object per line')
    parser.add_argument("--output", required=True, help="dataset to write: .parquet or .jsonl")
    parser.add_argument("--data-source", default=DEFAULT_DATA_SOURCE, help=f"data_source of every record (default {DEFAULT_DATA_SOURCE!r})")
    parser.add_argument("--split", default="train", help="extra_info.split of the --output records (default 'train')")
    parser.add_argument("--val-output", default=None, help="also write a held-out validation set here (.parquet or .jsonl)")
    parser.add_argument("--val-size", type=int, default=None, help="questions to hold out for --val-output")
    parser.add_argument("--val-split", default="test", help="extra_info.split of the validation records (default 'test', as verl)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random hold-out (default 0)")


def prepare(args: argparse.Namespace) -> list[tuple[Path, int]]:
    """Do what `run` does and return [(path written, records)], raising DatasetError on bad input."""
    if (args.val_output is None) != (args.val_size is None):
        raise DatasetError("--val-output and --val-size go together: give both to hold out a validation set, or neither")
    outputs = [Path(args.output)] + ([Path(args.val_output)] if args.val_output else [])
    for output in outputs:
        if output.suffix.lower() not in _WRITE_SUFFIXES:
            raise DatasetError(f"{output}: the output must end in {' or '.join(_WRITE_SUFFIXES)}")
        if output.resolve() == Path(args.input).resolve():
            raise DatasetError(f"{output}: the output would overwrite the input")
    if len(outputs) == 2 and outputs[0].resolve() == outputs[1].resolve():
        raise DatasetError("--output and --val-output are the same file")

    pairs = read_question_answers(args.input)
    train_positions, val_positions = (
        split_train_val(len(pairs), args.val_size, args.seed) if args.val_output else (list(range(len(pairs))), [])
    )

    def records(positions: list[int], split: str) -> list[dict]:
        # extra_info.index stays the input line order, so any record can be traced back to its source.
        return [make_record(*pairs[i], index=i, split=split, data_source=args.data_source) for i in positions]

    written = [(write_records(records(train_positions, args.split), args.output), len(train_positions))]
    if args.val_output:
        written.append((write_records(records(val_positions, args.val_split), args.val_output), len(val_positions)))
    return written


def run(args: argparse.Namespace) -> int:
    """Entry point of `prepare-data`: 0 on success, 2 (with the reason on stderr) on bad input."""
    try:
        written = prepare(args)
    except DatasetError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    for path, count in written:
        print(f"wrote {count} records to {path}")
    return 0
