"""Tests for the prompt dataset (megatron_dapo/data/dataset.py) with the arithmetic demo's real tokenizer."""

from __future__ import annotations

import json
import logging

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from megatron_dapo.config import Config
from megatron_dapo.data.arithmetic import make_problems
from megatron_dapo.data.dataset import DatasetError, PromptDataset, datasets_from_config
from megatron_dapo.data.prepare import dapo_prompt, make_record, write_records


def chat_text(*turns: tuple[str, str]) -> str:
    """The arithmetic tokenizer's chat template rendered by hand (Qwen layout) with the generation prompt."""
    return "".join(f"<|im_start|>{role}\n{content}<|im_end|>\n" for role, content in turns) + "<|im_start|>assistant\n"


def encode(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def arithmetic_records(num: int, seed: int = 0) -> list[dict]:
    return [make_record(p.question, p.answer, index=i, split="train") for i, p in enumerate(make_problems(num, seed))]


def write_jsonl(path, records) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))


def load(files, tokenizer, **kwargs) -> PromptDataset:
    kwargs.setdefault("max_prompt_length", 512)
    return PromptDataset.load(files if isinstance(files, list) else [files], tokenizer, **kwargs)


# ----------------------------------------------------------------------------- reading and rendering


def test_chat_template_applied_and_ids_match_an_independent_encoding(tmp_path, tokenizer):
    records = arithmetic_records(12)
    path = write_records(records, tmp_path / "train.parquet")
    dataset = load(path, tokenizer)
    assert len(dataset) == 12 and dataset.stats.num_kept == 12 and dataset.stats.num_records == 12
    for i, record in enumerate(records):
        example = dataset[i]
        expected_text = chat_text(("user", dapo_prompt(record["extra_info"]["question"])))
        assert example.index == i
        assert example.prompt_text == expected_text
        assert example.prompt_ids == encode(tokenizer, expected_text)
        decoded = tokenizer.decode(example.prompt_ids)
        assert decoded.startswith("<|im_start|>user\n") and decoded.endswith("<|im_end|>\n<|im_start|>assistant\n")
        assert example.ground_truth == record["reward_model"]["ground_truth"]
        assert example.data_source == "math_dapo"
        assert example.extra_info == record["extra_info"]
    assert dataset.prompt_length(3) == len(dataset[3].prompt_ids)


def test_jsonl_and_parquet_give_identical_examples(tmp_path, tokenizer):
    records = arithmetic_records(20, seed=4)
    from_parquet = load(write_records(records, tmp_path / "a.parquet"), tokenizer)
    from_jsonl = load(write_records(records, tmp_path / "a.jsonl"), tokenizer)
    json_array = tmp_path / "a.json"
    json_array.write_text(json.dumps(records))
    from_array = load(json_array, tokenizer)
    assert list(from_parquet) == list(from_jsonl) == list(from_array)
    assert len(from_parquet) == 20


def test_verl_parquet_schema_with_nested_structs(tmp_path, tokenizer):
    schema = pa.schema(
        [
            ("data_source", pa.string()),
            ("prompt", pa.list_(pa.struct([("content", pa.string()), ("role", pa.string())]))),
            ("ability", pa.string()),
            ("reward_model", pa.struct([("ground_truth", pa.string()), ("style", pa.string())])),
            ("extra_info", pa.struct([("index", pa.int64()), ("split", pa.string())])),
        ]
    )
    rows = {
        "data_source": ["math_dapo", "openai/gsm8k"],
        "prompt": [
            [{"content": "You are careful.", "role": "system"}, {"content": "What is 2 + 2?", "role": "user"}],
            [{"content": "What is 7 - 3?", "role": "user"}],
        ],
        "ability": ["MATH", "MATH"],
        "reward_model": [{"ground_truth": "4", "style": "rule"}, {"ground_truth": "4", "style": "rule"}],
        "extra_info": [{"index": 17, "split": "train"}, {"index": 3, "split": "test"}],
    }
    path = tmp_path / "verl.parquet"
    pq.write_table(pa.Table.from_pydict(rows, schema=schema), path)
    dataset = load(path, tokenizer)
    first, second = dataset[0], dataset[1]
    assert first.prompt_text == chat_text(("system", "You are careful."), ("user", "What is 2 + 2?"))
    assert first.prompt_ids == encode(tokenizer, first.prompt_text)
    assert second.prompt_text == chat_text(("user", "What is 7 - 3?"))
    assert (first.data_source, second.data_source) == ("math_dapo", "openai/gsm8k")
    assert first.extra_info == {"index": 17, "split": "train"} and second.extra_info == {"index": 3, "split": "test"}
    assert first.ground_truth == second.ground_truth == "4"


