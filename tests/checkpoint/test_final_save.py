"""The fully reshardable final save only where the gathering nodes can hold it (`checkpoint/final_save.py`,
`trainer.checkpointing.final_optimizer_format`): the decision is pure, and the trainer's side is run
in one process with a fake actor and the node's memory as given."""

from __future__ import annotations

import types

import pytest
import torch

from megatron_dapo.checkpoint import final_save
from megatron_dapo.checkpoint.final_save import GATHERED_BYTES_PER_PARAMETER, RankShare, available_host_memory, final_save_fits

GIB = 2**30


def _node(host: str, gathering: int, ranks: int, parameters: int, available_gib: float) -> list[RankShare]:
    return [RankShare(host, i < gathering, parameters, int(available_gib * GIB)) for i in range(ranks)]


def test_32b_on_two_nodes_with_tp8_gathers_everything_on_node_0():
    # Qwen2.5-32B at TP 8: each of node 0's 8 ranks is DP rank 0 of its TP shard (4B parameters each):
    # 8 x 4B x 12 B = 358 GiB on node0, nothing on node1.
    shard = 4_000_000_000
    shares = _node("node0", 8, 8, shard, available_gib=1000) + _node("node1", 0, 8, shard, available_gib=1000)
    assert final_save_fits(shares) == (True, None)
    tight = _node("node0", 8, 8, shard, available_gib=400) + _node("node1", 0, 8, shard, available_gib=1000)
    fits, why = final_save_fits(tight)
    assert not fits and why == (
        f"the fully reshardable final save would gather {8 * shard * GATHERED_BYTES_PER_PARAMETER / GIB:.1f} GiB of optimizer "
        "state on node node0, which has 400.0 GiB available (80% of it usable)"
    )
    # Gathering ranks spread over both nodes: 4 x 4B x 12 B = 179 GiB each, within 80% of 400 GiB, not within 40%.
    spread = _node("node0", 4, 8, shard, available_gib=400) + _node("node1", 4, 8, shard, available_gib=400)
    assert final_save_fits(spread, headroom=0.8) == (True, None)
    assert final_save_fits(spread, headroom=0.4)[0] is False


def test_the_smallest_available_figure_of_a_node_counts():
    shares = [RankShare("n", True, 10 * GIB // 12, 20 * GIB), RankShare("n", False, 0, 11 * GIB)]  # 10 GiB to gather
    assert final_save_fits(shares, headroom=1.0) == (True, None)
    assert final_save_fits(shares, headroom=0.9)[0] is False


def test_available_host_memory_reads_memavailable(tmp_path):
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       24000000 kB\nMemFree:  100 kB\nMemAvailable:   18000000 kB\n")
    assert available_host_memory(str(meminfo)) == 18000000 * 1024
    assert available_host_memory(str(tmp_path / "absent")) == 0
    assert available_host_memory() > 0  # this machine's


def _fake_actor(parameters: int):
    model = torch.nn.Linear(parameters, 1, bias=False)
    return types.SimpleNamespace(models=[model])


def _cfg(distributed: bool = True):
    from megatron_dapo.config import load_config

    return load_config(None, [f"parallel.use_distributed_optimizer={str(distributed).lower()}", "trainer.checkpoint_format=dp_reshardable"])


def test_the_trainer_keeps_its_format_when_the_node_cannot_hold_the_gather(monkeypatch):
    from megatron_dapo.trainer.checkpointing import final_optimizer_format

    said = []
    monkeypatch.setattr(final_save, "available_host_memory", lambda: 1000)  # bytes: less than 12 x 100 parameters
    assert final_optimizer_format(_fake_actor(100), _cfg(), say=lambda *a, **k: said.append(a[0])) == "dp_reshardable"
    assert len(said) == 1 and "would gather 0.0 GiB" in said[0] and "keeps trainer.checkpoint_format=dp_reshardable" in said[0]
    monkeypatch.setattr(final_save, "available_host_memory", lambda: 10**9)
    assert final_optimizer_format(_fake_actor(100), _cfg(), say=said.append) == "fully_reshardable"
    monkeypatch.setattr(final_save, "available_host_memory", lambda: 0)
    # Without the distributed optimizer nothing is gathered: the final save stays reshardable.
    assert final_optimizer_format(_fake_actor(100), _cfg(distributed=False), say=said.append) == "fully_reshardable"
