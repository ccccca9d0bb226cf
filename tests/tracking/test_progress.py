"""ProgressBar (plain lines off a terminal, tqdm on one, ETA, resume) and PhaseTimer (timing_s/ metrics)."""

from __future__ import annotations

import io
import re
import time

import pytest

from megatron_dapo.tracking import PhaseTimer, ProgressBar


class FakeClock:
    """A clock the test advances by hand, so ETAs are exact."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class TerminalStream(io.StringIO):
    def isatty(self) -> bool:
        return True


# ------------------------------------------------------------------ ProgressBar, not a terminal


def test_plain_lines_at_each_ten_percent_with_exact_eta():
    clock, out = FakeClock(), io.StringIO()
    with ProgressBar(100, file=out, clock=clock, line_every_percent=10) as bar:
        for step in range(1, 101):
            clock.now += 2.0  # 2 s per step
            bar.update(step, {"critic/score/mean": step / 200, "actor/pg_loss": 1.0})
    lines = out.getvalue().splitlines()
    assert "\r" not in out.getvalue()
    assert [int(re.match(r"train (\d+)/100", line).group(1)) for line in lines] == [1, *range(10, 101, 10)]
    # step 10: 20 s elapsed, 90 steps left at 2 s -> 3 minutes.
    assert lines[1] == "train 10/100 (10%) | elapsed 00:20 | eta 03:00 | 2 s/step | score=0.05"
    assert lines[-1].startswith("train 100/100 (100%) | elapsed 03:20 | eta 00:00")


def test_resume_starts_at_initial_and_rates_only_this_process():
    clock, out = FakeClock(), io.StringIO()
    bar = ProgressBar(100, initial=50, file=out, clock=clock)
    clock.now += 4.0
    bar.update(51)
    assert bar.eta_seconds() == pytest.approx(49 * 4.0)
    bar.close()
    assert out.getvalue().splitlines() == ["train 51/100 (51%) | elapsed 00:04 | eta 03:16 | 4 s/step"]


def test_heartbeat_line_and_final_line_on_close():
    clock, out = FakeClock(), io.StringIO()
    bar = ProgressBar(1000, file=out, clock=clock, heartbeat_s=60)
    for step in (1, 2, 3):  # 1 %, 10 s apart: only the first is printed
        clock.now += 10
        bar.update(step)
    clock.now += 100
    bar.update(4)  # 110 s since the last line: a heartbeat
    clock.now += 10
    bar.update(5)
    bar.close()  # step 5 was not printed yet
    bar.close()
    assert [line.split(" |")[0] for line in out.getvalue().splitlines()] == [
        "train 1/1000 (0%)", "train 4/1000 (0%)", "train 5/1000 (0%)"
    ]  # fmt: skip


def test_postfix_keeps_last_validation_accuracy_and_matches_by_prefix():
    bar = ProgressBar(10, file=io.StringIO(), clock=FakeClock())
    bar.update(1, {"critic/score/mean": 0.25, "val/acc/mean@16": 0.125, "val/pass@16": 0.5})
    bar.update(2, {"critic/score/mean": 0.375, "response_length/mean": 300.25})
    assert bar.postfix_text() == "score=0.375 val_acc=0.125 len=300.2"


def test_disabled_bar_writes_nothing():
    out = TerminalStream()
    with ProgressBar(10, enabled=False, file=out) as bar:
        bar.update(5, {"critic/score/mean": 1.0})
    assert out.getvalue() == ""


def test_default_stream_is_stderr(capsys):
    with ProgressBar(4) as bar:
        bar.update(1)
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.startswith("train 1/4 (25%)")


# ------------------------------------------------------------------ ProgressBar, terminal


def test_terminal_renders_a_tqdm_bar_from_the_initial_step():
    out = TerminalStream()
    with ProgressBar(10, initial=3, file=out) as bar:
        bar.update(5, {"critic/score/mean": 0.5})
    text = out.getvalue()
    assert bar.is_terminal and "\r" in text
    assert "3/10" in text and "5/10" in text and "score=0.5" in text and "step" in text


# ------------------------------------------------------------------ PhaseTimer


def test_timer_accumulates_repeated_and_nested_phases():
    clock = FakeClock()
    timer = PhaseTimer(clock=clock)
    with timer.phase("step"):
        for seconds in (3.0, 4.0):  # dynamic sampling generates twice
            with timer.phase("gen"):
                clock.now += seconds
        with timer.phase("update"):
            clock.now += 2.5
    assert timer.metrics() == {"timing_s/step": 9.5, "timing_s/gen": 7.0, "timing_s/update": 2.5}
    timer.add("sync", 0.5)
    assert timer.seconds("sync") == 0.5 and timer.seconds("never") == 0.0
    timer.reset()
    assert timer.metrics() == {}


def test_timer_counts_a_phase_that_raises_and_refuses_self_nesting():
    clock = FakeClock()
    timer = PhaseTimer(prefix="t/", clock=clock)
    with pytest.raises(KeyError):
        with timer.phase("reward"):
            clock.now += 1.5
            raise KeyError("boom")
    assert timer.metrics() == {"t/reward": 1.5}
    with pytest.raises(RuntimeError, match="already running"):
        with timer.phase("gen"):
            with timer.phase("gen"):
                pass
    with pytest.raises(RuntimeError, match="running"):
        with timer.phase("ref"):
            timer.reset()


def test_timer_synchronizes_at_both_ends_and_measures_real_time():
    calls = []
    timer = PhaseTimer(synchronize=lambda: calls.append("sync"))
    with timer.phase("gen"):
        time.sleep(0.02)
    assert calls == ["sync", "sync"]
    assert 0.02 <= timer.seconds("gen") < 1.0