def test_without_chat_template_and_plain_string_prompts(tmp_path, tokenizer):
    records = [
        {"prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 1 + 1?"}],
         "reward_model": {"ground_truth": 2}},
        {"prompt": "What is 3 + 3?", "reward_model": {"ground_truth": "6"}, "extra_info": None},
    ]  # fmt: skip
    path = tmp_path / "mixed.jsonl"
    write_jsonl(path, records)
    plain = load(path, tokenizer, apply_chat_template=False)
    assert plain[0].prompt_text == "Be brief.\nWhat is 1 + 1?"
    assert plain[0].prompt_ids == tokenizer("Be brief.\nWhat is 1 + 1?")["input_ids"]
    assert plain[0].ground_truth == "2"  # numbers become strings
    assert plain[1].prompt_text == "What is 3 + 3?"
    assert plain[1].data_source == "unknown" and plain[1].extra_info == {}
    templated = load(path, tokenizer)
    assert templated[1].prompt_text == chat_text(("user", "What is 3 + 3?"))  # a string is one user turn


def test_repeated_prompts_keep_their_own_fields(tmp_path, tokenizer):
    base = arithmetic_records(2)
    records = []
    for copy in range(3):  # the DAPO-Math-17k layout: the same prompts repeated
        for record in base:
            records.append({**record, "extra_info": {"index": len(records), "copy": copy}})
    dataset = load(write_records(records, tmp_path / "dup.parquet"), tokenizer)
    assert len(dataset) == 6 and dataset.stats.num_unique_prompts == 2
    assert [e.extra_info["index"] for e in dataset] == list(range(6))
    assert dataset[0].prompt_ids == dataset[2].prompt_ids == dataset[4].prompt_ids
    assert dataset[0].prompt_ids != dataset[1].prompt_ids
    dataset[0].extra_info["note"] = "changed"  # examples are copies: the dataset is not modified
    assert "note" not in dataset[0].extra_info


def test_sequence_access(tmp_path, tokenizer):
    dataset = load(write_records(arithmetic_records(5), tmp_path / "s.jsonl"), tokenizer)
    assert dataset[-1] == dataset[4]
    assert [e.index for e in dataset[1:4]] == [1, 2, 3]
    with pytest.raises(IndexError):
        dataset[5]


def test_several_files_concatenate_in_order_and_max_samples(tmp_path, tokenizer):
    first = write_records(arithmetic_records(4, seed=1), tmp_path / "one.parquet")
    second = write_records(arithmetic_records(3, seed=2), tmp_path / "two.jsonl")
    both = load([first, second], tokenizer)
    assert len(both) == 7
    assert [e.ground_truth for e in both] == [r["reward_model"]["ground_truth"] for r in arithmetic_records(4, 1) + arithmetic_records(3, 2)]
    subset = load([first, second], tokenizer, max_samples=5, name="val")
    assert [e.prompt_ids for e in subset] == [e.prompt_ids for e in both[:5]]
    assert subset.stats.num_kept == 5 and subset.stats.num_beyond_max_samples == 2


def test_datasets_from_config(tmp_path, tokenizer):
    config = Config()
    config.data.train_files = [str(write_records(arithmetic_records(6), tmp_path / "t.parquet"))]
    config.data.val_files = [str(write_records(arithmetic_records(4, seed=9), tmp_path / "v.parquet"))]
    config.data.val_max_samples = 3
    train, val = datasets_from_config(config, tokenizer)
    assert (len(train), len(val), val.name) == (6, 3, "val")
    config.data.val_files = []
    assert datasets_from_config(config, tokenizer)[1] is None


