"""Actor state and rollout-engine bytes (plan/memory.py): weight + optimizer bytes against Megatron's
formula, a mixture of experts' dense and expert parts under EP, the KV cache, and vLLM's batch
defaults (the installed source) and the activation peak its start-up profiling logs for published
configurations."""

from __future__ import annotations

from pathlib import Path

import pytest

from megatron_dapo import plan as mp
from tests.support.plan_references import megatron_args, megatron_weight_and_optimizer_bytes, qk_norm_per_layer, qkv_bias_per_layer
from tests.support.plans import known, plan_for


def test_kv_cache_per_token():
    assert mp.kv_cache_bytes_per_token(known("qwen2.5-7b"), 2) == 2 * 28 * 2 * 128 * 2  # 4 KV heads / 2
    assert mp.kv_cache_bytes_per_token(known("qwen2.5-32b"), 8) == 2 * 64 * 1 * 128 * 2
    # rollout TP 16 > 8 KV heads: each GPU keeps a replicated head, as vLLM does
    assert mp.kv_cache_bytes_per_token(known("llama-3.1-70b"), 16) == 2 * 80 * 1 * 128 * 2
    weights = mp.rollout_weight_parameters(known("llama-3.1-70b"), 16)
    assert weights > mp.hf_parameter_count(known("llama-3.1-70b")) / 16  # K/V weights replicated too


@pytest.mark.parametrize("distributed_optimizer", [True, False])
def test_qwen7b_tp4_dp2_weight_and_optimizer_bytes_match_megatron(distributed_optimizer):
    model, tp, pp, dp = known("qwen2.5-7b"), 4, 1, 2
    ours = mp.actor_memory(mp.stage_parameters(model, tp, pp, 0), "bfloat16", dp if distributed_optimizer else 1)
    reference = megatron_weight_and_optimizer_bytes(megatron_args(model, tp, pp, dp, distributed_optimizer=distributed_optimizer))
    bytes_per_parameter = 6 + 12 / dp if distributed_optimizer else 18
    assert ours.total / mp.stage_parameters(model, tp, pp, 0) == pytest.approx(bytes_per_parameter, rel=1e-12)
    # Megatron's formula leaves out the QKV biases, which are split over TP like the weights.
    bias = model.num_layers * qkv_bias_per_layer(model) / tp
    assert ours.total == pytest.approx(reference + bias * bytes_per_parameter, rel=1e-12)
    # 1.904B parameters per GPU x 12 or 18 bytes.
    assert ours.total / mp.GIB == pytest.approx(21.28 if distributed_optimizer else 31.92, abs=0.01)


@pytest.mark.parametrize("name, tp, pp, dp", [("qwen2.5-32b", 4, 2, 4), ("qwen2.5-0.5b", 2, 1, 4), ("qwen3-8b", 2, 4, 1)])
def test_weight_and_optimizer_bytes_per_stage_match_megatron(name, tp, pp, dp):
    model = known(name)
    for distributed_optimizer in (True, False):
        reference = megatron_weight_and_optimizer_bytes(megatron_args(model, tp, pp, dp, distributed_optimizer=distributed_optimizer))
        bytes_per_parameter = 6 + 12 / dp if distributed_optimizer else 18
        extra = model.num_layers / pp * (qkv_bias_per_layer(model) / tp + qk_norm_per_layer(model))
        # Megatron's "most loaded shard" spreads the final norm over all stages (h / pp each); it lives
        # on the last one. Otherwise the first stage (embedding) and the last (output layer) are equal.
        h = model.hidden_size
        first = reference + (extra - h / pp) * bytes_per_parameter
        last = reference + (extra + h - h / pp) * bytes_per_parameter
        shards = dp if distributed_optimizer else 1
        stage_bytes = [mp.actor_memory(mp.stage_parameters(model, tp, pp, s), "bfloat16", shards).total for s in range(pp)]
        assert stage_bytes[0] == pytest.approx(first if pp > 1 else last, rel=1e-12)
        assert stage_bytes[-1] == pytest.approx(last, rel=1e-12)


def test_fp32_actor_has_no_separate_main_weights():
    memory = mp.actor_memory(1000, "float32", optimizer_shards=4)
    assert (memory.params, memory.grads, memory.main_params, memory.optimizer) == (4000, 4000, 0, 2000)


def test_vllm_batch_defaults_follow_vllm():
    """Contract with vLLM's `EngineArgs.get_batch_defaults` (installed vLLM's source, when present):
    the offline LLM class gets 16384 tokens / 1024 sequences on >= 70 GiB GPUs other than the A100,
    8192 / 256 elsewhere."""
    assert mp.vllm_batch_defaults(79.1, "h100") == (16384, 1024)
    assert mp.vllm_batch_defaults(139.8, "h200") == (16384, 1024)
    assert mp.vllm_batch_defaults(79.1, "a100-80gb") == (8192, 256)
    assert mp.vllm_batch_defaults(39.3, "a100-40gb") == (8192, 256)
    import importlib.util

    spec = importlib.util.find_spec("vllm")
    if spec is None:
        pytest.skip("vLLM is not installed: the source contract is checked where it is")
    source = (Path(spec.origin).parent / "engine" / "arg_utils.py").read_text()
    branch = source[source.index("elif device_memory >= 70 * GiB_bytes and \"a100\" not in device_name:"):]
    branch = branch[: branch.index("else:")]
    assert "UsageContext.LLM_CLASS: 16384" in branch and "UsageContext.LLM_CLASS: 1024" in branch
    fallback = source[source.index("# TODO(woosuk): Tune the default values for other hardware."):][:400]
    assert "UsageContext.LLM_CLASS: 8192" in fallback and "UsageContext.LLM_CLASS: 256" in fallback


