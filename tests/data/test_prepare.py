"""Writing verl/DAPO prompt datasets (megatron_dapo/data/prepare.py) and the arithmetic demo's data
(megatron_dapo/data/arithmetic.py). The command, `prepare-data`: tests/cli/test_prepare_data.py."""

from __future__ import annotations


import pytest

from megatron_dapo.data.arithmetic import (
    ARITHMETIC_DATA_SOURCE,
    make_problems,
    worked_solution,
    write_arithmetic_dataset,
)
from megatron_dapo.data.dataset import DatasetError, PromptDataset
from megatron_dapo.data.prepare import (
    DAPO_INSTRUCTION_PREFIX,
    DAPO_INSTRUCTION_SUFFIX,
    make_record,
    prepare_dataset,
    read_records,
    write_records,
)
from tests.support.questions import QUESTIONS


def test_make_record_is_the_dapo_schema():
    record = make_record("What is 1 + 2?", "3", index=4, split="train", data_source="math_dapo")
    assert record == {
        "data_source": "math_dapo",
        "prompt": [{"role": "user", "content": DAPO_INSTRUCTION_PREFIX + "What is 1 + 2?" + DAPO_INSTRUCTION_SUFFIX}],
        "ability": "MATH",
        "reward_model": {"style": "rule", "ground_truth": "3"},
        "extra_info": {"index": 4, "split": "train", "question": "What is 1 + 2?", "answer": "3"},
    }
    assert record["prompt"][0]["content"].startswith("Solve the following math problem step by step.")


@pytest.mark.parametrize("suffix", [".parquet", ".jsonl"])
def test_write_then_read_round_trip_atomically(tmp_path, suffix):
    records = [make_record(q["question"], str(q["answer"]), index=i, split="train") for i, q in enumerate(QUESTIONS)]
    path = write_records(records, tmp_path / "sub" / f"train{suffix}")
    assert path == tmp_path / "sub" / f"train{suffix}"
    assert read_records(path) == records
    assert [p.name for p in path.parent.iterdir()] == [path.name], "no temporary file left behind"
    write_records(records[:2], path)  # overwriting replaces the whole file
    assert read_records(path) == records[:2]


def test_write_refuses_bad_suffix_and_empty(tmp_path):
    with pytest.raises(DatasetError, match=r"use \.parquet or \.jsonl"):
        write_records([{"a": 1}], tmp_path / "x.csv")
    with pytest.raises(DatasetError, match="empty"):
        write_records([], tmp_path / "x.jsonl")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    "lines, extra, expected",
    [
        (['{"question": "a", "answer": "1"}', '{"question": "b", "answer": '], {}, r"line 2: invalid JSON"),
        (['{"question": "a", "answer": "1"}', "", '{"question": "b"}'], {}, r"line 3: missing 'answer'"),
        (['{"question": "", "answer": "1"}'], {}, r"line 1: 'question' is empty"),
        (['{"question": "a", "answer": "1"}', '{"question": null, "answer": "2"}'], {}, r"line 2: 'question' is null"),
        (['{"question": "a", "answer": [1]}'], {}, r"line 1: 'answer' must be a string"),
        (["[1, 2]"], {}, r"line 1: expected a JSON object"),
        ([""], {}, r"no questions in the input"),
        (['{"question": "a", "answer": "1"}'], {"val_size": 1}, r"--val-output and --val-size go together"),
        (['{"question": "a", "answer": "1"}'] * 3, {"val_output": "v.jsonl", "val_size": 3}, r"--val-size must be between 1 and 2"),
        (['{"question": "a", "answer": "1"}'], {"output": "o.txt"}, r"o.txt: the output must end in .parquet or .jsonl"),
        (['{"question": "a", "answer": "1"}'], {"output": "in.jsonl"}, r"the output would overwrite the input"),
    ],
)
def test_prepare_dataset_names_the_problem_before_writing(tmp_path, monkeypatch, lines, extra, expected):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "in.jsonl").write_text("\n".join(lines) + "\n")
    arguments = {"output": "out.parquet", **extra}
    with pytest.raises(DatasetError, match=expected):
        prepare_dataset("in.jsonl", arguments.pop("output"), **arguments)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.jsonl"]


def test_arithmetic_dataset_holds_out_distinct_validation_questions(tmp_path, tokenizer):
    train_path, val_path = write_arithmetic_dataset(tmp_path / "demo", num_train=300, num_val=40, seed=5, max_operand=12)
    assert (train_path.name, val_path.name) == ("train.parquet", "val.parquet")
    train, val = read_records(train_path), read_records(val_path)
    assert (len(train), len(val)) == (300, 40)
    train_questions = {r["extra_info"]["question"] for r in train}
    val_questions = [r["extra_info"]["question"] for r in val]
    assert len(set(val_questions)) == 40 and not train_questions & set(val_questions)
    for record in train + val:  # the ground truth is the arithmetic itself, checked independently
        a, op, b = record["extra_info"]["question"].removeprefix("What is ").removesuffix("?").split()
        assert record["reward_model"]["ground_truth"] == str(int(a) + int(b) if op == "+" else int(a) - int(b))
        assert 0 <= int(a) <= 12 and 0 <= int(b) <= 12
    again = write_arithmetic_dataset(tmp_path / "again", num_train=300, num_val=40, seed=5, max_operand=12)
    assert read_records(again[0]) == train and read_records(again[1]) == val
    assert len(PromptDataset.load([train_path], tokenizer, max_prompt_length=256)) == 300
    # The arithmetic task's records are the schema of `make_record`, and the SFT file holds the same
    # records with the worked solution of their own problem as the response.
    first = train[0]["extra_info"]
    assert train[0] == make_record(first["question"], first["answer"], index=0, split="train", data_source=ARITHMETIC_DATA_SOURCE)
    sft = read_records(write_arithmetic_dataset(tmp_path / "sft", 300, 40, seed=5, max_operand=12, sft_file=tmp_path / "sft.jsonl")[0])
    with_responses = read_records(tmp_path / "sft.jsonl")
    assert sft == train and [{k: v for k, v in r.items() if k != "response"} for r in with_responses] == train
    for record in with_responses:
        a, op, b = record["extra_info"]["question"].removeprefix("What is ").removesuffix("?").split()
        assert record["response"].endswith(f"\nAnswer: {record['reward_model']['ground_truth']}")
        assert f"{a} {op} {b} = {record['reward_model']['ground_truth']}" in record["response"]
    problem = make_problems(1, seed=0)[0]
    assert worked_solution(problem).splitlines()[-1] == f"Answer: {problem.answer}"


def test_arithmetic_dataset_too_small_universe():
    # max_operand=1: 4 sums and 3 differences -> 7 distinct questions.
    with pytest.raises(ValueError, match="only 7 distinct problems"):
        write_arithmetic_dataset("/nonexistent", num_train=5, num_val=7, seed=0, max_operand=1)