# ----------------------------------------------------------------------------- prompt-length limit


@pytest.fixture()
def mixed_length_file(tmp_path, tokenizer):
    """Four prompts, two short and two long; returns (path, full token ids of each, a limit between them)."""
    questions = ["What is 1 + 2?", "What is 40 - 9? " + "Think about it carefully. " * 6, "What is 5 + 5?",
                 "What is 33 + 11? " + "Show every step of the work. " * 8]  # fmt: skip
    records = [make_record(q, "0", index=i, split="train") for i, q in enumerate(questions)]
    path = write_records(records, tmp_path / "lengths.jsonl")
    full = [encode(tokenizer, chat_text(("user", dapo_prompt(q)))) for q in questions]
    limit = max(len(full[0]), len(full[2])) + 5
    assert limit < min(len(full[1]), len(full[3]))
    return path, full, limit


def test_drop_overlong_prompts_counts_and_logs(mixed_length_file, tokenizer, caplog):
    path, full, limit = mixed_length_file
    with caplog.at_level(logging.INFO, logger="megatron_dapo.data"):
        dataset = load(path, tokenizer, max_prompt_length=limit, overlong_prompts="drop")
    assert [e.prompt_ids for e in dataset] == [full[0], full[2]]
    assert [e.extra_info["index"] for e in dataset] == [0, 2]
    assert [e.index for e in dataset] == [0, 1]
    stats = dataset.stats
    assert (stats.num_records, stats.num_kept, stats.num_dropped_too_long, stats.num_truncated) == (4, 2, 2, 0)
    assert "dropped 2" in caplog.text and f"rollout.max_prompt_length={limit}" in caplog.text


def test_truncate_keeps_the_end_of_the_prompt(mixed_length_file, tokenizer, caplog):
    path, full, limit = mixed_length_file
    with caplog.at_level(logging.INFO, logger="megatron_dapo.data"):
        dataset = load(path, tokenizer, max_prompt_length=limit, overlong_prompts="truncate")
    assert len(dataset) == 4
    assert dataset[0].prompt_ids == full[0] and dataset[2].prompt_ids == full[2]
    for i in (1, 3):
        assert dataset[i].prompt_ids == full[i][-limit:]
        assert dataset[i].prompt_text == tokenizer.decode(full[i][-limit:])
        assert dataset[i].prompt_text.endswith('after "Answer:".<|im_end|>\n<|im_start|>assistant\n')
    stats = dataset.stats
    assert (stats.num_kept, stats.num_dropped_too_long, stats.num_truncated, stats.longest_prompt) == (4, 0, 2, limit)
    assert "truncated 2" in caplog.text


def test_error_on_overlong_prompt_names_the_record_and_the_keys(mixed_length_file, tokenizer):
    path, full, limit = mixed_length_file
    with pytest.raises(DatasetError) as err:
        load(path, tokenizer, max_prompt_length=limit, overlong_prompts="error")
    message = str(err.value)
    assert str(path) in message and "line 2" in message and f"{len(full[1])} tokens" in message
    assert "rollout.max_prompt_length" in message and "data.overlong_prompts" in message and "2 of 4" in message


def test_everything_too_long_is_an_error(mixed_length_file, tokenizer):
    path, full, _ = mixed_length_file
    with pytest.raises(DatasetError, match=r"empty after filtering.*rollout\.max_prompt_length.*data\.overlong_prompts"):
        load(path, tokenizer, max_prompt_length=min(map(len, full)) - 1, overlong_prompts="drop")


# ----------------------------------------------------------------------------- error cases


def test_missing_file(tmp_path, tokenizer):
    with pytest.raises(DatasetError, match=r"nope\.parquet: file not found.*data\.val_files"):
        load(tmp_path / "nope.parquet", tokenizer, name="val")


def test_no_files_and_bad_suffix(tmp_path, tokenizer):
    with pytest.raises(DatasetError, match=r"data\.train_files"):
        PromptDataset.load([], tokenizer, max_prompt_length=10)
    (tmp_path / "data.csv").write_text("a,b\n")
    with pytest.raises(DatasetError, match=r"unsupported file type '\.csv'"):
        load(tmp_path / "data.csv", tokenizer)


