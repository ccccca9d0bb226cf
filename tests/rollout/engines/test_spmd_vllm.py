"""The SPMD placement with the REAL vLLM (CPU build): a TP=2 actor feeding a TP=2 engine whose two
shards live in the actor's own two processes (`distributed_executor_backend="external_launcher"`).

One torchrun launch of 2 ranks (_spmd_worker.py) goes through an untied and a tied Qwen2 (head_dim
32 for vLLM's CPU attention, 2 KV heads so each TP rank holds one; vocabulary 300, which Megatron
splits at row 256 at TP=2 and vLLM at row 160: the vocabulary exchange of `spmd_sync` is needed on
rank 1). References: the actor's own HF export (the gather path, `export_megatron_to_hf`), the
actor's forward-only log-probs, and a leader-placement engine (vLLM's workers in their own
processes) loaded with the same weights. The SPMD engine starts as the trainer's does, on vLLM's
dummy weights without reading the checkpoint: the first push fills every tensor.

Also here, pure and cheap: the placement rules (`placement.py`), the sync-mode choice per placement,
the wake-up tags, and the process-state guard (`process_state.py`).
"""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

import pytest
import torch

from megatron_dapo.distributed.placement import SpmdSlot, choose_sync_mode, resolve_placement
from megatron_dapo.rollout.base import ENGINE_MEMORY_TAGS, check_memory_tags
from megatron_dapo.rollout.engines.process_state import get_memory_policy, preserved_process_state
from tests.support.tiny_models import build_random_model
from tests.support.torchrun_utils import run_torchrun_script

WORKER = Path(__file__).parent / "_spmd_worker.py"
VOCAB = 300


# --------------------------------------------------------------------------------------------------
# Pure parts
# --------------------------------------------------------------------------------------------------


def test_spmd_slots_split_the_world_into_consecutive_tp_groups():
    slots = [SpmdSlot(rank, 8, 4) for rank in range(8)]
    assert [s.tp_rank for s in slots] == [0, 1, 2, 3, 0, 1, 2, 3]
    assert [s.data_rank for s in slots] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert {s.data_size for s in slots} == {2}
    assert slots[6].group_ranks == (4, 5, 6, 7)
    assert [s.hands_on_results for s in slots] == [True, False, False, False, True, False, False, False]
    assert SpmdSlot(0, 1, 1).group_ranks == (0,)
    with pytest.raises(ValueError, match="must divide the world size 6"):
        SpmdSlot(0, 6, 4)
    with pytest.raises(ValueError, match="outside"):
        SpmdSlot(8, 8, 2)
    with pytest.raises(ValueError, match=">= 1"):
        SpmdSlot(0, 8, 0)


def test_placement_resolution():
    assert resolve_placement("auto", "vllm") == "spmd"
    assert resolve_placement("auto", "embedded") == "leader"
    assert resolve_placement("auto", "sglang") == "leader"
    assert resolve_placement("leader", "vllm") == "leader"
    with pytest.raises(ValueError, match="'rollout.placement'=spmd needs rollout.engine"):
        resolve_placement("spmd", "sglang")
    with pytest.raises(ValueError, match="unknown rollout.placement"):
        resolve_placement("everywhere", "vllm")


def test_sync_mode_per_placement():
    spmd = dict(placement="spmd")
    assert choose_sync_mode("auto", 2, [], "vllm", "cpu", rollout_tp=2, **spmd) == "tp_shards"
    assert choose_sync_mode("auto", 2, [], "vllm", "cpu", rollout_tp=1, **spmd) == "gather"
    assert choose_sync_mode("auto", 1, [], "vllm", "cpu", rollout_tp=1, **spmd) == "gather"  # nothing to gather at TP=1
    assert choose_sync_mode("gather", 2, [], "vllm", "cpu", rollout_tp=2, **spmd) == "gather"
    with pytest.raises(ValueError, match="tp_shards needs rollout.tp = parallel.tp"):
        choose_sync_mode("tp_shards", 2, [], "vllm", "cpu", rollout_tp=4, **spmd)
    with pytest.raises(ValueError, match="shared_memory is for rollout.placement=leader"):
        choose_sync_mode("shared_memory", 2, [], "vllm", "cpu", rollout_tp=2, **spmd)
    with pytest.raises(ValueError, match="tp_shards needs the spmd placement"):
        choose_sync_mode("tp_shards", 2, ["a", "a"], "vllm", "cpu")
    assert choose_sync_mode("auto", 2, ["a", "a"], "vllm", "cpu") == "shared_memory"


