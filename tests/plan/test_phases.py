"""The plan (plan/phases.py): what each phase of the step holds, the largest budget and pool, offload,
context parallelism, the engine's pool and result buffers, and the config's own layout messages."""

from __future__ import annotations

import pytest

from megatron_dapo import plan as mp
from megatron_dapo.config import ConfigError
from tests.support.plans import OFFLOAD_ALL, known, plan_for


def test_largest_budget_is_the_boundary():
    plan = plan_for(["parallel.tp=4", "parallel.sequence_parallel=true"])
    gpu = plan.gpu_memory
    for stage in plan.stages:
        static = stage.actor.total + stage.reference + plan.reserve

        def total(tokens):
            return static + stage.activation_fixed + stage.activation_per_token * tokens

        assert total(stage.max_tokens) <= gpu < total(stage.max_tokens + 1)
    assert plan.max_tokens_per_micro_batch == min(s.max_tokens for s in plan.stages)


def test_context_parallelism_holds_cp_times_longer_sequences():
    """The per-rank budget does not depend on CP; a micro-batch holds CP x that; the plan names the CP needed."""
    base = ["parallel.tp=4", "parallel.sequence_parallel=true", "model.recompute_activations=false",
            "rollout.max_prompt_length=2048", "rollout.max_response_length=20480"]  # fmt: skip
    plans = {cp: plan_for([*base, f"parallel.cp={cp}"], model="qwen2.5-32b", nodes=4) for cp in (1, 2, 4)}
    budget = plans[1].max_tokens_per_micro_batch
    assert 0 < budget < 22528  # without recompute one 22.5k-token sequence does not fit at CP=1
    for cp, plan in plans.items():
        assert plan.max_tokens_per_micro_batch == budget  # actor state per GPU is the same at any CP
        assert plan.longest_sequence_per_micro_batch == budget * cp
        wanted = -(-22528 // budget)
        assert plan.min_cp_for_longest_sequence == min(c for c in (1, 2, 4, 8) if c >= wanted)  # divisors of 32 / 4
        assert not plan.training_fits
        assert f"set parallel.cp >= {plan.min_cp_for_longest_sequence}" in plan.notes[-1]
    enough = plan_for([*base, f"parallel.cp={plans[1].min_cp_for_longest_sequence}"], model="qwen2.5-32b", nodes=4)
    assert enough.longest_sequence_per_micro_batch >= 22528 and enough.training_fits
    assert "CP >= " in mp.format_plan(enough)


def test_plan_accounts_for_recompute_reference_and_pool():
    base = ["parallel.tp=4", "parallel.sequence_parallel=true", "trainer.max_tokens_per_micro_batch=32768"]
    plain = plan_for(base)
    recompute = plan_for(base + ["model.recompute_activations=true"])
    assert recompute.max_tokens_per_micro_batch == plain.stages[0].max_tokens_full_recompute
    assert recompute.max_tokens_per_micro_batch > 4 * plain.max_tokens_per_micro_batch
    with_kl = plan_for(base + ["algorithm.kl.use_kl_loss=true"])
    assert with_kl.stages[0].reference == 2 * with_kl.stages[0].parameters
    assert with_kl.rollout.phase_total - plain.rollout.phase_total == pytest.approx(with_kl.stages[0].reference)
    awake = plan_for(base + ["rollout.free_cache_engine=false"])
    assert awake.stages[0].training_total - plain.stages[0].training_total == pytest.approx(plain.rollout.pool)
    plain_optimizer = plan_for(base + ["parallel.use_distributed_optimizer=false"])
    assert plain_optimizer.stages[0].actor.total == plain.stages[0].actor_plain_optimizer.total


def test_offload_frees_the_actor_state_for_the_engine_pool():
    """What each moment of the step holds with and without actor offload (see the module doc)."""
    base = ["parallel.tp=4", "parallel.sequence_parallel=true", "rollout.tp=2", "rollout.engine=vllm", "rollout.sleep_level=2"]
    resident, offloaded = plan_for(base), plan_for(base + OFFLOAD_ALL)
    gpu, reserve, bucket = resident.gpu_memory, resident.reserve, 512 * 2**20
    actor = resident.stages[0].actor
    r, o = resident.rollout, offloaded.rollout
    results = r.result_buffers  # the gathered rollouts, next to the awake pool
    assert results == o.result_buffers > 0
    # Resident: the whole actor next to the pool while generating; at the sync the KV cache sleeps.
    assert r.offloaded == [] and r.actor_kept == actor.total
    assert r.generation_total == pytest.approx(actor.total + r.pool + results + reserve)
    assert r.sync_total == pytest.approx(actor.total + r.weights + bucket + reserve)
    assert r.max_gpu_memory_utilization == pytest.approx((gpu - actor.total - results - reserve) / gpu)
    assert r.host_per_gpu == 0  # level 2: the sleeping engine keeps nothing in host memory
    # Offloaded: nothing of the actor while generating, only its params during the sync.
    assert o.offloaded == ["params", "grads", "optimizer"] and o.actor_kept == 0
    assert o.generation_total == pytest.approx(o.pool + results + reserve)
    assert o.sync_total == pytest.approx(actor.params + o.weights + bucket + reserve)
    assert o.max_gpu_memory_utilization == o.max_gpu_memory_utilization_offloaded == pytest.approx(
        (gpu - results - reserve) / gpu
    )
    assert o.max_gpu_memory_utilization_resident == pytest.approx(r.max_gpu_memory_utilization)
    # grads are dropped, not copied: host memory holds params and optimizer state only
    host = actor.total - actor.grads
    assert o.host_per_gpu == pytest.approx(host) and o.host_per_node == pytest.approx(8 * host)
    # Training needs the whole actor either way; the same utilisation gives the same pool.
    assert offloaded.stages[0].training_total == resident.stages[0].training_total
    assert o.concurrent_full_sequences == r.concurrent_full_sequences
    # The larger pool that offload allows holds more full-length sequences.
    per_sequence = o.kv_bytes_per_token * o.full_sequence_tokens
    in_pool = o.weights + o.activation_peak  # vLLM: its profiled activations come out of the pool too
    assert o.concurrent_full_sequences_at_max == int((o.max_gpu_memory_utilization * gpu - in_pool) // per_sequence)
    assert o.concurrent_full_sequences_at_max > r.concurrent_full_sequences_at_max


def test_partial_offload_keeps_the_rest_and_level_one_keeps_engine_weights_on_the_host():
    base = ["parallel.tp=4", "parallel.sequence_parallel=true", "rollout.tp=2", "rollout.engine=vllm"]
    plan = plan_for(base + ["actor.offload_optimizer=true"])  # sleep level 1 (the default): vLLM keeps its weights on the host
    actor, r = plan.stages[0].actor, plan.rollout
    assert r.offloaded == ["optimizer"]
    assert r.actor_kept == pytest.approx(actor.params + actor.grads)
    assert r.sync_total == pytest.approx(actor.params + actor.grads + r.weights + 512 * 2**20 + plan.reserve)
    assert r.host_per_gpu == pytest.approx(actor.main_params + actor.optimizer + r.weights)
    # An engine that never sleeps keeps its pool through the sync: the bucket must fit next to it.
    awake = plan_for(base + OFFLOAD_ALL + ["rollout.free_cache_engine=false"]).rollout
    assert awake.sync_total == pytest.approx(actor.params + awake.pool + 512 * 2**20 + plan.reserve)
    room = plan.gpu_memory - actor.params - 512 * 2**20 - plan.reserve
    assert awake.max_gpu_memory_utilization == pytest.approx(room / plan.gpu_memory)
    assert awake.host_per_gpu == pytest.approx(actor.total - actor.grads)  # nothing sleeps: no engine weights on the host
    assert plan_for(base + ["rollout.engine=sglang"]).rollout.host_per_gpu == 0  # SGLang drops them at any level


def test_plan_without_transformer_engine_counts_the_unfused_swiglu():
    base = ["parallel.tp=4", "parallel.sequence_parallel=true"]
    fused, unfused = plan_for(base), plan_for(base + ["model.transformer_engine='off'"])  # quoted: YAML reads off as false
    model = known("qwen2.5-7b")
    extra = model.num_layers * 2 * model.ffn_hidden_size / 4
    assert unfused.stages[0].activation_per_token == pytest.approx(fused.stages[0].activation_per_token + extra)
    assert any("transformer_engine=off" in note for note in unfused.notes)


def test_plan_pipeline_binding_stage():
    plan = plan_for(["parallel.tp=2", "parallel.pp=2", "parallel.sequence_parallel=true"], model="qwen2.5-32b", nodes=4)
    assert len(plan.stages) == 2
    # Stage 0 holds two micro-batches in flight, the last stage one plus the logits.
    s0, s1 = plan.stages
    assert s0.activation_per_token_no_recompute > s1.activation_per_token_no_recompute
    assert plan.binding_stage == min(plan.stages, key=lambda s: s.max_tokens).stage


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["parallel.tp=8"], "'parallel.tp'=8 does not divide the model's num_attention_heads=28: use parallel.tp in {1, 2, 4, 7, 14, 28}"),
        (["parallel.tp=7", "rollout.tp=7"], "'parallel.tp'=7 does not divide the model's num_key_value_heads=4"),
        (["parallel.pp=8"], "num_hidden_layers=28 is not divisible by parallel.pp x parallel.vpp = 8"),
        (["rollout.tp=8"], "'rollout.tp'=8 does not divide the model's num_attention_heads=28"),
        (["parallel.tp=2", "parallel.pp=3"], "world size 16 is not divisible by parallel.tp x parallel.pp x parallel.cp"),
    ],
)
def test_plan_errors_reuse_config_messages(overrides, message):
    with pytest.raises(ConfigError) as error:
        plan_for(overrides, nodes=1, gpus_per_node=14 if "parallel.tp=7" in overrides else 16)
    assert message in str(error.value)