def test_vllm_activation_peak_reproduces_published_profiles():
    """The estimate against vLLM's own start-up lines ("PyTorch activation peak memory takes ..."):
    Qwen2.5-7B, TP=1, 32768 profiled tokens, 256 sequences: 4.35 GiB (forward-bound); Llama-3.1-8B,
    TP=1, 8192 tokens, 256 sequences, default raw log-probs: 1.19-1.24 GiB (sampler-bound)."""
    qwen = mp.vllm_activation_peak(known("qwen2.5-7b"), 1, 32768, 256, processed_logprobs=False)
    assert qwen / mp.GIB == pytest.approx(4.35, abs=0.05)
    llama = mp.vllm_activation_peak(known("llama-3.1-8b"), 1, 8192, 256, processed_logprobs=False)
    assert 1.19 <= llama / mp.GIB <= 1.24
    # The recipes' engines: H100 defaults, Qwen's 152k vocabulary, processed log-probs: the sampler run
    # over 1024 rows dominates at any model size and TP.
    for name, tp in (("qwen2.5-7b", 2), ("qwen2.5-32b", 8)):
        peak = mp.vllm_activation_peak(known(name), tp, 16384, 1024)
        assert peak == 1024 * 152064 * 44


MOE = ["parallel.tp=2", "parallel.sequence_parallel=true"]


def test_expert_parallel_divides_the_expert_weights_not_their_optimizer_state():
    """Qwen3-30B-A3B on 16 GPUs at TP=2: EP=8 (expert DP 1) against EP=4 (expert DP 2). The experts'
    weights and grads per GPU halve as EP doubles; their distributed-optimizer state (sharded over
    expert DP = DP x CP / EP) stays; the dense part does not move."""
    model = known("qwen3-30b-a3b")
    plans = {ep: plan_for([*MOE, f"parallel.ep={ep}"], model="qwen3-30b-a3b") for ep in (1, 2, 4, 8)}
    for ep, plan in plans.items():
        moe, part = plan.moe, plan.moe.stages[0]
        assert (moe.ep, moe.expert_tp, moe.expert_dp, moe.experts_per_rank) == (ep, 2, 8 // ep, 128 // ep)
        split = mp.stage_parameter_split(model, 2, 1, 0, ep)
        assert (part.dense_parameters, part.expert_parameters) == (split.dense, split.expert)
        # dense: 6 + 12 / (DP x CP) bytes per parameter; experts: 6 + 12 / expert DP
        assert part.dense_distributed_optimizer.total == pytest.approx(split.dense * (6 + 12 / 8), rel=1e-12)
        assert part.expert_distributed_optimizer.total == pytest.approx(split.expert * (6 + 12 / (8 // ep)), rel=1e-12)
        assert part.expert_plain_optimizer.total == pytest.approx(split.expert * 18, rel=1e-12)
        stage = plan.stages[0]
        assert stage.actor.total == pytest.approx(part.dense_distributed_optimizer.total + part.expert_distributed_optimizer.total)
        assert stage.actor_plain_optimizer.total == pytest.approx(split.total * 18, rel=1e-12)
        assert stage.parameters == split.total
    for ep in (2, 4, 8):
        now, before = plans[ep].moe.stages[0], plans[ep // 2].moe.stages[0]
        assert now.expert_parameters * 2 == before.expert_parameters
        assert now.expert_distributed_optimizer.params * 2 == before.expert_distributed_optimizer.params
        assert now.expert_distributed_optimizer.grads * 2 == before.expert_distributed_optimizer.grads
        assert now.expert_distributed_optimizer.optimizer == pytest.approx(before.expert_distributed_optimizer.optimizer)
        assert now.dense_distributed_optimizer == before.dense_distributed_optimizer
    # Without the distributed optimizer every rank keeps all optimizer state of what it holds.
    plain = plan_for([*MOE, "parallel.ep=8", "parallel.use_distributed_optimizer=false"], model="qwen3-30b-a3b")
    assert plain.stages[0].actor == plain.stages[0].actor_plain_optimizer


def test_moe_rollout_weights_and_engine_activations():
    """Every expert split over rollout.tp, the router on every engine GPU; the engine's forward peak
    uses the fused-MoE workspace of the top-k experts (the sampler still dominates at vLLM's defaults)."""
    model = known("qwen3-30b-a3b")
    h, layers = 2048, 48
    for tp in (1, 2, 4):
        attention_kv = 2 * h * max(1, 4 // tp) * 128
        q_and_o = 2 * h * 32 * 128 // tp
        experts = 128 * 3 * h * 768 // tp
        per_layer = q_and_o + attention_kv + experts + 2 * h + 2 * 128 + 128 * h
        assert mp.rollout_weight_parameters(model, tp) == layers * per_layer + 2 * 151936 * h // tp + h
    forward = 16384 * 2 * (8 * (max(2 * 768 / 4, h) + 768 / 4) + 4 * h)
    sampler = 1024 * 151936 * 44
    assert mp.vllm_activation_peak(model, 4, 16384, 1024) == max(forward, sampler) == sampler
    assert mp.vllm_activation_peak(model, 4, 262144, 1) == forward * 16