def test_config_validates_placement_sleep_level_and_sync_mode():
    from megatron_dapo.config import Config, ConfigError, validate

    def check(**rollout):
        cfg = Config()
        for key, value in rollout.items():
            setattr(cfg.rollout, key, value)
        validate(cfg)

    check(engine="vllm", placement="auto", sleep_level=2)
    for bad, match in (
        (dict(sleep_level=3), "'rollout.sleep_level' must be 1 or 2"),
        (dict(engine="sglang", placement="spmd"), "'rollout.placement'=spmd needs rollout.engine=vllm"),
        (dict(engine="vllm", weight_sync_mode="shared_memory"), "shared_memory is for rollout.placement=leader"),
        (dict(engine="vllm", placement="leader", weight_sync_mode="tp_shards"), "tp_shards needs the spmd placement"),
        (dict(engine="vllm", tp=2, weight_sync_mode="tp_shards"), r"tp_shards needs rollout.tp = parallel.tp \(got 2 and 1\)"),
    ):
        with pytest.raises(ConfigError, match=match):
            check(**bad)
    check(engine="vllm", placement="leader", weight_sync_mode="shared_memory")


def test_wake_up_tags():
    assert check_memory_tags(None) == ENGINE_MEMORY_TAGS == ("weights", "kv_cache")
    assert check_memory_tags(["kv_cache", "kv_cache"]) == ("kv_cache",)
    with pytest.raises(ValueError, match="unknown memory tags"):
        check_memory_tags(["scheduling"])
    with pytest.raises(TypeError, match="not a string"):
        check_memory_tags("weights")


def test_process_state_guard_restores_what_an_engine_start_changes(monkeypatch):
    """What vLLM's CPU worker does to the process while starting in it, undone by the guard."""
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    original_setter, threads = torch.set_num_threads, torch.get_num_threads()
    policy = get_memory_policy()
    torch.manual_seed(3)
    expected_draw = torch.rand(3)
    torch.manual_seed(3)
    random.seed(4)
    expected_python = random.random()
    random.seed(4)
    with preserved_process_state():
        torch.set_num_threads(1 if threads > 1 else 2)
        torch.set_num_threads = lambda n: None  # vLLM's stub
        os.environ["LOCAL_WORLD_SIZE"] = "1"
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        torch.manual_seed(0)  # vLLM's set_random_seed
        random.seed(0)
        if policy is not None:
            from megatron_dapo.rollout.engines.process_state import MemoryPolicy, set_memory_policy

            assert set_memory_policy(MemoryPolicy(2, (1,) + (0,) * 15))  # MPOL_BIND to node 0
    assert torch.set_num_threads is original_setter and torch.get_num_threads() == threads
    assert os.environ["LOCAL_WORLD_SIZE"] == "2" and "VLLM_ENABLE_V1_MULTIPROCESSING" not in os.environ
    assert torch.equal(torch.rand(3), expected_draw) and random.random() == expected_python
    assert get_memory_policy() == policy


def test_in_process_target_places_each_slice_where_the_engine_loader_cuts():
    """vLLM's loaders narrow(dim, rank * size, size) a full tensor: each slice must sit exactly there;
    vocabulary rows the engine rank holds inside its own Megatron slice need no exchange."""
    from megatron_dapo.rollout.sync.tp_shards import InProcessShardTarget
    from megatron_dapo.rollout.sync.shards import EngineShard

    class Engine:
        def __init__(self):
            self.loaded, self.committed = [], 0

        def load_weights(self, weights):
            self.loaded.extend(weights)

        def commit_weights(self):
            self.committed += 1

    g = torch.Generator().manual_seed(0)
    rows, columns, norm, vocab = torch.randn(3, 5, generator=g), torch.randn(4, 2, generator=g), torch.randn(4, generator=g), torch.randn(5, 4, generator=g)
    shards = [
        EngineShard("model.layers.0.self_attn.q_proj.weight", rows, 0, 3, 6),  # rank 1 of 2, dim 0
        EngineShard("model.layers.0.self_attn.o_proj.weight", columns, 1, 2, 4),  # rank 1 of 2, dim 1
        EngineShard("model.norm.weight", norm, None, 0, 4),
        EngineShard("model.embed_tokens.weight", vocab, 0, 6, 11),  # Megatron rows 6..11 of a vocabulary of 11
    ]
    engine = Engine()
    target = InProcessShardTarget(engine, None, {"model.embed_tokens.weight": (7, 11)})  # vLLM's rank holds 7..11
    target.load_weight_shards(shards)
    target.commit_weights()
    loaded = dict(engine.loaded)
    assert loaded["model.layers.0.self_attn.q_proj.weight"].shape == (6, 5)
    assert torch.equal(loaded["model.layers.0.self_attn.q_proj.weight"].narrow(0, 3, 3), rows)
    assert loaded["model.layers.0.self_attn.o_proj.weight"].shape == (4, 4)
    assert torch.equal(loaded["model.layers.0.self_attn.o_proj.weight"].narrow(1, 2, 2), columns)
    assert loaded["model.norm.weight"] is norm
    assert loaded["model.embed_tokens.weight"].shape == (11, 4)
    assert torch.equal(loaded["model.embed_tokens.weight"][7:11], vocab[1:5])
    assert target.exchanged_vocab == {"model.embed_tokens.weight": False} and engine.committed == 1


