"""RewardManager: scores against an independent per-sample loop, failures of the reward function
(raising, unusable return values), worker loading of user functions, keyword passing. What the
worker pool does about hangs, crashes and signals: test_pool.py."""

from __future__ import annotations

import logging
import os
import textwrap

import pytest
import torch

from megatron_dapo.reward.loader import load_reward_function
from megatron_dapo.reward.manager import RewardManager
from megatron_dapo.reward.math_dapo import compute_score

from tests.support import reward_functions as fx
from tests.support.reward_functions import char_batch

MAX_LEN, BUFFER, FACTOR = 60, 20, 1.0
OVERLONG = dict(
    overlong_enable=True, overlong_buffer_length=BUFFER, overlong_penalty_factor=FACTOR, max_response_length=MAX_LEN
)

TEXTS = [
    "We add them.\nAnswer: 12",
    "answer: 13",
    "So the result is \\boxed{7}.",
    "I give up",
    "",
    "Long reasoning " * 3 + "Answer: 1,000",  # 45 + 13 characters: inside the overlong buffer
    "x" * 59 + "Answer: 3",  # over the max length (with its EOS token)
    "Answer: \\frac12",
    "R\u00e9sultat: \u03c0\nAnswer: \u03c0",
]
TRUTHS = ["12", "12", "7", "5", "5", "1000", "3", "\\frac{1}{2}", "\u03c0"]


def eq13(length: int) -> float:
    if length <= MAX_LEN - BUFFER:
        return 0.0
    if length <= MAX_LEN:
        return ((MAX_LEN - BUFFER) - length) / BUFFER * FACTOR
    return -FACTOR


def reference(texts, truths, lengths):
    """Independent loop: compute_score on each text plus eq. 13 in python floats."""
    results = [compute_score(t, g) for t, g in zip(texts, truths)]
    scores = torch.tensor([r["score"] + eq13(n) for r, n in zip(results, lengths)], dtype=torch.float32)
    return scores, torch.tensor([r["acc"] for r in results]), [r["pred"] for r in results]


def padded(ids):
    width = max(len(i) for i in ids) + 3
    out = torch.full((len(ids), width), fx.PAD_ID, dtype=torch.int64)
    for row, seq in enumerate(ids):
        out[row, : len(seq)] = torch.tensor(seq, dtype=torch.int64)
    return out


@pytest.fixture(scope="module")
def hf_tokenizer():
    return fx.build_hf_tokenizer(TEXTS * 5 + ["Answer: 0123456789 \\boxed{} \\frac{}{} hang spin sleep boom die"])


# ------------------------------------------------------------------------------------------
# Correctness against the independent loop
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("num_workers", [0, 2])
def test_char_tokenizer_matches_reference(num_workers):
    ids, lengths = char_batch(TEXTS)
    want_scores, want_acc, want_preds = reference(TEXTS, TRUTHS, lengths)
    with RewardManager(fx.CharTokenizer(), num_workers=num_workers, chunk_size=2, **OVERLONG) as manager:
        got = manager.score(ids, TRUTHS)
        got_padded = manager.score(padded(ids), TRUTHS, torch.tensor(lengths))
    for result in (got, got_padded):
        assert result.responses == TEXTS
        assert torch.equal(result.scores, want_scores)
        assert torch.equal(result.acc, want_acc) and result.acc.dtype == torch.bool
        assert result.preds == want_preds
        assert torch.equal(result.raw_scores, torch.tensor([compute_score(t, g)["score"] for t, g in zip(TEXTS, TRUTHS)]))
        assert torch.equal(result.overlong_penalty, torch.tensor([eq13(n) for n in lengths], dtype=torch.float32))
        assert not result.failed.any()
    # The batch really exercises both signs of the score and the penalty.
    assert want_acc.any() and not want_acc.all() and (got.overlong_penalty < 0).sum() == 2


