"""Prompt datasets in the verl/DAPO schema, read from parquet or jsonl and tokenized once at start.

One record (one parquet row or one json line) looks like::

    {"data_source": "math_dapo",
     "prompt": [{"role": "user", "content": "Solve the following math problem ..."}],
     "ability": "MATH",
     "reward_model": {"style": "rule", "ground_truth": "34"},
     "extra_info": {"index": 0, "split": "train"}}

Required: the prompt (``data.prompt_key``, a list of ``{role, content}`` chat messages or a plain
string) and ``reward_model.ground_truth``. Optional: ``data_source`` (passed to the reward function,
default ``"unknown"``) and ``extra_info`` (a dict, default ``{}``); other fields are ignored.

Prompts are rendered with the tokenizer's chat template (``add_generation_prompt=True``) when
``apply_chat_template`` is set and the tokenizer has one; a plain-string prompt is then sent as one
user message. Without a template the message contents are joined with newlines and encoded with the
tokenizer's own special tokens (e.g. a BOS for Llama).

Large datasets: DAPO-Math-17k ships as 1.79M rows that repeat 17k distinct prompts, and every rank
loads the dataset. Each distinct prompt is therefore rendered and tokenized once, and token ids are
kept in one int32 buffer shared by the rows that repeat it; `PromptExample` objects are built on
access.
"""

from __future__ import annotations

import json
import logging
import operator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Literal, Optional, Sequence, Union, overload

import numpy as np
import pyarrow.parquet as pq

from megatron_dapo.errors import InputError

__all__ = [
    "DatasetError",
    "DatasetStats",
    "PromptDataset",
    "PromptExample",
    "SUPPORTED_SUFFIXES",
    "datasets_from_config",
    "encode_prompt",
    "iter_records",
]

logger = logging.getLogger("megatron_dapo.data")

SUPPORTED_SUFFIXES = (".parquet", ".jsonl", ".json")
OverlongPolicy = Literal["drop", "truncate", "error"]
_OVERLONG_POLICIES = ("drop", "truncate", "error")
_PARQUET_BATCH_ROWS = 8192
_TOKENIZE_BATCH = 2048
_DEFAULT_DATA_SOURCE = "unknown"


class DatasetError(InputError, ValueError):
    """A dataset that cannot be used; the message names the file, the row and what to change."""


@dataclass(frozen=True)
class PromptExample:
    """One prompt ready for generation.

    `index` is the position in the `PromptDataset` (what the sampler hands out); `prompt_text` is the
    text that `prompt_ids` encode (the chat-template rendering, or its kept tail when truncated; without
    a chat template the tokenizer may add its own special tokens, e.g. a BOS, to the ids only).
    """

    index: int
    prompt_ids: list[int]
    prompt_text: str
    ground_truth: str
    data_source: str
    extra_info: dict


@dataclass
class DatasetStats:
    """Counts from loading: records read, kept, and what the prompt-length limit did to them."""

    num_records: int
    num_kept: int
    num_dropped_too_long: int
    num_truncated: int
    num_beyond_max_samples: int = 0
    """Records that passed the length check but were cut by `max_samples`."""
    num_unique_prompts: int = 0
    max_prompt_length: int = 0
    longest_prompt: int = 0
    """Longest kept prompt in tokens (after truncation)."""
    mean_prompt_length: float = 0.0

    def describe(self) -> str:
        """One line for the log."""
        parts = [
            f"{self.num_records} records",
            f"kept {self.num_kept}",
            f"{self.num_unique_prompts} distinct prompts",
            f"prompt tokens mean {self.mean_prompt_length:.1f} max {self.longest_prompt} (limit {self.max_prompt_length})",
        ]
        if self.num_dropped_too_long:
            parts.append(f"dropped {self.num_dropped_too_long} longer than the limit")
        if self.num_truncated:
            parts.append(f"truncated {self.num_truncated} from the left to the limit")
        if self.num_beyond_max_samples:
            parts.append(f"{self.num_beyond_max_samples} beyond max_samples not used")
        return ", ".join(parts)


