"""Write prompt datasets in the verl/DAPO schema, e.g. from a {question, answer} jsonl.

Each question is wrapped in the DAPO-Math instruction template (the text of the DAPO-Math-17k
dataset, which asks for a final ``Answer: ...`` line that the DAPO math reward reads); the records
are written as parquet or jsonl that `PromptDataset.load` and verl read. Writes are atomic: a
temporary file in the same directory, then a rename. The command is `megatron-dapo prepare-data`
(cli/prepare_data.py); the arithmetic demo's data (`data.arithmetic`) is written through here too.
"""

from __future__ import annotations

import json
import os
import random
import tempfile
from pathlib import Path
from typing import Optional, Sequence, Union

import pyarrow as pa
import pyarrow.parquet as pq

from megatron_dapo.data.dataset import DatasetError, iter_records

__all__ = [
    "DAPO_INSTRUCTION_PREFIX",
    "DAPO_INSTRUCTION_SUFFIX",
    "DEFAULT_DATA_SOURCE",
    "WRITE_SUFFIXES",
    "dapo_prompt",
    "make_record",
    "prepare_dataset",
    "read_question_answers",
    "read_records",
    "split_train_val",
    "write_records",
]

# verl routes "math_dapo" to the DAPO math reward; our reward manager passes it to custom functions.
DEFAULT_DATA_SOURCE = "math_dapo"
WRITE_SUFFIXES = (".parquet", ".jsonl")

DAPO_INSTRUCTION_PREFIX = (
    "Solve the following math problem step by step. The last line of your response should be of the form "
    "Answer: $Answer (without quotes) where $Answer is the answer to the problem.\n\n"
)
DAPO_INSTRUCTION_SUFFIX = '\n\nRemember to put your answer on its own line after "Answer:".'


def dapo_prompt(question: str) -> str:
    """The DAPO-Math instruction wrapped around a question."""
    return f"{DAPO_INSTRUCTION_PREFIX}{question}{DAPO_INSTRUCTION_SUFFIX}"


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
    if suffix not in WRITE_SUFFIXES:
        raise DatasetError(f"{path}: cannot write {suffix or 'a file without suffix'!r}; use {' or '.join(WRITE_SUFFIXES)}")
    if not records:
        raise DatasetError(f"{path}: refusing to write an empty dataset")
    path.parent.mkdir(parents=True, exist_ok=True)
    handle, temporary = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        if suffix == ".parquet":
            os.close(handle)
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


def prepare_dataset(
    input_path: Union[str, Path],
    output: Union[str, Path],
    *,
    data_source: str = DEFAULT_DATA_SOURCE,
    split: str = "train",
    val_output: Optional[Union[str, Path]] = None,
    val_size: Optional[int] = None,
    val_split: str = "test",
    seed: int = 0,
) -> list[tuple[Path, int]]:
    """Write the {question, answer} records of `input_path` as a dataset in `output`, and with
    `val_output` and `val_size` that many random ones (`seed`) held out into `val_output` instead.

    Returns [(path written, records)]; raises DatasetError on bad input, before writing anything.
    """
    if (val_output is None) != (val_size is None):
        raise DatasetError("--val-output and --val-size go together: give both to hold out a validation set, or neither")
    outputs = [Path(output)] + ([Path(val_output)] if val_output is not None else [])
    for path in outputs:
        if path.suffix.lower() not in WRITE_SUFFIXES:
            raise DatasetError(f"{path}: the output must end in {' or '.join(WRITE_SUFFIXES)}")
        if path.resolve() == Path(input_path).resolve():
            raise DatasetError(f"{path}: the output would overwrite the input")
    if len(outputs) == 2 and outputs[0].resolve() == outputs[1].resolve():
        raise DatasetError("--output and --val-output are the same file")

    pairs = read_question_answers(input_path)
    train_positions, val_positions = (
        split_train_val(len(pairs), val_size, seed) if val_size is not None else (list(range(len(pairs))), [])
    )

    def records(positions: list[int], split_name: str) -> list[dict]:
        # extra_info.index stays the input line order, so any record can be traced back to its source.
        return [make_record(*pairs[i], index=i, split=split_name, data_source=data_source) for i in positions]

    written = [(write_records(records(train_positions, split), output), len(train_positions))]
    if val_output is not None:
        written.append((write_records(records(val_positions, val_split), val_output), len(val_positions)))
    return written