@pytest.mark.parametrize("decode_in_workers", [True, False])
def test_hf_tokenizer_matches_reference(hf_tokenizer, decode_in_workers):
    encoded = [hf_tokenizer.encode(t, add_special_tokens=False) + [hf_tokenizer.eos_token_id] for t in TEXTS]
    lengths = [len(e) for e in encoded]
    texts = [hf_tokenizer.decode(e, skip_special_tokens=True) for e in encoded]
    assert texts == TEXTS  # byte-level BPE round-trips exactly
    settings = dict(OVERLONG, max_response_length=max(lengths) - 2, overlong_buffer_length=10)
    pooled = RewardManager(hf_tokenizer, num_workers=2, decode_in_workers=decode_in_workers, chunk_size=3, **settings)
    with pooled as manager:
        assert manager.decode_in_workers is decode_in_workers
        got = manager.score(padded(encoded), TRUTHS, torch.tensor(lengths))
    inline = RewardManager(hf_tokenizer, num_workers=0, **settings).score(encoded, TRUTHS)
    assert got.responses == TEXTS == inline.responses
    assert torch.equal(got.scores, inline.scores) and torch.equal(got.acc, inline.acc) and got.preds == inline.preds
    assert (got.overlong_penalty < 0).any()


def test_lengths_cut_list_inputs_and_edge_rows():
    tok = fx.CharTokenizer()
    ids = [tok.encode("Answer: 5 trailing junk"), [], [fx.PAD_ID] * 4]
    manager = RewardManager(tok)
    result = manager.score(ids, ["5", "5", "5"], [9, 0, 4])  # first cut right after 'Answer: 5'
    assert result.responses == ["Answer: 5", "", ""]  # all-padding row decodes to ''
    assert result.scores.tolist() == [1.0, -1.0, -1.0]
    assert result.preds == ["5", "[INVALID]", "[INVALID]"]


def test_all_padding_rows_in_a_padded_tensor():
    manager = RewardManager(fx.CharTokenizer(), num_workers=0, **OVERLONG)
    result = manager.score(torch.zeros(3, 5, dtype=torch.long), ["1", "2", "3"], torch.zeros(3, dtype=torch.long))
    assert result.responses == ["", "", ""] and result.scores.tolist() == [-1.0] * 3


@pytest.mark.parametrize("num_workers", [0, 1])
def test_empty_batch(num_workers):
    with RewardManager(fx.CharTokenizer(), num_workers=num_workers, **OVERLONG) as manager:
        result = manager.score([], [])
    assert result.scores.shape == (0,) and result.responses == [] and result.preds == []


def test_input_validation():
    manager = RewardManager(fx.CharTokenizer())
    ids = torch.ones(2, 4, dtype=torch.long)
    with pytest.raises(ValueError, match="response_lengths is required"):
        manager.score(ids, ["1", "2"])
    with pytest.raises(ValueError, match="outside"):
        manager.score(ids, ["1", "2"], [2, 5])
    with pytest.raises(ValueError, match="outside"):
        manager.score([[1, 2]], ["1"], [-1])
    with pytest.raises(ValueError, match="ground_truths has 1 entries for 2"):
        manager.score(ids, ["1"], [1, 1])
    with pytest.raises(ValueError, match="integer"):
        manager.score(ids.float(), ["1", "2"], [1, 1])
    with pytest.raises(ValueError, match="extra_infos"):
        manager.score([[1]], ["1"], extra_infos=[{}, {}])


