"""The multi-process test harness itself: a hung child is stopped at the timeout and leaves its
threads' stacks and its state (still running, result written or not) in the output, so a CI log
says where it hung; ranks forked from the preloaded zygote behave as torchrun's."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support import harness_worker
from tests.support.torchrun_utils import REPO_ROOT, _child_env, run_module_forked, run_slurm_function, run_torchrun_function

WORKER = Path(harness_worker.__file__)


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


# ---- ranks forked from the preloaded zygote (rank_zygote) -------------------------------------


@pytest.fixture(autouse=True)
def _zygote_launcher(monkeypatch, request):
    if "forked" in request.node.name or "run_fresh" in request.node.name:
        monkeypatch.setenv("TORCHRUN_TEST_LAUNCHER", "zygote")


def test_forked_ranks_get_torchrun_environment():
    result = run_torchrun_function(WORKER, "environment", nproc=2, timeout=120).check()
    envs = [r["env"] for r in result.rank_results]
    assert [(e["RANK"], e["LOCAL_RANK"], e["WORLD_SIZE"], e["LOCAL_WORLD_SIZE"]) for e in envs] == [("0", "0", "2", "2"), ("1", "1", "2", "2")]
    assert envs[0]["MASTER_ADDR"] == "127.0.0.1" and envs[0]["MASTER_PORT"] == envs[1]["MASTER_PORT"]


def test_a_failing_forked_rank_stops_the_others_as_torchrun_does():
    result = run_torchrun_function(WORKER, "one_rank_fails", nproc=2, timeout=120)
    assert not result.timed_out and result.returncode == 1  # torchrun's exit code for a failed rank
    assert "RuntimeError: rank 1 failed on purpose" in result.output


def test_a_module_run_forked_splits_streams_and_exits_as_the_command_would(tmp_path):
    env = {**_child_env(None, None), "OMP_NUM_THREADS": "2"}
    one = run_module_forked("tests.support.harness_worker", ["3"], nproc=1, env=env, cwd=tmp_path, timeout=120)
    assert one is not None and one.returncode == 3
    assert one.stdout == "out rank=None threads=2 argv=['3']\n" and one.stderr.endswith(f"err {tmp_path}\n")
    two = run_module_forked("tests.support.harness_worker", ["0"], nproc=2, env=env, cwd=tmp_path, timeout=120)
    assert two.returncode == 0 and two.stdout.splitlines() == ["out rank=0 threads=2 argv=['0']", "out rank=1 threads=2 argv=['0']"]
    failed = run_module_forked("tests.support.harness_worker", ["5"], nproc=2, env=env, cwd=tmp_path, timeout=120)
    assert failed.returncode == 1  # torchrun's, whatever the ranks' codes


def test_a_variable_read_at_import_time_makes_the_command_run_fresh(tmp_path):
    env = {**_child_env(None, None), "TORCH_LOGS": "dynamo"}
    assert run_module_forked("tests.support.harness_worker", ["0"], nproc=1, env=env, cwd=tmp_path, timeout=120) is None


def test_a_dead_zygote_is_named_and_replaced(monkeypatch, tmp_path):
    from tests.support import rank_zygote

    monkeypatch.setenv("TORCHRUN_TEST_LAUNCHER", "zygote")
    env = _child_env(None, None)
    first = rank_zygote.shared_zygote(env)
    first._proc.kill()
    first._proc.wait()
    with pytest.raises(RuntimeError, match=r"zygote is gone \(exit status -9\); the end of its output"):
        first.launch([env], tmp_path, entry=str(WORKER))
    second = rank_zygote.shared_zygote(env)
    assert second is not first and second._proc.poll() is None
    assert run_torchrun_function(WORKER, "finish", nproc=1, use_torchrun=False, timeout=120).check().rank_results == [{"done": True}]


def test_a_launch_the_dead_zygote_cannot_take_starts_with_torchrun(monkeypatch, capsys):
    """The zygote died between the check for a live one and the launch: the launch still runs."""
    from tests.support import rank_zygote

    monkeypatch.setenv("TORCHRUN_TEST_LAUNCHER", "zygote")
    dead = rank_zygote.shared_zygote(_child_env(None, None))
    dead._proc.kill()
    dead._proc.wait()
    monkeypatch.setattr(rank_zygote, "shared_zygote", lambda env: dead)
    result = run_torchrun_function(WORKER, "finish", nproc=1, use_torchrun=False, timeout=120).check()
    assert result.rank_results == [{"done": True}]
    assert "zygote is gone" in capsys.readouterr().err
    env = {**_child_env(None, None), "OMP_NUM_THREADS": "1"}
    assert run_module_forked("tests.support.harness_worker", ["0"], nproc=1, env=env, cwd=REPO_ROOT, timeout=120) is None


def test_launch_slots_bound_the_launches_of_every_worker(tmp_path, monkeypatch):
    """Two slots: a third launch waits until one ends, whichever process or thread holds them; a
    thread that holds one takes none more (nested launches do not wait on themselves)."""
    import threading
    import time

    from tests.support.torchrun_utils import LAUNCH_SLOTS_ENV, launch_slot

    monkeypatch.setenv(LAUNCH_SLOTS_ENV, "2")
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    holder = subprocess.Popen(  # another pytest worker holding one slot
        [sys.executable, "-c", "import sys, time; sys.path.insert(0, sys.argv[1]); from tests.support.torchrun_utils import launch_slot\n"
         "with launch_slot():\n    print('held', flush=True); time.sleep(3)", str(REPO_ROOT)],
        env={**os.environ, LAUNCH_SLOTS_ENV: "2", "TMPDIR": str(tmp_path)}, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    assert holder.stdout.readline().strip() == "held"
    entered: list[float] = []
    with launch_slot():  # the second slot
        with launch_slot():  # nested: no wait, no third slot
            pass
        start = time.monotonic()
        waiter = threading.Thread(target=lambda: launch_slot().__enter__() or entered.append(time.monotonic() - start))
        waiter.start()
        time.sleep(0.5)
        assert entered == []  # both slots are taken
    waiter.join(timeout=10)
    assert entered and entered[0] < 2.5  # it got ours when we left, not the other process's
    holder.wait(timeout=10)
