"""The multi-process test harness itself: a hung child is stopped at the timeout and leaves its
threads' stacks and its state (still running, result written or not) in the output, so a CI log
says where it hung."""

from __future__ import annotations

from pathlib import Path

import pytest

from torchrun_utils import run_slurm_function, run_torchrun_function

WORKER = Path(__file__).parent / "_harness_worker.py"


def test_a_hung_slurm_task_is_stopped_with_its_stack_and_state():
    result = run_slurm_function(WORKER, "hang_after_result", ntasks=2, timeout=8)
    assert result.timed_out and result.returncode != 0
    assert result.rank_results == [{"wrote": True}, {"wrote": True}]
    assert "task 0 (stopped while still running; result written)" in result.output
    assert "task 1 (stopped while still running; result written)" in result.output
    assert result.output.count("in hang_after_result") == 2  # each task's stack, from faulthandler
    with pytest.raises(AssertionError, match="timed out"):
        result.check()


def test_a_hung_single_process_prints_its_stack():
    result = run_torchrun_function(WORKER, "hang_after_result", nproc=1, use_torchrun=False, timeout=8)
    assert result.timed_out and result.rank_results == [{"wrote": True}]
    assert "in hang_after_result" in result.output


def test_tasks_that_finish_report_their_exit():
    result = run_slurm_function(WORKER, "finish", ntasks=2, timeout=60).check()
    assert result.rank_results == [{"done": True}, {"done": True}] and not result.timed_out