def test_constructor_validation():
    with pytest.raises(ValueError, match="reward.num_workers"):
        RewardManager(fx.CharTokenizer(), num_workers=-1)
    with pytest.raises(ValueError, match="reward.timeout_s"):
        RewardManager(fx.CharTokenizer(), timeout_s=0)
    with pytest.raises(ValueError, match="algorithm.overlong_buffer.len"):
        RewardManager(fx.CharTokenizer(), overlong_enable=True, overlong_buffer_length=100, max_response_length=50)
    with pytest.raises(ValueError, match="rollout.max_response_length"):
        RewardManager(fx.CharTokenizer(), overlong_enable=True, overlong_buffer_length=10)
    with pytest.raises(ValueError, match="cannot be sent to worker processes"):
        RewardManager(fx.CharTokenizer(), lambda r, g: 1.0, num_workers=1)
    # In-process scoring takes any callable.
    assert RewardManager(fx.CharTokenizer(), lambda r, g: 1.0).score([[66]], ["x"]).scores.tolist() == [1.0]


def test_overlong_switches():
    ids, lengths = char_batch(TEXTS)
    on = RewardManager(fx.CharTokenizer(), **OVERLONG)
    off = RewardManager(fx.CharTokenizer(), **dict(OVERLONG, overlong_enable=False))
    raw = on.score(ids, TRUTHS).raw_scores
    for result in (on.score(ids, TRUTHS, apply_overlong=False), off.score(ids, TRUTHS)):
        assert torch.equal(result.scores, raw) and not result.overlong_penalty.any()
    # Validation applies it by default (algorithm.overlong_buffer.apply_in_validation = True).
    assert torch.equal(on.score(ids, TRUTHS, validating=True).scores, on.score(ids, TRUTHS).scores)


# ------------------------------------------------------------------------------------------
# Return values and failures
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("num_workers", [0, 2])
def test_raising_scorer_gets_min_reward_and_a_warning(num_workers, caplog):
    texts = ["fine one", "boom here", "fine two", "boom again"]
    ids, _ = char_batch(texts)
    caplog.set_level(logging.WARNING, logger="megatron_dapo.reward")
    with RewardManager(fx.CharTokenizer(), fx.raises_on_boom, num_workers=num_workers, min_reward=-2.0) as manager:
        result = manager.score(ids, ["x"] * 4)
    assert result.failed.tolist() == [False, True, False, True]
    assert result.scores.tolist() == [0.5, -2.0, 0.5, -2.0]
    assert result.acc.tolist() == [True, False, True, False]  # no "acc" in the dict: score > 0
    assert result.preds == ["one", None, "two", None]
    messages = [r.getMessage() for r in caplog.records if r.name == "megatron_dapo.reward"]
    assert len(messages) == 2 and all("scorer exploded" in m and "min_reward=-2" in m for m in messages)
    # each failure's reason travels with the sample, and the manager counts them (the trainer names
    # them when they empty dynamic sampling)
    assert result.errors == [None, "RuntimeError: scorer exploded", None, "RuntimeError: scorer exploded"]
    assert (manager.samples_scored, manager.samples_failed) == (4, 2)
    assert manager.first_failure == "RuntimeError: scorer exploded"


def test_unusable_return_values_fail_the_sample():
    texts = ["nan", "nodict", "text", "ok"]
    result = RewardManager(fx.CharTokenizer(), fx.returns_garbage).score(char_batch(texts)[0], ["g"] * 4)
    assert result.failed.tolist() == [True, True, True, False]
    assert result.scores.tolist() == [-1.0, -1.0, -1.0, -0.5]
    assert result.acc.tolist() == [False, False, False, True]  # an explicit "acc" wins over the score
    assert isinstance(result.preds[3], str) and result.preds[3].startswith("<object")


def test_float_scorer_acc_from_sign():
    result = RewardManager(fx.CharTokenizer(), fx.answer_is_ground_truth).score(char_batch(["is 5", "is 6"])[0], ["5", "5"])
    assert result.scores.tolist() == [1.0, 0.0] and result.acc.tolist() == [True, False] and result.preds == [None, None]


# ------------------------------------------------------------------------------------------
# User functions and keyword arguments
# ------------------------------------------------------------------------------------------


def _write_user_scorer(tmp_path):
    path = tmp_path / "user_reward.py"
    path.write_text(
        textwrap.dedent(
            """
            import os

            def score_len(response, ground_truth):
                return {"score": float(len(response)), "pred": os.getpid()}
            """
        )
    )
    return path


