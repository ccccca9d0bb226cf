"""The reward worker pool (`reward/pool.py`), through `RewardManager`: a hanging reward function
times out while the others keep their scores, a dying worker costs only its sample, a worker that
cannot load the tokenizer stops the call with what to change, the pool lives across calls until
closed, and SLURM's SIGTERM leaves the workers (and their forkserver) to the trainer."""

from __future__ import annotations

import logging
import os
import time

import pytest

from megatron_dapo.reward.manager import RewardManager

from tests.support import reward_functions as fx
from tests.support.reward_functions import char_batch


@pytest.mark.timeout(120)
def test_hanging_scorer_times_out_while_others_keep_their_scores(caplog):
    texts = [f"sample {i}" for i in range(10)]
    texts[2] = "spin forever"  # pure-python busy loop
    texts[6] = "sleep forever"  # blocked in a system call
    texts[7] = "spin too"  # a second hang in the same chunk as 'sleep'
    ids, _ = char_batch(texts)
    caplog.set_level(logging.WARNING, logger="megatron_dapo.reward")
    with RewardManager(fx.CharTokenizer(), fx.hangs_on_marker, num_workers=2, timeout_s=1.0, chunk_size=4) as manager:
        start = time.monotonic()
        result = manager.score(ids, ["g"] * 10)
        elapsed = time.monotonic() - start
        assert result.failed.nonzero().flatten().tolist() == [2, 6, 7]
        assert result.scores.tolist() == [2.0, 2.0, -1.0, 2.0, 2.0, 2.0, -1.0, -1.0, 2.0, 2.0]
        assert result.responses == texts  # text of the lost samples is decoded by the parent
        assert 1.0 <= elapsed < 15.0, elapsed
        assert any("timed out after 1 s" in r.getMessage() for r in caplog.records)
        # The killed workers were replaced: the next batch is scored normally.
        again = manager.score(char_batch(["a", "b", "c"])[0], ["g"] * 3)
        assert again.scores.tolist() == [2.0, 2.0, 2.0] and not again.failed.any()


def test_worker_that_dies_fails_only_its_sample():
    texts = ["ok", "die now", "ok", "ok", "ok"]
    with RewardManager(fx.CharTokenizer(), fx.exits_on_marker, num_workers=2, chunk_size=5) as manager:
        result = manager.score(char_batch(texts)[0], ["g"] * 5)
    assert result.failed.tolist() == [False, True, False, False, False]
    assert result.scores.tolist() == [1.0, -1.0, 1.0, 1.0, 1.0]


def test_worker_that_cannot_load_the_tokenizer_fails_loudly():
    ids = char_batch(["Answer: 1"])[0]
    with RewardManager(fx.ParentOnlyTokenizer(), num_workers=1) as manager:
        with pytest.raises(RuntimeError, match="loading the tokenizer in a reward worker failed.*decode_in_workers=False"):
            manager.score(ids, ["1"])
    with RewardManager(fx.ParentOnlyTokenizer(), num_workers=1, decode_in_workers=False) as manager:
        assert manager.score(ids, ["1"]).scores.tolist() == [1.0]


def _gone(pid: int, within_s: float = 5.0) -> bool:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.05)
    return False


def test_pool_is_reused_across_calls_and_closed():
    ids = char_batch([str(i) for i in range(8)])[0]
    manager = RewardManager(fx.CharTokenizer(), fx.worker_pid, num_workers=2, chunk_size=1)
    first = set(manager.score(ids, ["g"] * 8).preds)
    second = set(manager.score(ids, ["g"] * 8).preds)
    assert len(first | second) <= 2  # both calls ran on the same (at most two) worker processes
    manager.close()
    assert all(_gone(pid) for pid in first | second)
    # A closed manager starts a fresh pool when used again.
    third = set(manager.score(ids, ["g"] * 8).preds)
    assert third.isdisjoint(first | second)
    manager.close()


_SIGTERM_SCRIPT = """
import multiprocessing.forkserver, os, signal, sys, time
sys.path.insert(0, {repo!r})
from megatron_dapo.reward.manager import RewardManager
from tests.support import reward_functions as fx

def batch(texts):
    tok = fx.CharTokenizer()
    return [tok.encode(t) + [fx.PAD_ID] for t in texts]

def main():
    signal.signal(signal.SIGTERM, lambda *_: print("trainer got SIGTERM", flush=True))
    with RewardManager(fx.CharTokenizer(), num_workers=2, chunk_size=1, start_method={method!r}) as manager:
        first = manager.score(batch(["a", "b"]), ["g", "g"])
        workers = [w.process.pid for w in manager._pool.workers]
        server = multiprocessing.forkserver._forkserver._forkserver_pid
        targets = workers + ([server] if server else [])
        os.killpg(0, signal.SIGTERM) if {whole_group} else [os.kill(pid, signal.SIGTERM) for pid in targets]
        time.sleep(1.0)
        alive = all(w.process.is_alive() for w in manager._pool.workers)
        second = manager.score(batch(["c", "d", "e"]), ["g"] * 3)
        print("alive", alive, "same", [w.process.pid for w in manager._pool.workers] == workers,
              "failed", int(second.failed.sum()), "server", bool(server), flush=True)


if __name__ == '__main__':  # the workers import this file again
    main()
"""


@pytest.mark.parametrize("method", ["forkserver", "spawn"])
def test_reward_workers_leave_slurms_sigterm_to_the_trainer(tmp_path, method):
    """SLURM signals every process of the job: the reward workers (and their forkserver) must keep
    working until the trainer has checkpointed (it decides when to stop, exit 143)."""
    import subprocess
    import sys
    from pathlib import Path

    repo = str(Path(__file__).resolve().parents[2])
    script = tmp_path / "sigterm_pool.py"
    # A fresh interpreter: the forkserver (a per-process singleton) starts with this pool's preload,
    # in a session of its own so that the whole process group can be signalled like SLURM does.
    script.write_text(_SIGTERM_SCRIPT.format(repo=repo, method=method, whole_group=True))
    run = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=240, start_new_session=True)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "trainer got SIGTERM" in run.stdout
    expected = "alive True same True failed 0 server " + ("True" if method == "forkserver" else "False")
    assert expected in run.stdout, run.stdout + run.stderr
