"""`megatron-dapo prepare-data` as a user runs it, through tools/prepare_data.py in this process: the
records written (read back by the trainer's dataset), the held-out validation set, and bad input
as one line with exit code 2. The library: tests/data/test_prepare.py."""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

import pytest

from megatron_dapo.data.dataset import DatasetError, PromptDataset
from megatron_dapo.data.prepare import DAPO_INSTRUCTION_PREFIX, DAPO_INSTRUCTION_SUFFIX, read_records
from tests.support.questions import QUESTIONS

REPO_ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("prepare_data_script", REPO_ROOT / "tools" / "prepare_data.py")
prepare_data = importlib.util.module_from_spec(_spec)  # tools/prepare_data.py, the plain script
_spec.loader.exec_module(prepare_data)


@pytest.fixture()
def questions_file(tmp_path) -> Path:
    path = tmp_path / "questions.jsonl"
    path.write_text("".join(json.dumps(q) + "\n" for q in QUESTIONS))
    return path


def test_cli_round_trip_into_the_dataset(questions_file, tmp_path, tokenizer, capsys):
    output = tmp_path / "train.parquet"
    assert prepare_data.main(["--input", str(questions_file), "--output", str(output), "--data-source", "my/math"]) == 0
    assert f"wrote 5 records to {output}" in capsys.readouterr().out
    dataset = PromptDataset.load([output], tokenizer, max_prompt_length=512)
    assert [e.ground_truth for e in dataset] == ["2", "6", "27", "\\frac{5}{2}", "-1"]
    for example, question in zip(dataset, QUESTIONS):
        decoded = tokenizer.decode(example.prompt_ids)
        assert decoded == (
            "<|im_start|>user\n" + DAPO_INSTRUCTION_PREFIX + question["question"] + DAPO_INSTRUCTION_SUFFIX
            + "<|im_end|>\n<|im_start|>assistant\n"
        )  # fmt: skip
        assert example.data_source == "my/math"
        assert example.extra_info["split"] == "train"


def test_cli_holds_out_a_validation_set(questions_file, tmp_path):
    def split(seed: int):
        train, val = tmp_path / f"train{seed}.jsonl", tmp_path / f"val{seed}.parquet"
        argv = ["--input", str(questions_file), "--output", str(train), "--val-output", str(val), "--val-size", "2",
                "--seed", str(seed)]  # fmt: skip
        assert prepare_data.main(argv) == 0
        return read_records(train), read_records(val)

    train, val = split(seed=3)
    assert (len(train), len(val)) == (3, 2)
    train_index = [r["extra_info"]["index"] for r in train]
    val_index = [r["extra_info"]["index"] for r in val]
    assert sorted(train_index + val_index) == list(range(5)) and train_index == sorted(train_index)
    assert {r["extra_info"]["split"] for r in train} == {"train"} and {r["extra_info"]["split"] for r in val} == {"test"}
    for record in train + val:  # each record still carries its own question's answer
        assert record["reward_model"]["ground_truth"] == str(QUESTIONS[record["extra_info"]["index"]]["answer"])
    assert split(seed=3) == (train, val), "the hold-out is deterministic"
    assert any(split(seed=s)[1] != val for s in range(4, 10)), "and depends on the seed"


@pytest.mark.parametrize(
    "lines, extra_args, expected",
    [
        (['{"question": "a", "answer": "1"}', '{"question": "b", "answer": '], [], r"line 2: invalid JSON"),
        (['{"question": "a", "answer": "1"}', "", '{"question": "b"}'], [], r"line 3: missing 'answer'"),
        (['{"question": "", "answer": "1"}'], [], r"line 1: 'question' is empty"),
        (['{"question": "a", "answer": "1"}', '{"question": null, "answer": "2"}'], [], r"line 2: 'question' is null"),
        (['{"question": "a", "answer": [1]}'], [], r"line 1: 'answer' must be a string"),
        (["[1, 2]"], [], r"line 1: expected a JSON object"),
        ([""], [], r"no questions in the input"),
        (['{"question": "a", "answer": "1"}'], ["--val-size", "1"], r"--val-output and --val-size go together"),
        (['{"question": "a", "answer": "1"}'] * 3, ["--val-output", "v.jsonl", "--val-size", "3"], r"--val-size must be between 1 and 2"),
    ],
)
def test_cli_errors_name_the_problem(tmp_path, capsys, monkeypatch, lines, extra_args, expected):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "in.jsonl").write_text("\n".join(lines) + "\n")
    assert prepare_data.main(["--input", "in.jsonl", "--output", "out.parquet", *extra_args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("megatron-dapo: error: ") and re.search(expected, err), err
    assert not (tmp_path / "out.parquet").exists()


@pytest.mark.parametrize("suffix", [".jsonl", ".json"])
def test_input_that_is_not_utf8_names_the_line(tmp_path, capsys, suffix):
    """A Latin-1 file (e.g. exported from a spreadsheet): the line and byte, not a UnicodeDecodeError."""
    source = tmp_path / f"in{suffix}"
    lines = ['{"question": "What is 1 + 1?", "answer": "2"}', '{"question": "Caf\u00e9: 2 + 2?", "answer": "4"}']
    source.write_bytes(("\n".join(lines) + "\n").encode("latin-1"))
    assert prepare_data.main(["--input", str(source), "--output", str(tmp_path / "o.parquet")]) == 2
    err = capsys.readouterr().err
    assert f"in{suffix} line 2: not UTF-8 text (byte 18 of the line is 0xe9)" in err and "Traceback" not in err
    assert not (tmp_path / "o.parquet").exists()
    from megatron_dapo.data.dataset import iter_records  # the trainer's reader of data.train_files says the same

    with pytest.raises(DatasetError, match="line 2: not UTF-8"):
        list(iter_records(source))


def test_cli_missing_input_and_bad_output(tmp_path, capsys):
    assert prepare_data.main(["--input", str(tmp_path / "none.jsonl"), "--output", str(tmp_path / "o.parquet")]) == 2
    assert "none.jsonl: input file not found" in capsys.readouterr().err
    (tmp_path / "q.jsonl").write_text('{"question": "a", "answer": "1"}\n')
    assert prepare_data.main(["--input", str(tmp_path / "q.jsonl"), "--output", str(tmp_path / "o.txt")]) == 2
    assert "must end in .parquet or .jsonl" in capsys.readouterr().err