def test_kv_cache_is_the_pool_minus_weights_and_vllm_activations():
    plan = plan_for(["parallel.tp=4", "rollout.tp=2", "rollout.engine=vllm"])
    r = plan.rollout
    assert (r.max_num_batched_tokens, r.max_num_seqs) == (16384, 1024) and r.activation_in_pool
    assert r.activation_peak == mp.vllm_activation_peak(known("qwen2.5-7b"), 2, 16384, 1024)
    assert r.kv_cache == pytest.approx(r.pool - r.weights - r.activation_peak)
    assert r.concurrent_full_sequences == int(r.kv_cache // (r.kv_bytes_per_token * r.full_sequence_tokens))
    # SGLang's static fraction holds weights and KV only: the activations are next to the pool.
    sglang = plan_for(["parallel.tp=4", "rollout.tp=2", "rollout.engine=sglang"])
    g = sglang.rollout
    assert not g.activation_in_pool and g.kv_cache == pytest.approx(g.pool - g.weights)
    # SGLang runs in the leader placement: one engine per actor replica (DP = 16 / TP 4 = 4) instead of
    # vLLM's spmd one per rollout-TP group (16 / 2 = 8), so each engine's gathered results are twice as many.
    assert (g.engines, r.engines) == (4, 8) and g.result_buffers == pytest.approx(2 * r.result_buffers, rel=0.01)
    assert g.generation_total - r.generation_total == pytest.approx(r.activation_peak + g.result_buffers - r.result_buffers)
    assert any("sglang" in note for note in sglang.notes)


def test_result_buffers_are_two_engines_of_gathered_rollouts():
    """`experience.pack_samples`: 8 bytes per response token, 4 per prompt token; a rank holds the buffer
    it receives and the previous one (tensor_gather.share_from_contributors)."""
    overrides = ["parallel.tp=4", "rollout.tp=2", "trainer.gen_batch_size=64", "trainer.train_batch_size=64", "rollout.n=16",
                 "rollout.max_prompt_length=1024", "rollout.max_response_length=8192"]  # fmt: skip
    plan = plan_for(overrides + ["rollout.engine=vllm"])  # spmd: one engine per rollout-TP group, 16 / 2
    r = plan.rollout
    assert r.engines == 8 and r.generation_sequences_per_engine == 64 * 16 // 8
    one_engine = 128 * 8192 * 8 + 8 * 1024 * 4  # 128 responses of 8 prompts
    assert r.result_buffers == 2 * one_engine
    assert r.generation_total == pytest.approx(r.actor_kept + r.pool + r.result_buffers + plan.reserve)
    # The leader placement (the embedded engine, SGLang) has one engine per actor replica: DP = 16 / 4.
    leader = plan_for(overrides).rollout
    assert leader.engines == 4 and leader.generation_sequences_per_engine == 64 * 16 // 4
    assert leader.result_buffers == 2 * (256 * 8192 * 8 + 16 * 1024 * 4)  # 256 responses of 16 prompts


MOE = ["parallel.tp=2", "parallel.sequence_parallel=true", "parallel.ep=8"]
# A batch that splits over 12 data-parallel ranks.
BATCH_OF_24 = ["trainer.train_batch_size=24", "trainer.gen_batch_size=24", "trainer.ppo_mini_batch_size=24"]


@pytest.mark.parametrize(
    "model, overrides, gpus, message",
    [
        ("qwen3-30b-a3b", ["parallel.ep=3", *BATCH_OF_24], 12,
         "parallel.ep=3 does not divide the model's num_experts=128: use parallel.ep in {1, 2, 4, 8, 16, 32, 64, 128}"),
        ("qwen3-30b-a3b", ["parallel.tp=2", "parallel.sequence_parallel=true", "parallel.ep=16"], 16,
         "parallel.ep x parallel.tp = 16 x 2 = 32 does not divide the 16 ranks of a pipeline stage"),
        ("qwen3-30b-a3b", ["parallel.tp=2", "parallel.ep=8"], 16,
         "training a mixture-of-experts model at parallel.tp=2 needs sequence parallelism: set parallel.sequence_parallel=true"),
        ("qwen2.5-7b", ["parallel.ep=2"], 16,
         "parallel.ep=2 needs a mixture-of-experts model (the model has no experts): set parallel.ep=1"),
    ],
)  # fmt: skip
def test_expert_parallel_layout_errors_are_config_errors(model, overrides, gpus, message):
    """The layout's expert-parallel rules reach the planner's caller as ConfigError (exit 2 from `plan`)."""
    with pytest.raises(ConfigError) as error:
        plan_for(overrides, model=model, nodes=1, gpus_per_node=gpus)
    assert message in str(error.value)


def test_moe_plan_sums_the_parts_and_dense_plans_have_none():
    plan = plan_for([*MOE, "model.recompute_activations=true"], model="qwen3-30b-a3b")
    moe = plan.moe
    assert (moe.num_experts, moe.experts_per_token, moe.ep, moe.expert_tp, moe.expert_dp) == (128, 8, 8, 2, 1)
    assert moe.active_parameters == mp.hf_active_parameter_count(known("qwen3-30b-a3b"))
    assert moe.hf_expert_parameters == 48 * 128 * 3 * 2048 * 768 and not moe.shared_expert
    assert moe.dispatch_bytes_per_token == 2 * 8 * 2 * 2048 and moe.dispatcher == "alltoall"
    stage, part = plan.stages[0], moe.stages[0]
    assert stage.parameters == part.dense_parameters + part.expert_parameters
    by_part = part.dense_distributed_optimizer.total + part.expert_distributed_optimizer.total
    assert stage.actor.total == pytest.approx(by_part)
    full = mp.stage_activation_bytes(known("qwen3-30b-a3b"), 2, 1, 0, sequence_parallel=True, recompute=True, ep=8)
    assert stage.activation_per_token == full.per_token
    assert any("routing counted as balanced" in note for note in plan.notes)
    raw = plan.to_dict()
    assert raw["moe"]["stages"][0]["expert_distributed_optimizer"]["total"] == part.expert_distributed_optimizer.total
    assert raw["moe"]["ep"] == 8
    dense = plan_for(["parallel.tp=4", "parallel.sequence_parallel=true"])
    assert dense.moe is None and "moe" not in dense.to_dict()
    assert not any("mixture of experts" in note for note in dense.notes)
    # Over pipeline stages each stage's experts are its layers' (PP=2 on 32 GPUs: DP=8, expert DP=1).
    piped = plan_for([*MOE, "parallel.pp=2"], model="qwen3-30b-a3b", nodes=4)
    assert [s.expert_parameters for s in piped.moe.stages] == [part.expert_parameters // 2] * 2


def test_moe_routing_is_counted_in_host_memory_in_its_compact_type():
    """The engine's routing in host memory (`memory.routing_host_bytes`): what a generating rank keeps
    plus its replica's rows of the train batch, L x k entries per token read, 1 byte each up to 128
    experts (`actor.routing.routing_dtype`); none on a GPU, none where the engine returns no routing."""
    import torch

    from megatron_dapo.actor.routing import routing_dtype

    for experts in (8, 128, 129, 40000):
        assert mp.routing_entry_bytes(experts) == torch.empty(0, dtype=routing_dtype(experts)).element_size()
    model = known("qwen3-30b-a3b")
    overrides = ["parallel.tp=2", "parallel.ep=8", "parallel.sequence_parallel=true", "rollout.engine=vllm", "rollout.tp=2",
                 "trainer.gen_batch_size=32", "trainer.train_batch_size=32", "rollout.n=8",
                 "rollout.max_prompt_length=1024", "rollout.max_response_length=3072", "algorithm.overlong_buffer.len=1024"]  # fmt: skip
    replayed = plan_for(overrides + ["actor.router_replay=r3"], model="qwen3-30b-a3b")
    per_token = model.num_layers * model.num_experts_per_tok * 1  # 48 x 8 entries of one byte (128 experts)
    # 16 GPUs: 8 spmd engines (rollout TP 2) each keep their 32 x 8 / 8 sequences; DP = 16 / 2 = 8
    # replicas each receive their 32 x 8 / 8 rows of the train batch (`trainer/routing_exchange.py`).
    kept, received = 32 * 8 // 8, 32 * 8 // replayed.dp
    assert per_token == 384 and replayed.rollout.routing_host_per_gpu == (kept + received) * 4096 * per_token
    assert "MoE routing kept + received" in mp.format_plan(replayed)
    off = plan_for(overrides + ["actor.router_replay=off"], model="qwen3-30b-a3b")
    assert off.rollout.routing_host_per_gpu == 0 and off.rollout.result_buffers == replayed.rollout.result_buffers


def test_separate_placement_plans_each_pool_on_its_own_gpus():
    """rollout.placement=separate: 8 of 16 GPUs train (TP=4, DP=2), 8 hold 2 engines of TP=4. A
    rollout GPU holds the pool and a push's bucket, no actor; a trainer GPU the whole actor, no pool
    (whatever rollout.free_cache_engine says), and between updates one bucket or the gathered results."""
    base = ["parallel.tp=4", "parallel.sequence_parallel=true", "trainer.max_tokens_per_micro_batch=32768", "rollout.tp=4"]
    separate = base + ["rollout.placement=separate", "rollout.num_gpus=8", "rollout.gpu_memory_utilization=0.8"]
    plan = plan_for(separate + ["rollout.free_cache_engine=false"])
    colocated = plan_for(base + ["rollout.gpu_memory_utilization=0.4"])
    gib, reserve, bucket = mp.GIB, plan.reserve, 512 * 2**20
    assert (plan.placement, plan.world_size, plan.rollout_gpus, plan.dp, plan.rollout.engines) == ("separate", 8, 8, 2, 2)
    r = plan.rollout
    assert r.separate and r.actor_kept == 0 and r.offloaded == [] and r.host_per_gpu == 0
    assert r.generation_total == pytest.approx(r.pool + reserve)  # vLLM: its activations are inside the pool
    assert r.sync_total == pytest.approx(r.pool + bucket + reserve) == pytest.approx(r.phase_total)
    assert r.max_gpu_memory_utilization == pytest.approx((plan.gpu_memory - bucket - reserve) / plan.gpu_memory)
    assert r.concurrent_full_sequences > 2 * colocated.rollout.concurrent_full_sequences  # twice the pool, same TP
    stage = plan.stages[0]
    assert not plan.engine_pool_during_training  # the pool is not on a trainer GPU
    assert stage.training_total == pytest.approx(stage.actor.total + stage.activation_at_budget + reserve)
    assert plan.trainer_between_updates == pytest.approx(stage.actor.total + max(bucket, r.result_buffers) + reserve)
    # DP=2 instead of colocated DP=4: the distributed optimizer shards over half the ranks.
    assert stage.actor.total > colocated.stages[0].actor.total
    table = mp.format_plan(plan)
    assert "rollout.placement=separate: 8 GPUs train, 8 hold the engines (2 engine(s) of rollout.tp=4)" in table
    assert "rollout GPU, receiving a push: pool + bucket" in table and "trainer GPU, training" in table
    assert "actor offload while generating" not in table and "on the engines' own GPUs" in table
    assert plan.fits and r.pool / gib > 60
    # A pool that leaves no room for the push's bucket does not fit.
    assert not plan_for(separate + ["rollout.gpu_memory_utilization=0.99"]).rollout_fits


def test_separate_placement_notes_a_split_that_shares_a_node_and_a_useless_offload():
    # 8 engine GPUs of 24: a whole node of 8, or 1 1/3 nodes of 6 (a node with trainer and engine ranks).
    plan = plan_for(["rollout.placement=separate", "rollout.num_gpus=8", *OFFLOAD_ALL], nodes=3)
    notes = "\n".join(plan.notes)
    assert "whole nodes" not in notes and "actor.offload_* frees nothing useful" in notes
    shared = plan_for(["rollout.placement=separate", "rollout.num_gpus=8"], nodes=4, gpus_per_node=6)
    assert "rollout.num_gpus=8 does not split the 4 node(s) of 6 GPUs into whole nodes" in "\n".join(shared.notes)
    assert not any("whole nodes" in note for note in plan_for(["rollout.placement=separate", "rollout.num_gpus=8"]).notes)


def test_separate_placement_notes_the_routing_the_head_keeps():
    """MoE with the engine's routing in the separate placement: every sample reaches the head, so its
    routing waits there until trained: a generation batch at full length, 1 + max_staleness of them."""
    model = known("qwen3-30b-a3b")
    overrides = ["parallel.tp=2", "parallel.ep=8", "parallel.sequence_parallel=true", "rollout.engine=vllm", "rollout.tp=2",
                 "rollout.placement=separate", "rollout.num_gpus=8", "trainer.gen_batch_size=32", "trainer.train_batch_size=32",
                 "rollout.n=8", "rollout.max_prompt_length=1024", "rollout.max_response_length=3072",
                 "algorithm.overlong_buffer.len=1024", "trainer.max_staleness=2", "algorithm.tis_cap=2"]  # fmt: skip
    batch = 32 * 8 * 4096 * model.num_layers * model.num_experts_per_tok / mp.GIB  # one byte an entry (128 experts)
    notes = "\n".join(plan_for(overrides + ["actor.router_replay=r3"], model="qwen3-30b-a3b", nodes=3).notes)
    assert f"keeps the engines' MoE routing of every sample not yet trained in host memory: {batch:.1f} GiB a generation batch" in notes
    assert f"up to ~{3 * batch:.1f} GiB with trainer.max_staleness=2" in notes
    assert "keeps the engines' MoE routing" not in "\n".join(plan_for(overrides + ["actor.router_replay=r2"], model="qwen3-30b-a3b", nodes=3).notes)
