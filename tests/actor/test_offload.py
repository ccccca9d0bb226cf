"""Actor offload (`megatron_dapo/actor/offload.py`): round trips are bit-exact and really free memory.

* one process, plain torch modules and AdamW: the host buffer's power-of-two chunks, storages that
  span chunks, views and shared storages, ownership between kinds, no-ops, errors;
* two processes over gloo with real Megatron-Core (`_offload_worker.py`): DP=2 and TP=2, the
  distributed optimizer on and off, bf16 (fp32 main params) and fp32 models. Offload + onload of
  params, grads and optimizer state leaves every tensor bit-identical, frees every storage while
  away, moves what Megatron holds, and updates after round trips equal updates without them; by
  default the grads are dropped instead (no host copy, zeros on return) and the update still equals.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from megatron_dapo.actor.offload import KINDS, ActorOffload, _chunk_sizes, grad_storages, optimizer_tensors
from tests.support.torchrun_utils import run_torchrun_function

WORKER = Path(__file__).parent / "_offload_worker.py"
CASES = [
    {"name": "dp2_distopt_bf16", "tp": 1, "dist_opt": True, "dtype": "bfloat16"},
    {"name": "dp2_distopt_fp32", "tp": 1, "dist_opt": True, "dtype": "float32"},
    {"name": "dp2_plain_fp32", "tp": 1, "dist_opt": False, "dtype": "float32"},
    {"name": "tp2_plain_bf16", "tp": 2, "dist_opt": False, "dtype": "bfloat16"},
    {"name": "tp2_distopt_bf16", "tp": 2, "dist_opt": True, "dtype": "bfloat16"},
]


# ---------------------------------------------------------------------------------------------
# One process, plain torch
# ---------------------------------------------------------------------------------------------


def _trained(seed: int = 0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 33), torch.nn.Linear(33, 5))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(3, 8)).square().sum().backward()
    optimizer.step()
    return model, optimizer


def _snapshot(model, optimizer) -> list[torch.Tensor]:
    tensors = [*model.parameters(), *grad_storages([model]), *optimizer_tensors(optimizer)]
    return [t.detach().reshape(-1).view(torch.uint8).clone() for t in tensors]


@pytest.mark.parametrize("total, chunk", [(0, 64), (64, 64), (4096 * 3 + 192, 4096), (1 << 20, 1 << 28)])
def test_host_chunks_are_powers_of_two_that_add_up(total, chunk):
    sizes = _chunk_sizes(total, chunk)
    assert sum(sizes) == total
    assert all(s & (s - 1) == 0 and s <= chunk for s in sizes)


def test_round_trip_is_bit_exact_and_frees_every_storage():
    model, optimizer = _trained()
    before = _snapshot(model, optimizer)
    offload = ActorOffload([model], optimizer, host_chunk_bytes=64, keep_grads=True)  # every storage spans chunks
    storages = {kind: offload.storages(kind) for kind in KINDS}
    assert [len(storages[k]) for k in KINDS] == [4, 4, 12]  # 4 weights, their grads, Adam: step, m, v each
    stats = offload.offload()
    assert offload.offloaded == KINDS
    assert all(s.nbytes() == 0 for kind in KINDS for s in storages[kind])
    params = sum(p.numel() * 4 for p in model.parameters())
    assert stats.bytes == params * 2 + params * 2 + 4 * 4  # weights, grads, moments, four fp32 step counters
    back = offload.onload()
    assert back.bytes == stats.bytes and offload.offloaded == ()
    after = _snapshot(model, optimizer)
    assert all(torch.equal(x, y) for x, y in zip(before, after))


def test_grads_are_dropped_by_default_and_come_back_as_zeros():
    model, optimizer = _trained()
    grads = grad_storages([model])
    grad_bytes = sum(g.numel() * 4 for g in grads)
    assert all(g.abs().sum() > 0 for g in grads)
    kept = [*model.parameters(), *(v for state in optimizer.state.values() for v in state.values())]
    keep = [t.detach().reshape(-1).view(torch.uint8).clone() for t in kept]
    offload = ActorOffload([model], optimizer)
    stats = offload.offload()
    assert offload.offloaded == KINDS and all(g.untyped_storage().nbytes() == 0 for g in grads)
    assert stats.dropped == grad_bytes and stats.bytes == sum(p.numel() * 4 for p in model.parameters()) * 3 + 4 * 4
    assert offload._regions["grads"].host is None and offload.host_bytes("grads") == 0  # no host copy
    back = offload.onload()
    assert back.dropped == grad_bytes and back.bytes == stats.bytes
    assert all(g.untyped_storage().nbytes() == g.numel() * 4 and torch.count_nonzero(g) == 0 for g in grads)
    assert all(p.grad is g for p, g in zip(model.parameters(), grads))  # the same tensors, zeroed in place
    assert all(torch.equal(x, t.detach().reshape(-1).view(torch.uint8)) for x, t in zip(keep, kept))  # the rest: bit-exact


def test_training_after_a_round_trip_equals_training_without():
    (a, opt_a), (b, opt_b) = _trained(), _trained()
    offload = ActorOffload([a], opt_a)
    offload.offload("grads", "optimizer")
    offload.offload("params")
    offload.onload()
    for model, optimizer in ((a, opt_a), (b, opt_b)):
        torch.manual_seed(1)
        optimizer.zero_grad()
        model(torch.randn(3, 8)).square().sum().backward()
        optimizer.step()
    assert all(torch.equal(x, y) for x, y in zip(_snapshot(a, opt_a), _snapshot(b, opt_b)))


def test_views_and_shared_storages_move_once_with_their_owner():
    model, optimizer = _trained()
    weight = model[0].weight
    view = weight.detach()[3:7]  # a view into the weight's storage
    optimizer.state[weight]["alias"] = view  # an optimizer tensor that is really a parameter's storage
    offload = ActorOffload([model], optimizer, kinds=("optimizer",))
    assert weight.untyped_storage()._cdata not in {s._cdata for s in offload.storages("optimizer")}
    expected = view.clone()
    offload.offload()
    assert weight.untyped_storage().nbytes() > 0  # params are not enabled: they stay
    offload.onload()
    assert torch.equal(view, expected) and view.untyped_storage()._cdata == weight.untyped_storage()._cdata


def test_only_enabled_kinds_move_and_repeats_are_no_ops():
    model, optimizer = _trained()
    offload = ActorOffload([model], optimizer, kinds=("grads",), keep_grads=True)
    assert offload.offload("params", "optimizer").bytes == 0 and offload.offloaded == ()
    first = offload.offload()
    assert first.bytes > 0 and offload.offloaded == ("grads",)
    assert offload.offload("grads").bytes == 0  # already offloaded
    assert offload.onload().bytes == first.bytes
    assert offload.onload().bytes == 0  # already resident
    host = offload._regions["grads"].host
    offload.offload()
    assert offload._regions["grads"].host is host  # same sizes: the host buffer is reused
    offload.onload()
    assert not ActorOffload([model], optimizer, kinds=()).enabled


def test_errors_name_the_problem():
    model, optimizer = _trained()
    with pytest.raises(ValueError, match="unknown offload kind"):
        ActorOffload([model], optimizer, kinds=("weights",))
    with pytest.raises(ValueError, match="power of two"):
        ActorOffload([model], optimizer, host_chunk_bytes=1000)
    frozen = torch.nn.Linear(2, 2)
    frozen.weight.data = torch.from_numpy(frozen.weight.detach().numpy().copy())  # storage torch cannot resize
    with pytest.raises(RuntimeError, match="not resizable"):
        ActorOffload([frozen], kinds=("params",)).offload()
    offload = ActorOffload([model], optimizer, kinds=("params",))
    model[1].bias.untyped_storage().resize_(0)  # freed behind the offloader's back
    with pytest.raises(RuntimeError, match="0 bytes while resident"):
        offload.offload()


# ---------------------------------------------------------------------------------------------
# Two processes, real Megatron-Core
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def round_trips(tiny_model_dirs):
    kwargs = {"model_dir": str(tiny_model_dirs["qwen2_tied"]), "cases": CASES}
    result = run_torchrun_function(WORKER, "run_round_trips", nproc=2, kwargs=kwargs, timeout=300)
    result.check()
    assert all(r is not None and "error" not in r for r in result.rank_results), result.tail()
    return result.rank_results


@pytest.mark.parametrize("case", [c["name"] for c in CASES])
def test_megatron_round_trips_are_bit_exact(round_trips, case):
    for rank, out in enumerate(round_trips):
        r = out["cases"][case]
        where = f"{case} rank {rank}"
        assert r["a_equals_b_at_start"], where
        expected_class = "DistributedOptimizer" if "distopt" in case else ("FP32Optimizer" if "fp32" in case else "Float16OptimizerWithFloat16Params")
        assert r["optimizer_classes"] == [expected_class], where  # inside Megatron's ChainedOptimizer
        assert r["freed_at_start"] and r["freed"], where
        assert r["params_resident_while_grads_away"], where
        assert r["moved"] == r["expected"], where  # what Megatron holds, kind by kind
        assert all(r["moved"][k] > 0 for k in KINDS), where
        assert r["onload_bytes"] == sum(r["moved"].values()), where
        assert r["second_offload_moves"] == 0 and r["onload_when_resident_moves"] == 0, where
        assert r["host_buffers_reused"], where
        for key in ("start_round_trip_differences", "round_trip_differences", "second_round_trip_differences"):
            assert r[key] == [], f"{where}: {key}: {r[key][:5]}"
        for key in ("update_after_round_trip_differences", "third_update_differences"):
            assert r[key] == [], f"{where}: {key}: {r[key][:5]}"
        # the default offloader drops the grads instead of copying them
        assert r["drop_freed"] and r["drop_bytes"] == r["drop_expected"], where
        assert r["drop_grads_nonzero"] == [] and r["drop_other_differences"] == [], where
        assert r["update_after_drop_differences"] == [], where


def test_distributed_optimizer_shards_the_optimizer_bytes(round_trips):
    """With the distributed optimizer each DP rank moves about half the optimizer state of a plain one."""
    moved = {case: round_trips[0]["cases"][case]["moved"] for case in ("dp2_distopt_fp32", "dp2_plain_fp32")}
    ratio = moved["dp2_distopt_fp32"]["optimizer"] / moved["dp2_plain_fp32"]["optimizer"]
    assert 0.45 < ratio < 0.55, moved
    # an fp32 model's "main params" are its own weights: with the distributed optimizer they are views
    # of the parameter buffer and move with the params, never twice
    assert moved["dp2_distopt_fp32"]["params"] >= moved["dp2_plain_fp32"]["params"]
