"""The final save: `fully_reshardable` where the gathering nodes can hold it, else `fully_sharded_model_space`
(`checkpoint/final_save.py`, `trainer.checkpointing.final_optimizer_format`): the decision is pure (who
gathers what, per node, experts on expert-DP rank 0), and the trainer's side is run in one process with
a fake actor, its data-parallel ranks and the node's memory as given."""

from __future__ import annotations

import types

import pytest
import torch

from megatron_dapo.checkpoint import final_save
from megatron_dapo.checkpoint.final_save import (
    GATHERED_BYTES_PER_PARAMETER,
    RankShare,
    available_host_memory,
    final_save_fits,
    gathered_parameters,
)
from megatron_dapo.distributed.layout import ParallelLayout

GIB = 2**30


def _node(host: str, gathering: int, ranks: int, parameters: int, available_gib: float) -> list[RankShare]:
    return [RankShare(host, parameters if i < gathering else 0, int(available_gib * GIB)) for i in range(ranks)]


def test_32b_on_two_nodes_with_tp8_gathers_everything_on_node_0():
    # Qwen2.5-32B at TP 8: each of node 0's 8 ranks is DP rank 0 of its TP shard (4B parameters each):
    # 8 x 4B x 12 B = 358 GiB on node0, nothing on node1.
    shard = 4_000_000_000
    shares = _node("node0", 8, 8, shard, available_gib=1000) + _node("node1", 0, 8, shard, available_gib=1000)
    assert final_save_fits(shares)[0] is True
    tight = _node("node0", 8, 8, shard, available_gib=400) + _node("node1", 0, 8, shard, available_gib=1000)
    fits, why = final_save_fits(tight)
    assert not fits and why == (
        f"the fully_reshardable final save would gather {8 * shard * GATHERED_BYTES_PER_PARAMETER / GIB:.1f} GiB of optimizer "
        "state on node node0, which has 400.0 GiB available (80% of it usable)"
    )
    # Gathering ranks spread over both nodes: 4 x 4B x 12 B = 179 GiB each, within 80% of 400 GiB, not within 40%.
    spread = _node("node0", 4, 8, shard, available_gib=400) + _node("node1", 4, 8, shard, available_gib=400)
    assert final_save_fits(spread, headroom=0.8)[0] is True
    assert final_save_fits(spread, headroom=0.4)[0] is False