@pytest.mark.parametrize("start_method", [None, "spawn"])
def test_user_scorer_from_a_file_path_runs_in_workers(tmp_path, start_method):
    spec = f"{_write_user_scorer(tmp_path)}:score_len"
    texts = ["a", "bb", "ccc", "dddd"]
    with RewardManager(fx.CharTokenizer(), spec, num_workers=2, chunk_size=1, start_method=start_method) as manager:
        result = manager.score(char_batch(texts)[0], ["g"] * 4)
    assert result.scores.tolist() == [1.0, 2.0, 3.0, 4.0] and not result.failed.any()
    assert os.getpid() not in result.preds  # scored in other processes


def test_loaded_file_function_given_as_callable_runs_in_workers(tmp_path):
    function = load_reward_function(str(_write_user_scorer(tmp_path)), "score_len")
    with RewardManager(fx.CharTokenizer(), function, num_workers=1) as manager:
        assert manager.score(char_batch(["xyz"])[0], ["g"]).scores.tolist() == [3.0]


def test_module_function_spec_runs_in_workers():
    texts = ["The answer is 5", "The answer is 6"]
    with RewardManager(fx.CharTokenizer(), "tests.support.reward_functions:answer_is_ground_truth", num_workers=2) as manager:
        assert manager.score(char_batch(texts)[0], ["5", "5"]).scores.tolist() == [1.0, 0.0]


@pytest.mark.parametrize("num_workers", [0, 1])
def test_validating_flag_reaches_functions_that_accept_it(num_workers):
    ids = char_batch(["x"])[0]
    with RewardManager(fx.CharTokenizer(), fx.sees_validating, num_workers=num_workers) as manager:
        assert manager.score(ids, ["g"]).preds == ["validating=False"]
        assert manager.score(ids, ["g"], validating=True).preds == ["validating=True"]
    # A function without the keyword (the default math reward) is called without it.
    result = RewardManager(fx.CharTokenizer(), num_workers=0).score(char_batch(["Answer: 4"])[0], ["4"], validating=True)
    assert result.scores.tolist() == [1.0]


@pytest.mark.parametrize("num_workers", [0, 1])
def test_data_source_and_extra_info_passing(num_workers):
    ids = char_batch(["x", "y"])[0]
    sources, infos = ["math", "aime"], [{"i": 0}, {"i": 1}]
    with RewardManager(fx.CharTokenizer(), fx.sees_everything, num_workers=num_workers) as manager:
        preds = manager.score(ids, ["g", "g"], data_sources=sources, extra_infos=infos).preds
    assert preds == [
        repr([("data_source", "math"), ("extra_info", {"i": 0}), ("validating", False)]),
        repr([("data_source", "aime"), ("extra_info", {"i": 1}), ("validating", False)]),
    ]
    only_source = RewardManager(fx.CharTokenizer(), fx.sees_data_source_only)
    assert only_source.score(ids, ["g", "g"], data_sources=sources, extra_infos=infos).preds == sources


def test_the_workers_start_without_torch(tmp_path, hf_tokenizer):
    """The forkserver preloads the workers' task module (`reward.scoring`) and the tokenizer's, not
    torch: ~2 s less before every run's first scoring. A worker reports what it has imported."""
    path = tmp_path / "probe.py"
    path.write_text("import sys\n\ndef probe(response, ground_truth):\n    return {'score': 0.0, 'pred': 'torch' in sys.modules}\n")
    ids = [hf_tokenizer.encode(t, add_special_tokens=False) for t in TEXTS[:2]]
    with RewardManager(hf_tokenizer, f"{path}:probe", num_workers=1, decode_in_workers=True) as manager:
        result = manager.score(ids, ["0"] * 2)
    assert not result.failed.any() and result.preds == [False, False]