# ----------------------------------------------------------------------------- reading files


def _files_key(name: str) -> str:
    """The config key a user edits to change this dataset's files."""
    return f"data.{name}_files" if name in ("train", "val") else "the data files"


def iter_records(path: Union[str, Path], columns: Optional[Sequence[str]] = None, *, name: str = "train") -> Iterator[tuple[str, dict]]:
    """Yield ``(location, record)`` for each record of a .parquet, .jsonl or .json file.

    `location` is ``"row N"`` (parquet, 0-based) or ``"line N"`` (json, 1-based) for error messages.
    `columns` restricts what parquet reads when the file has them all (otherwise every column is read,
    so the caller's per-record check can list what the file does have). A .json file may hold JSON lines or one JSON array of objects.
    Raises DatasetError for a missing file, an unknown suffix, bad JSON or a record that is not an object.
    """
    path = Path(path)
    suffix = path.suffix.lower()
    if suffix not in SUPPORTED_SUFFIXES:
        raise DatasetError(f"{path}: unsupported file type {suffix or '(none)'!r}; use one of {', '.join(SUPPORTED_SUFFIXES)} (check {_files_key(name)})")
    if not path.is_file():
        raise DatasetError(f"{path}: file not found (check {_files_key(name)}; tools/prepare_data.py writes these files)")
    if suffix == ".parquet":
        yield from _iter_parquet(path, columns, name)
    else:
        yield from _iter_json(path, name)


def _iter_parquet(path: Path, columns: Optional[Sequence[str]], name: str) -> Iterator[tuple[str, dict]]:
    try:
        parquet = pq.ParquetFile(path)
    except Exception as err:  # pyarrow raises several types for a corrupt or non-parquet file
        raise DatasetError(f"{path}: not a readable parquet file ({err}); check {_files_key(name)}") from err
    present = None
    if columns is not None and set(columns) <= set(parquet.schema_arrow.names):
        present = list(columns)  # else read every column, so a missing-field error can list them all
    row = 0
    for batch in parquet.iter_batches(batch_size=_PARQUET_BATCH_ROWS, columns=present):
        for record in batch.to_pylist():
            yield f"row {row}", record
            row += 1


def _iter_json(path: Path, name: str) -> Iterator[tuple[str, dict]]:
    try:
        yield from _iter_json_text(path, name)
    except UnicodeDecodeError as err:
        raise DatasetError(_not_utf8(path, err)) from None


def _not_utf8(path: Path, err: UnicodeDecodeError) -> str:
    """Name the first line that is not UTF-8 (the decoder reports a byte offset in a read buffer)."""
    with open(path, "rb") as handle:
        for line_number, raw in enumerate(handle, start=1):
            try:
                raw.decode("utf-8")
            except UnicodeDecodeError as bad:
                return (
                    f"{path} line {line_number}: not UTF-8 text (byte {bad.start + 1} of the line is "
                    f"0x{raw[bad.start]:02x}); save the file as UTF-8 (e.g. iconv -f latin1 -t utf-8)"
                )
    return f"{path}: not UTF-8 text ({err.reason}); save the file as UTF-8"


def _iter_json_text(path: Path, name: str) -> Iterator[tuple[str, dict]]:
    with open(path, encoding="utf-8") as handle:
        head = handle.read(4096).lstrip()
        handle.seek(0)
        if path.suffix.lower() == ".json" and head.startswith("["):  # .jsonl is always one object per line
            try:
                records = json.load(handle)
            except json.JSONDecodeError as err:
                raise DatasetError(f"{path}: invalid JSON array at line {err.lineno} ({err.msg})") from err
            for position, record in enumerate(records):
                if not isinstance(record, dict):
                    raise DatasetError(f"{path} element {position}: expected a JSON object, got {type(record).__name__}")
                yield f"element {position}", record
            return
        for line_number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as err:
                raise DatasetError(f"{path} line {line_number}: invalid JSON ({err.msg} at column {err.colno})") from err
            if not isinstance(record, dict):
                raise DatasetError(f"{path} line {line_number}: expected a JSON object, got {type(record).__name__}")
            yield f"line {line_number}", record


