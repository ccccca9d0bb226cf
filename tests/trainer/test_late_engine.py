"""Collectives after independent generation wait on the gather group, not the default group.

Engines generate on their own and may finish minutes apart (issue 17, item 1). The ranks meet on a
gloo group with `rollout.gather_timeout_s` before any tensor moves over the default group (NCCL on
GPUs) with its `trainer.collective_timeout_s`. Here, under torchrun + gloo, the default timeout is
4 s and rank 1's "engine" takes 9 s: the gathers complete. The same run with the meeting moved onto
the default group (`meet_on=dist.group.WORLD`, i.e. the code before the gather group) fails on the
waiting rank after about 4 s, which shows that the first test would fail without the gather group.
"""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path

import pytest

from megatron_dapo.distributed.setup import DEFAULT_GATHER_TIMEOUT_S, gather_group_options
from tests.support.torchrun_utils import run_torchrun_function

WORKER = Path(__file__).parent / "_late_engine_worker.py"
TIMEOUT_S = 4.0  # trainer.collective_timeout_s of these runs
DELAY_S = 9.0  # how much later rank 1's engine finishes: longer than the default timeout


def test_gather_group_is_gloo_with_its_own_timeout():
    assert gather_group_options(7200) == ("gloo", timedelta(hours=2))
    assert gather_group_options(DEFAULT_GATHER_TIMEOUT_S)[1] >= timedelta(hours=1)
    with pytest.raises(ValueError, match="rollout.gather_timeout_s"):
        gather_group_options(0)


def test_rollout_gather_timeout_is_validated():
    from megatron_dapo.config import ConfigError, load_config

    repo = Path(__file__).resolve().parents[2]
    assert load_config(repo / "configs" / "tiny_cpu.yaml", []).rollout.gather_timeout_s >= 3600
    with pytest.raises(ConfigError, match="rollout.gather_timeout_s"):
        load_config(repo / "configs" / "tiny_cpu.yaml", ["rollout.gather_timeout_s=0"])


def test_an_engine_finishing_after_the_collective_timeout_does_not_fail_the_gathers():
    result = run_torchrun_function(
        WORKER, "late_engine", nproc=2, timeout=240,
        kwargs={"timeout_s": TIMEOUT_S, "gather_timeout_s": 120.0, "delay_s": DELAY_S, "meet_on_default_group": False},
    )  # fmt: skip
    result.check()
    ranks = result.rank_results
    assert [r["error"] for r in ranks] == [None, None], result.tail()
    assert [r["samples_equal"] for r in ranks] == [True, True]
    assert [r["leaders"] for r in ranks] == [[{"replica": 0}, {"replica": 1}]] * 2
    assert [r["default_group_alive"] for r in ranks] == [True, True]
    # Rank 0 really waited longer than the default timeout inside the gather.
    assert ranks[0]["samples_wait_s"] > TIMEOUT_S, ranks[0]


def test_the_same_wait_on_the_default_group_fails():
    """The control: meeting on the default group, rank 0 gives up after the 4 s default timeout."""
    result = run_torchrun_function(
        WORKER, "late_engine", nproc=2, timeout=240,
        kwargs={"timeout_s": TIMEOUT_S, "gather_timeout_s": 120.0, "delay_s": DELAY_S, "meet_on_default_group": True},
    )  # fmt: skip
    rank0 = result.rank_results[0]
    assert rank0 is not None, result.tail()
    assert rank0["stage"] == "samples" and rank0["error"] is not None, rank0
    assert "timed out" in rank0["error"].lower() or "timeout" in rank0["error"].lower(), rank0["error"]
    assert rank0["failed_after_s"] < DELAY_S, rank0