def test_the_smallest_available_figure_of_a_node_counts():
    shares = [RankShare("n", 10 * GIB // 12, 20 * GIB), RankShare("n", 0, 11 * GIB)]  # 10 GiB to gather
    assert final_save_fits(shares, headroom=1.0)[0] is True
    assert final_save_fits(shares, headroom=0.9)[0] is False


def test_experts_are_gathered_on_expert_data_parallel_rank_0():
    """A 30B MoE (1.5B dense parameters, 28.5B in the experts) at EP=8 on 2 nodes of 8 GPUs: the
    dense optimizer state lands on DP rank 0 (rank 0), every expert's on expert-DP rank 0 of its EP
    rank: ranks 0-7, all on node 0. Counting each rank's experts where its dense state goes would see
    rank 0's 1/8 of the experts only (56 GiB) and let node 0 (300 GiB) gather 335 GiB."""
    layout = ParallelLayout(tp=1, ep=8).resolve(16)
    dense, experts = 1_500_000_000, 28_500_000_000
    per_rank = {r: gathered_parameters(dense, experts // 8, layout.coordinates(r)["dp"], layout.expert_coordinates(r)["expert_dp"])
                for r in range(16)}  # fmt: skip
    assert per_rank[0] == dense + experts // 8 and all(per_rank[r] == experts // 8 for r in range(1, 8))
    assert all(per_rank[r] == 0 for r in range(8, 16))
    shares = [RankShare(f"node{r // 8}", per_rank[r], 300 * GIB) for r in range(16)]
    fits, why = final_save_fits(shares)
    assert not fits and f"gather {(dense + experts) * GATHERED_BYTES_PER_PARAMETER / GIB:.1f} GiB" in why and "node0" in why
    assert gathered_parameters(dense, 10, dp_rank=0, expert_dp_rank=1) == dense  # dense only
    assert gathered_parameters(dense, 10, dp_rank=3, expert_dp_rank=0) == 10  # experts only


def test_available_host_memory_reads_memavailable(tmp_path):
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       24000000 kB\nMemFree:  100 kB\nMemAvailable:   18000000 kB\n")
    assert available_host_memory(str(meminfo)) == 18000000 * 1024
    assert available_host_memory(str(tmp_path / "absent")) == 0
    assert available_host_memory() > 0  # this machine's


def _fake_actor(dense: int, expert: int = 0):
    models = [torch.nn.Linear(dense, 1, bias=False)]
    if expert:
        experts = torch.nn.Linear(expert, 1, bias=False)
        experts.weight.allreduce = False  # how Megatron marks expert parameters
        models.append(experts)
    return types.SimpleNamespace(models=models)


def _cfg(distributed: bool = True):
    from megatron_dapo.config import load_config

    return load_config(None, [f"parallel.use_distributed_optimizer={str(distributed).lower()}", "trainer.checkpoint_format=dp_reshardable"])


def test_the_final_save_writes_model_space_when_the_node_cannot_hold_the_gather(monkeypatch):
    from megatron_dapo.trainer import checkpointing
    from megatron_dapo.trainer.checkpointing import final_optimizer_format

    said = []
    say = lambda *a, **k: said.append(a[0])  # noqa: E731
    monkeypatch.setattr(checkpointing, "_data_parallel_ranks", lambda: (0, 0))
    monkeypatch.setattr(final_save, "available_host_memory", lambda: 1000)  # bytes: less than 12 x 100 parameters
    assert final_optimizer_format(_fake_actor(100), _cfg(), say=say) == "fully_sharded_model_space"
    assert len(said) == 1 and said[0].startswith("[megatron-dapo] final checkpoint: fully_sharded_model_space, not fully_reshardable")
    assert "would gather 1.2 KiB of optimizer state" in said[0] and "which has 1000 B available" in said[0]
    assert "nothing is gathered" in said[0] and "resumes at any layout" in said[0]
    monkeypatch.setattr(final_save, "available_host_memory", lambda: 10**9)
    assert final_optimizer_format(_fake_actor(100), _cfg(), say=say) == "fully_reshardable"
    assert said[1].startswith("[megatron-dapo] final checkpoint: fully_reshardable (")
    monkeypatch.setattr(final_save, "available_host_memory", lambda: 0)
    # Without the distributed optimizer nothing is gathered: Megatron's format, said nothing.
    assert final_optimizer_format(_fake_actor(100), _cfg(distributed=False), say=say) == "fully_reshardable"
    assert len(said) == 2


def test_the_trainer_counts_its_experts_where_they_are_gathered(monkeypatch):
    """Dense DP rank 1, expert-DP rank 0: this rank receives its experts' state (100 parameters), not its dense one."""
    from megatron_dapo.trainer import checkpointing
    from megatron_dapo.trainer.checkpointing import final_optimizer_format

    said = []
    monkeypatch.setattr(final_save, "available_host_memory", lambda: 1000)  # < 12 x 100 bytes, > 12 x 50
    monkeypatch.setattr(checkpointing, "_data_parallel_ranks", lambda: (1, 0))
    assert final_optimizer_format(_fake_actor(50, expert=100), _cfg(), say=lambda *a, **k: said.append(a[0])) == "fully_sharded_model_space"
    monkeypatch.setattr(checkpointing, "_data_parallel_ranks", lambda: (0, 1))
    assert final_optimizer_format(_fake_actor(50, expert=100), _cfg(), say=lambda *a, **k: said.append(a[0])) == "fully_reshardable"
    monkeypatch.setattr(checkpointing, "_data_parallel_ranks", lambda: (1, 1))  # gathers nothing
    assert final_optimizer_format(_fake_actor(500, expert=500), _cfg(), say=lambda *a, **k: said.append(a[0])) == "fully_reshardable"


def test_every_optimizer_format_is_a_checkpoint_format():
    from megatron_dapo.checkpoint.optimizer_state import ANY_LAYOUT_FORMATS, OPTIMIZER_FORMATS
    from megatron_dapo.config import CHECKPOINT_FORMATS, load_config
    from megatron_dapo.errors import ConfigError

    assert CHECKPOINT_FORMATS == OPTIMIZER_FORMATS and set(ANY_LAYOUT_FORMATS) < set(OPTIMIZER_FORMATS)
    cfg = load_config(None, ["trainer.checkpoint_format=fully_sharded_model_space"])
    assert cfg.trainer.checkpoint_format == "fully_sharded_model_space"
    with pytest.raises(ConfigError, match="trainer.checkpoint_format"):
        load_config(None, ["trainer.checkpoint_format=fully_sharded_bucket_space"])
