"""The call counter and the parity score that the preemption tests' reward files share
(tests/support/reward_functions.py), and one of those files loaded by path as the trainer loads it."""

from __future__ import annotations

from pathlib import Path

from megatron_dapo.reward.loader import load_reward_function
from tests.support.reward_functions import CALLS_FILE_ENV, count_call, parity_score

TESTS = Path(__file__).resolve().parent


def test_count_call_is_true_at_the_nth_call_only_and_counts_in_the_file(tmp_path, monkeypatch):
    calls = tmp_path / "calls"
    monkeypatch.setenv(CALLS_FILE_ENV, str(calls))
    monkeypatch.setenv("AT", "3")
    assert [count_call(at="AT") for _ in range(5)] == [False, False, True, False, False]
    assert calls.read_bytes() == b"....."
    monkeypatch.delenv("AT")
    assert not count_call(at="AT")  # unset: never
    assert calls.stat().st_size == 6


def test_count_call_counts_nothing_without_the_calls_file(tmp_path, monkeypatch):
    monkeypatch.delenv(CALLS_FILE_ENV, raising=False)
    monkeypatch.setenv("AT", "1")
    assert not count_call(at="AT")
    assert list(tmp_path.iterdir()) == []


def test_parity_score_is_parity_rewards():
    parity_reward = load_reward_function(str(TESTS / "trainer" / "parity_reward.py"), "compute_score")
    for response in ("", "a", "ab", "abc"):
        for answer in ("0", "1", "7"):
            assert parity_score(response, answer) == parity_reward(response, answer)
    assert parity_score("ab", "4") == {"score": 1.0, "acc": True, "pred": "2"}
    assert parity_score("ab", "3") == {"score": -1.0, "acc": False, "pred": "2"}


def test_a_reward_file_loaded_by_path_acts_at_the_chosen_call(tmp_path, monkeypatch):
    mark = tmp_path / "mark"
    monkeypatch.setenv(CALLS_FILE_ENV, str(tmp_path / "calls"))
    monkeypatch.setenv("MDAPO_TEST_MARK", str(mark))
    monkeypatch.setenv("MDAPO_TEST_MARK_AT_CALL", "2")
    monkeypatch.setenv("MDAPO_TEST_MARK_PAUSE_S", "0")
    score = load_reward_function(str(TESTS / "slurm" / "preempt_mark_reward.py"), "compute_score")
    assert score("abc", "1") == {"score": 1.0, "acc": True, "pred": "3"}
    assert not mark.exists()
    score("abc", "1")
    assert mark.exists()