def test_empty_files(tmp_path, tokenizer):
    (tmp_path / "empty.jsonl").write_text("\n\n")
    with pytest.raises(DatasetError, match=r"empty\.jsonl: the file has no records"):
        load(tmp_path / "empty.jsonl", tokenizer)
    table = pa.Table.from_pylist(arithmetic_records(1)).slice(0, 0)
    pq.write_table(table, tmp_path / "empty.parquet")
    with pytest.raises(DatasetError, match=r"empty\.parquet: the file has no records"):
        load(tmp_path / "empty.parquet", tokenizer)


def test_missing_prompt_field_lists_what_was_found(tmp_path, tokenizer):
    table = pa.Table.from_pylist([{"question": "What is 1 + 1?", "reward_model": {"ground_truth": "2"}}])
    pq.write_table(table, tmp_path / "noprompt.parquet")
    with pytest.raises(DatasetError) as err:
        load(tmp_path / "noprompt.parquet", tokenizer)
    message = str(err.value)
    assert "row 0" in message and "'prompt'" in message and "data.prompt_key" in message and "question" in message


def test_missing_ground_truth_says_what_was_found(tmp_path, tokenizer):
    path = tmp_path / "qa.jsonl"
    write_jsonl(path, [{"prompt": "What is 1 + 1?", "reward_model": {"ground_truth": "2"}},
                       {"prompt": "What is 2 + 2?", "answer": "4"}])  # fmt: skip
    with pytest.raises(DatasetError) as err:
        load(path, tokenizer)
    message = str(err.value)
    assert "line 2" in message and "reward_model.ground_truth" in message
    assert "'answer'" in message and "tools/prepare_data.py" in message
    write_jsonl(path, [{"prompt": "x", "reward_model": {"style": "rule"}}])
    with pytest.raises(DatasetError, match=r"line 1: missing reward_model\.ground_truth \(found reward_model=\{'style': 'rule'\}"):
        load(path, tokenizer)


@pytest.mark.parametrize(
    "bad_line, expected",
    [
        ('{"prompt": "x", "reward_model": {"ground_truth": "1"}', r"line 2: invalid JSON"),
        ('["not", "an", "object"]', r"line 2: expected a JSON object"),
        ('{"prompt": [{"content": "no role"}], "reward_model": {"ground_truth": "1"}}', r"line 2: message 0 of 'prompt'"),
        ('{"prompt": [], "reward_model": {"ground_truth": "1"}}', r"line 2: the prompt 'prompt' is an empty list"),
        ('{"prompt": 5, "reward_model": {"ground_truth": "1"}}', r"line 2: the prompt 'prompt' must be"),
        ('{"prompt": "x", "reward_model": {"ground_truth": ["1"]}}', r"line 2: reward_model\.ground_truth must be a string"),
        ('{"prompt": "x", "reward_model": {"ground_truth": "1"}, "extra_info": 3}', r"line 2: extra_info must be an object"),
    ],
)
def test_bad_records_name_the_line(tmp_path, tokenizer, bad_line, expected):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"prompt": "ok", "reward_model": {"ground_truth": "1"}}\n' + bad_line + "\n")
    with pytest.raises(DatasetError, match=expected):
        load(path, tokenizer)


def test_invalid_policy_and_limit(tmp_path, tokenizer):
    path = write_records(arithmetic_records(1), tmp_path / "one.jsonl")
    with pytest.raises(DatasetError, match="data.overlong_prompts"):
        load(path, tokenizer, overlong_prompts="shorten")
    with pytest.raises(DatasetError, match="rollout.max_prompt_length"):
        load(path, tokenizer, max_prompt_length=0)


def test_corrupt_parquet(tmp_path, tokenizer):
    (tmp_path / "broken.parquet").write_bytes(b"this is not parquet")
    with pytest.raises(DatasetError, match=r"broken\.parquet: not a readable parquet file"):
        load(tmp_path / "broken.parquet", tokenizer)
