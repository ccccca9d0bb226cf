"""MoE routing goes from the rank that generated it to the replica that trains on it, and nowhere
else (`trainer/routing_exchange.py`): the pure transfer plan, and a 4-rank gloo run of `fetch_routing`."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from megatron_dapo.trainer.routing_exchange import RoutingStore, plan_transfers
from tests.support.torchrun_utils import run_torchrun_function


def test_plan_sends_each_sample_to_the_ranks_that_need_it_and_no_other():
    refs = [(0, 2), (2, 0), (0, 0), (2, 1)]
    needed_by = [[0, 1], [0, 1], [2, 3], [2, 3]]
    assert plan_transfers(refs, needed_by) == {
        (0, 0): [0], (0, 1): [0], (2, 0): [1], (2, 1): [1],  # replica 0: rows 0 (owned by 0) and 1 (owned by 2)
        (0, 2): [2], (0, 3): [2], (2, 2): [3], (2, 3): [3],
    }  # fmt: skip
    with pytest.raises(ValueError, match="3 routing references for 2 samples"):
        plan_transfers(refs[:3], needed_by[:2])


def test_store_keeps_host_copies_and_empties():
    store = RoutingStore()
    refs = store.keep(5, [torch.zeros(2, 3, 2, dtype=torch.int8), torch.ones(1, 3, 2, dtype=torch.int8)])
    assert refs == [(5, 0), (5, 1)] and store.nbytes == 18
    assert store.keep(5, [torch.zeros(1, 1, 1, dtype=torch.int8)]) == [(5, 2)]
    store.retain(5, [])  # a step that carries nothing over: all let go
    assert store.nbytes == 0 and store.kept == {}
    assert store.keep(5, [torch.zeros(1, 1, 1, dtype=torch.int8)]) == [(5, 3)]  # keys are never reused


def test_store_retains_exports_and_adopts_the_routing_carried_over():
    store = RoutingStore()
    routings = [torch.full((i + 1, 2, 2), i, dtype=torch.int8) for i in range(4)]
    refs = store.keep(1, routings)
    carried = [refs[1], refs[3], (0, 1)]  # another owner's key 1 is not this store's
    store.retain(1, carried)
    assert sorted(store.kept) == [1, 3] and store.nbytes == (2 + 4) * 4
    saved = store.export(1, carried)
    assert sorted(saved) == [1, 3] and torch.equal(saved[3], routings[3])
    with pytest.raises(KeyError, match=r"routing \[0\] of rank 1 is not in its store"):
        store.export(1, [refs[0]])

    resumed = RoutingStore()
    resumed.adopt(saved)
    assert torch.equal(resumed.kept[1], routings[1])
    assert resumed.keep(1, [routings[0]]) == [(1, 4)]  # after the adopted keys: no alias
    with pytest.raises(RuntimeError, match="in the store already"):
        resumed.adopt({1: routings[1]})


def test_each_rank_receives_exactly_its_replicas_rows():
    result = run_torchrun_function(Path(__file__).parent / "_routing_exchange_worker.py", "main", nproc=4, timeout=240)
    result.check()
    ranks = result.rank_results
    assert [r["positions"] for r in ranks] == [[0, 1], [0, 1], [2, 3], [2, 3]]
    assert all(r["equal"] and r["dtypes"] == ["torch.int8"] for r in ranks)
    entry = 3 * 2  # layers x top-k, one byte each
    # Replica 0 trains samples 4 and 0 (3 + 5 tokens read), replica 1 samples 5 and 2 (6 + 7): nothing else arrives.
    assert [r["received_bytes"] for r in ranks] == [8 * entry, 8 * entry, 13 * entry, 13 * entry]
    assert [r["kept_bytes"] for r in ranks] == [14 * entry, 0, 13 * entry, 0]  # only the generating ranks keep any