# --------------------------------------------------------------------------------------------------
# The real engine: one torchrun launch, two models
# --------------------------------------------------------------------------------------------------


def _save_model(out_dir: Path, tied: bool, seed: int) -> Path:
    from transformers import Qwen2Config

    config = Qwen2Config(
        hidden_size=128, num_attention_heads=4, num_key_value_heads=2, intermediate_size=256, num_hidden_layers=2,
        vocab_size=VOCAB, max_position_embeddings=256, rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=tied,
        eos_token_id=2, bos_token_id=None,
    )  # fmt: skip
    config.architectures = ["Qwen2ForCausalLM"]
    model = build_random_model(config, seed)
    model.save_pretrained(out_dir)
    return out_dir


@pytest.fixture(scope="module")
def spmd_results(require_vllm, tmp_path_factory):
    from tests.support.ci import skip_or_fail

    if len(os.sched_getaffinity(0)) < 2:
        skip_or_fail("the SPMD test runs two ranks with one vLLM shard each and needs 2 CPUs")
    root = tmp_path_factory.mktemp("spmd_models")
    dirs = [str(_save_model(root / "untied", tied=False, seed=1)), str(_save_model(root / "tied", tied=True, seed=2))]
    result = run_torchrun_script(WORKER, nproc=2, args=[json.dumps({"model_dirs": dirs})], timeout=840, preloaded=True)
    result.check()
    assert all(r is not None and "error" not in r for r in result.rank_results), result.tail()
    return result.rank_results


@pytest.mark.parametrize("model", [0, 1], ids=["untied", "tied"])
def test_tp2_actor_to_tp2_spmd_engine(spmd_results, model):
    ranks = [r["models"][model] for r in spmd_results]
    for rank, r in enumerate(ranks):
        assert r["engine_tp_ranks"] == [0, 1]
        # Started on vLLM's dummy weights with the checkpoint's weight file hidden: nothing was read.
        assert r["loads_checkpoint"] is False and r["vllm_load_format"] == "dummy"
        # Each rank loaded its own slices in-process; before that the engine was stale everywhere.
        assert r["sync_mode"] == "tp_shards" and r["gather_sync_mode"] == "gather"
        assert r["stale_before"] == r["after_tp_shards"]["compared"] > 0
        for key in ("after_tp_shards", "after_gather"):
            assert r[key]["missing"] == [] and r[key]["differ"] == [], (rank, key, r[key])
        # tp_shards moves about half of the model per rank (vocabulary exchanged where needed).
        assert r["sync"]["bytes"] < 0.75 * r["sync"]["full_bytes"]
    # vLLM splits the 300 rows at 160 (64-padding), Megatron at 256 (128 x TP): rank 1 lacks rows.
    assert ranks[0]["vocab_rows"]["model.embed_tokens.weight"] == [0, 160]
    assert ranks[1]["vocab_rows"]["model.embed_tokens.weight"] == [160, 300]
    assert all(ranks[0]["exchanged_vocab"].values()) and ranks[0]["exchanged_vocab"] == ranks[1]["exchanged_vocab"]
    # Both TP ranks step together and see the same outputs; only rank 0 hands them on.
    assert [r["hands_on"] for r in ranks] == [True, False]
    assert ranks[0]["generation"] == ranks[1]["generation"] and ranks[0]["repeat_equal"]
    assert ranks[0]["mismatch"]["max_abs"] < 5e-5, ranks[0]["mismatch"]
    # The leader placement (its workers in other processes) on the same weights and seed.
    spmd, leader = ranks[0]["spmd_generation_final"], ranks[0]["leader_generation"]
    assert spmd["responses"] == leader["responses"]
    worst = max(abs(a - b) for x, y in zip(spmd["log_probs"], leader["log_probs"]) for a, b in zip(x, y))
    print(f"\n[spmd] model {model}: engine start {ranks[0]['engine_start_seconds']:.1f} s, tp_shards sync {ranks[0]['sync']['seconds']:.2f} s, "
          f"|spmd - leader| log-prob max {worst:.1e}, |engine - actor| max {ranks[0]['mismatch']['max_abs']:.1e}")  # fmt: skip
    assert worst < 1e-5


def test_starting_vllm_in_process_leaves_the_trainer_settings_alone(spmd_results):
    for r in spmd_results:
        for model in r["models"]:
            before, after = model["process_state"]["before"], model["process_state"]["after"]
            assert after == before, (before, after)
            generated = model["process_state"]["after_generate"]
            assert generated == {k: v for k, v in before.items() if k != "rng"}, (before, generated)