# ----------------------------------------------------------------------------- record fields

# A prompt after validation: a plain string, or a tuple of (role, content) pairs (hashable, so
# repeated prompts are found with a dict).
_PromptKey = Union[str, tuple[tuple[str, str], ...]]


def _prompt_of(record: dict, prompt_key: str, where: str) -> _PromptKey:
    if prompt_key not in record or record[prompt_key] is None:
        raise DatasetError(
            f"{where}: no prompt field {prompt_key!r} (data.prompt_key); fields found: {sorted(record)}. "
            "Expected a list of {role, content} chat messages or a string (tools/prepare_data.py writes this schema)"
        )
    prompt = record[prompt_key]
    if isinstance(prompt, str):
        if not prompt:
            raise DatasetError(f"{where}: the prompt {prompt_key!r} is an empty string")
        return prompt
    if isinstance(prompt, (list, tuple)):
        if not prompt:
            raise DatasetError(f"{where}: the prompt {prompt_key!r} is an empty list of messages")
        messages = []
        for position, message in enumerate(prompt):
            if not isinstance(message, dict) or not isinstance(message.get("role"), str) or not isinstance(message.get("content"), str):
                raise DatasetError(
                    f"{where}: message {position} of {prompt_key!r} must be an object with string 'role' and "
                    f"'content', got {message!r:.200}"
                )
            messages.append((message["role"], message["content"]))
        return tuple(messages)
    raise DatasetError(f"{where}: the prompt {prompt_key!r} must be a list of chat messages or a string, got {type(prompt).__name__}")


def _ground_truth_of(record: dict, where: str) -> str:
    reward_model = record.get("reward_model")
    if not isinstance(reward_model, dict) or reward_model.get("ground_truth") is None:
        found = f"reward_model={reward_model!r:.200}" if "reward_model" in record else "no 'reward_model'"
        hint = ""
        if "answer" in record or "question" in record:
            hint = " This looks like {question, answer} data: convert it with tools/prepare_data.py."
        raise DatasetError(
            f"{where}: missing reward_model.ground_truth (found {found}; top-level fields {sorted(record)}).{hint}"
        )
    truth = reward_model["ground_truth"]
    if isinstance(truth, bool) or not isinstance(truth, (str, int, float)):
        raise DatasetError(f"{where}: reward_model.ground_truth must be a string (or a number), got {type(truth).__name__}: {truth!r:.200}")
    return truth if isinstance(truth, str) else str(truth)


def _data_source_of(record: dict, where: str) -> str:
    source = record.get("data_source")
    if source is None:
        return _DEFAULT_DATA_SOURCE
    if not isinstance(source, str):
        raise DatasetError(f"{where}: data_source must be a string, got {type(source).__name__}")
    return source


def _extra_info_of(record: dict, where: str) -> dict:
    extra = record.get("extra_info")
    if extra is None:
        return {}
    if not isinstance(extra, dict):
        raise DatasetError(f"{where}: extra_info must be an object, got {type(extra).__name__}")
    return extra


# ----------------------------------------------------------------------------- tokenization


def _uses_chat_template(tokenizer: Any, apply_chat_template: bool) -> bool:
    return bool(apply_chat_template and getattr(tokenizer, "chat_template", None))


def _render(prompt: _PromptKey, tokenizer: Any, use_template: bool) -> str:
    """The prompt text the model sees (before tokenization)."""
    if use_template:
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else [{"role": r, "content": c} for r, c in prompt]
        # tokenize=False: transformers 5 returns a BatchEncoding for tokenize=True; rendering and
        # encoding separately also lets the batch encoder below do the work.
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return prompt if isinstance(prompt, str) else "\n".join(content for _, content in prompt)


def encode_prompt(record: dict, tokenizer: Any, *, prompt_key: str = "prompt", apply_chat_template: bool = True, where: str = "") -> list[int]:
    """Token ids of one record's prompt, rendered exactly as `PromptDataset.load` renders it."""
    use_template = _uses_chat_template(tokenizer, apply_chat_template)
    text = _render(_prompt_of(record, prompt_key, where), tokenizer, use_template)
    return list(_tokenize([text], tokenizer, add_special_tokens=not use_template)[0])


def _tokenize(texts: list[str], tokenizer: Any, add_special_tokens: bool) -> list[list[int]]:
    ids: list[list[int]] = []
    for start in range(0, len(texts), _TOKENIZE_BATCH):
        ids.extend(tokenizer(texts[start : start + _TOKENIZE_BATCH], add_special_tokens=add_special_tokens)["input_ids"])
    return ids


# ----------------------------------------------------------------------------- the dataset


@dataclass
class _Rows:
    """Per-record fields gathered while reading, before the length filter."""

    prompt_of_row: list[int] = field(default_factory=list)
    ground_truth: list[str] = field(default_factory=list)
    data_source: list[str] = field(default_factory=list)
    extra_info: list[dict] = field(default_factory=list)


class PromptDataset(Sequence[PromptExample]):
    """The tokenized prompts of one split; `dataset[i]` is a `PromptExample` with ``index == i``.

    Build it with `PromptDataset.load`. Every rank loads the same files and gets the same dataset, so
    the indices from `PromptSampler` mean the same prompt everywhere.
    """

    def __init__(
        self,
        token_buffer: np.ndarray,
        offsets: np.ndarray,
        texts: list[str],
        prompt_of_row: np.ndarray,
        ground_truth: list[str],
        data_source: list[str],
        extra_info: list[dict],
        stats: DatasetStats,
        name: str = "train",
    ) -> None:
        """Low-level constructor over the packed arrays; use `load` instead."""
        self._token_buffer = token_buffer
        self._offsets = offsets
        self._texts = texts
        self._prompt_of_row = prompt_of_row
        self._ground_truth = ground_truth
        self._data_source = data_source
        self._extra_info = extra_info
        self.stats = stats
        self.name = name

    @classmethod
    def load(
        cls,
        files: Sequence[Union[str, Path]],
        tokenizer: Any,
        *,
        max_prompt_length: int,
        prompt_key: str = "prompt",
        overlong_prompts: OverlongPolicy = "drop",
        apply_chat_template: bool = True,
        max_samples: int = -1,
        name: str = "train",
    ) -> "PromptDataset":
        """Read, validate and tokenize `files` (parquet / jsonl / json, in order) into one dataset.

        Prompts longer than `max_prompt_length` tokens are handled by `overlong_prompts`:
        ``"drop"`` skips them, ``"truncate"`` keeps their LAST `max_prompt_length` tokens (truncation
        from the left: the end of a DAPO prompt holds the question, the answer-format instruction
        and the assistant turn's opening, which the model needs; the start only repeats the
        instruction), ``"error"`` raises naming the first such record. Counts go to the log (logger
        ``megatron_dapo.data``) and to `stats`. `max_samples > 0` keeps only the first that many
        prompts that passed the length check (a validation subset).

        Raises DatasetError for a missing or unreadable file, an empty file, a record without the
        required fields, or a dataset left empty by the length limit.
        """
        files = [files] if isinstance(files, (str, Path)) else list(files)
        if not files:
            raise DatasetError(f"no {name} data files given; set {_files_key(name)} to parquet or jsonl files in the verl/DAPO schema")
        if overlong_prompts not in _OVERLONG_POLICIES:
            raise DatasetError(f"data.overlong_prompts must be one of {_OVERLONG_POLICIES}, got {overlong_prompts!r}")
        if max_prompt_length < 1:
            raise DatasetError(f"rollout.max_prompt_length must be >= 1, got {max_prompt_length}")

        rows = _Rows()
        unique: dict[_PromptKey, int] = {}
        first_location: list[str] = []  # where each distinct prompt first appears, for error messages
        interned: dict[str, str] = {}  # ground truths and sources repeat; keep one string each
        columns = [prompt_key, "reward_model", "data_source", "extra_info"]
        for path in files:
            count_before = len(rows.prompt_of_row)
            for location, record in iter_records(path, columns, name=name):
                where = f"{path} {location}"
                prompt = _prompt_of(record, prompt_key, where)
                truth = _ground_truth_of(record, where)
                source = _data_source_of(record, where)
                extra = _extra_info_of(record, where)
                prompt_id = unique.get(prompt)
                if prompt_id is None:
                    prompt_id = unique[prompt] = len(first_location)
                    first_location.append(where)
                rows.prompt_of_row.append(prompt_id)
                rows.ground_truth.append(interned.setdefault(truth, truth))
                rows.data_source.append(interned.setdefault(source, source))
                rows.extra_info.append(extra)
            if len(rows.prompt_of_row) == count_before:
                raise DatasetError(f"{path}: the file has no records (empty dataset); check {_files_key(name)}")

        use_template = _uses_chat_template(tokenizer, apply_chat_template)
        texts = [_render(prompt, tokenizer, use_template) for prompt in unique]
        del unique
        # The template already spells out any BOS / special tokens it wants; plain text takes the
        # tokenizer's own convention.
        token_ids = _tokenize(texts, tokenizer, add_special_tokens=not use_template)

        lengths = np.fromiter((len(ids) for ids in token_ids), dtype=np.int64, count=len(token_ids))
        overlong = lengths > max_prompt_length
        prompt_of_row = np.asarray(rows.prompt_of_row, dtype=np.int64)
        overlong_rows = overlong[prompt_of_row] if len(prompt_of_row) else np.zeros(0, dtype=bool)
        num_overlong_rows = int(overlong_rows.sum())

        if num_overlong_rows and overlong_prompts == "error":
            first = int(np.argmax(overlong_rows))
            prompt_id = int(prompt_of_row[first])
            raise DatasetError(
                f"{first_location[prompt_id]}: the prompt has {lengths[prompt_id]} tokens, more than "
                f"rollout.max_prompt_length={max_prompt_length} ({num_overlong_rows} of {len(prompt_of_row)} {name} records "
                "are too long). Raise rollout.max_prompt_length, or set data.overlong_prompts to 'drop' or 'truncate'"
            )
        if overlong_prompts == "truncate":
            for prompt_id in np.flatnonzero(overlong):
                token_ids[prompt_id] = token_ids[prompt_id][-max_prompt_length:]
                texts[prompt_id] = tokenizer.decode(token_ids[prompt_id], skip_special_tokens=False)
            keep_rows = np.ones(len(prompt_of_row), dtype=bool)
        else:
            keep_rows = ~overlong_rows

        kept_positions = np.flatnonzero(keep_rows)
        num_passed = len(kept_positions)
        if max_samples > 0:
            kept_positions = kept_positions[:max_samples]
        if len(kept_positions) == 0:
            raise DatasetError(
                f"{name} dataset is empty after filtering: all {len(prompt_of_row)} records have prompts longer than "
                f"rollout.max_prompt_length={max_prompt_length} tokens (longest {int(lengths.max())}). Raise "
                "rollout.max_prompt_length or set data.overlong_prompts='truncate'"
            )

        # Pack only the distinct prompts that kept rows use, in order of first appearance.
        kept_rows_prompts = prompt_of_row[kept_positions]
        used = np.unique(kept_rows_prompts)
        renumber = np.full(len(token_ids), -1, dtype=np.int64)
        renumber[used] = np.arange(len(used))
        kept_lengths = np.array([len(token_ids[p]) for p in used], dtype=np.int64)
        offsets = np.zeros(len(used) + 1, dtype=np.int64)
        np.cumsum(kept_lengths, out=offsets[1:])
        token_buffer = np.fromiter((t for p in used for t in token_ids[p]), dtype=np.int32, count=int(offsets[-1]))

        row_lengths = kept_lengths[renumber[kept_rows_prompts]]
        stats = DatasetStats(
            num_records=len(prompt_of_row),
            num_kept=len(kept_positions),
            num_dropped_too_long=0 if overlong_prompts == "truncate" else num_overlong_rows,
            num_truncated=num_overlong_rows if overlong_prompts == "truncate" else 0,
            num_beyond_max_samples=num_passed - len(kept_positions),
            num_unique_prompts=len(used),
            max_prompt_length=max_prompt_length,
            longest_prompt=int(row_lengths.max()),
            mean_prompt_length=float(row_lengths.mean()),
        )
        changed = stats.num_dropped_too_long or stats.num_truncated
        logger.log(
            logging.WARNING if changed else logging.INFO,
            "%s data from %d file(s): %s%s",
            name,
            len(files),
            stats.describe(),
            f" (data.overlong_prompts={overlong_prompts}, rollout.max_prompt_length={max_prompt_length})" if changed else "",
        )
        positions = kept_positions.tolist()
        return cls(
            token_buffer=token_buffer,
            offsets=offsets,
            texts=[texts[p] for p in used],
            prompt_of_row=renumber[kept_rows_prompts].astype(np.int32),
            ground_truth=[rows.ground_truth[i] for i in positions],
            data_source=[rows.data_source[i] for i in positions],
            extra_info=[rows.extra_info[i] for i in positions],
            stats=stats,
            name=name,
        )

    def __len__(self) -> int:
        return len(self._prompt_of_row)

    @overload
    def __getitem__(self, index: int) -> PromptExample: ...

    @overload
    def __getitem__(self, index: slice) -> list[PromptExample]: ...

    def __getitem__(self, index):
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        index = operator.index(index)
        size = len(self)
        if index < 0:
            index += size
        if not 0 <= index < size:
            raise IndexError(f"{self.name} dataset index {index} out of range for {size} prompts")
        prompt_id = int(self._prompt_of_row[index])
        start, end = int(self._offsets[prompt_id]), int(self._offsets[prompt_id + 1])
        return PromptExample(
            index=index,
            prompt_ids=self._token_buffer[start:end].tolist(),
            prompt_text=self._texts[prompt_id],
            ground_truth=self._ground_truth[index],
            data_source=self._data_source[index],
            extra_info=dict(self._extra_info[index]),  # a copy: callers may annotate it
        )

    def prompt_length(self, index: int) -> int:
        """Tokens in prompt `index`, without building the example."""
        prompt_id = int(self._prompt_of_row[index])
        return int(self._offsets[prompt_id + 1] - self._offsets[prompt_id])

    def __repr__(self) -> str:
        return f"PromptDataset({self.name!r}, {len(self)} prompts)"


def datasets_from_config(config: Any, tokenizer: Any) -> tuple[PromptDataset, Optional[PromptDataset]]:
    """The train dataset and the validation one (None when `data.val_files` is empty) of a `Config`."""
    data, rollout = config.data, config.rollout
    common = dict(
        max_prompt_length=rollout.max_prompt_length,
        prompt_key=data.prompt_key,
        overlong_prompts=data.overlong_prompts,
        apply_chat_template=data.apply_chat_template,
    )
    train = PromptDataset.load(data.train_files, tokenizer, name="train", **common)
    val = None
    if data.val_files:
        val = PromptDataset.load(data.val_files, tokenizer, name="val", max_samples=data.val_max_samples, **common)
    return train, val
