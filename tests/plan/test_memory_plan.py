"""The memory planner against independent references.

* Megatron-LM's own theoretical memory formula, transcribed below (it is not part of the
  megatron-core package): parameter count, weight + optimizer bytes per GPU with and without the
  distributed optimizer, and activation bytes, for known configurations. Where our count differs
  on purpose (QKV bias, Qwen3's q/k norms, grouped-query K/V, a gated MLP, no dropout masks,
  token ids not split by TP, the final norm on the last stage) the difference is written out term
  by term; under Megatron's own assumptions the numbers are equal.
* transformers: `sum(p.numel())` of real tiny HF models built locally.
* Megatron-Core: the parameters each rank of a real `GPTModel` holds at TP=2 x PP=2 and PP=2 x VPP=2
  (4 processes, gloo), stage by stage.
* The parameter counts published for the public models of the built-in table.
* vLLM: its batch defaults (the installed source), the activation peak its start-up profiling logs
  for published configurations, and the GPU capacities torch and vLLM report.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from megatron_dapo.plan import memory as mp
from megatron_dapo.config import ConfigError, load_config
from megatron_dapo.model.hf_config import read_hf_config
from megatron_dapo.model.mapping import padded_vocab_size

REPO = Path(__file__).resolve().parents[2]

# ---------------------------------------------------------------------------------------------
# Reference: Megatron-LM's theoretical memory formula, transcribed from
# megatron/training/theoretical_memory_usage.py of NVIDIA/Megatron-LM at commit
# d98e8a64ddf34856e74b24714e3bedb2f5a39553 (compute_weight_and_optimizer_memory,
# compute_activation_memory, compute_activation_memory_without_sp), dense GPT path only: no MoE,
# multi-latent attention or multi-token prediction. `args` carries Megatron's argument names.
# ---------------------------------------------------------------------------------------------


def megatron_args(model, tp=1, pp=1, dp=1, *, distributed_optimizer=True, seq_length=1, vpp=None, vocab=None):
    return SimpleNamespace(
        hidden_size=model.hidden_size,
        kv_channels=model.head_dim,
        num_attention_heads=model.num_attention_heads,
        num_query_groups=model.num_key_value_heads,
        group_query_attention=model.num_key_value_heads != model.num_attention_heads,
        swiglu=True,
        ffn_hidden_size=model.ffn_hidden_size,
        normalization="RMSNorm",
        padded_vocab_size=vocab if vocab is not None else padded_vocab_size(model.vocab_size, tp),
        untie_embeddings_and_output_weights=not model.tie_word_embeddings,
        num_layers=model.num_layers,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vpp,
        data_parallel_size=dp,
        use_distributed_optimizer=distributed_optimizer,
        seq_length=seq_length,
        micro_batch_size=1,
    )


def megatron_parameters(args):
    """(total parameters, parameters on the most loaded model shard)."""
    query_projection = args.kv_channels * args.num_attention_heads
    groups = args.num_query_groups if args.group_query_attention else args.num_attention_heads
    gated = 3 / 2 if args.swiglu else 1
    norm = 1 if args.normalization == "RMSNorm" else 2
    attention = 2 * args.hidden_size * args.hidden_size * (
        (1 + groups / args.num_attention_heads) * query_projection / args.hidden_size
    )
    mlp = 2 * args.hidden_size * args.ffn_hidden_size * gated
    layernorms = 2 * args.hidden_size * norm
    embedding = args.hidden_size * args.padded_vocab_size
    final_norm = norm * args.hidden_size
    embeddings = 2 * embedding if args.untie_embeddings_and_output_weights else embedding
    total = (attention + mlp + layernorms) * args.num_layers + final_norm + embeddings

    tp_sharded = (attention + mlp) * args.num_layers
    replicated = layernorms * args.num_layers + final_norm
    most_loaded = (tp_sharded / args.pipeline_model_parallel_size + embedding) / args.tensor_model_parallel_size
    most_loaded += replicated / args.pipeline_model_parallel_size
    if args.untie_embeddings_and_output_weights and args.pipeline_model_parallel_size == 1:
        most_loaded += embedding / args.tensor_model_parallel_size
    return total, most_loaded


def megatron_weight_and_optimizer_bytes(args):
    bytes_per_parameter = 6 + 12 / args.data_parallel_size if args.use_distributed_optimizer else 18
    return megatron_parameters(args)[1] * bytes_per_parameter


def _megatron_pipeline_factor(args, value, num_microbatches):
    pp, vpp = args.pipeline_model_parallel_size, args.virtual_pipeline_model_parallel_size
    if vpp is not None:
        value *= 1 + (pp - 1) / (pp * vpp)
    if vpp is None and pp > 1 and num_microbatches is not None:
        value *= min(1, num_microbatches / pp)
    return value


def megatron_activation_bytes(args, num_microbatches=None):
    """compute_activation_memory: sequence parallel + selective recompute, first pipeline stage."""
    sbh = args.seq_length * args.micro_batch_size * args.hidden_size
    memory = sbh * (18 + 4 * args.ffn_hidden_size / args.hidden_size) * args.num_layers
    memory += 8 * args.seq_length * args.micro_batch_size * args.pipeline_model_parallel_size
    memory += sbh * args.pipeline_model_parallel_size
    memory = _megatron_pipeline_factor(args, memory, num_microbatches)
    if args.pipeline_model_parallel_size == 1:
        memory += sbh * 4 * (1 + args.padded_vocab_size / args.hidden_size)
    return memory / args.tensor_model_parallel_size


def megatron_layer_activation_bytes_without_sp(args):
    """compute_activation_memory_without_sp, the per-layer term (it assumes ffn = 4h)."""
    sbh = args.seq_length * args.micro_batch_size * args.hidden_size
    return sbh * (10 + 24 / args.tensor_model_parallel_size)


# ---------------------------------------------------------------------------------------------
# Helpers
# ---------------------------------------------------------------------------------------------


def known(name):
    return mp.known_model(name)


def megatron_like_shape(hidden=1024, heads=16, ffn=None, layers=8, vocab=32000):
    """A shape that meets Megatron's activation-formula assumptions: multi-head, heads x head_dim = hidden."""
    return read_hf_config(
        {
            "architectures": ["LlamaForCausalLM"],
            "hidden_size": hidden,
            "intermediate_size": ffn or 4 * hidden,
            "num_hidden_layers": layers,
            "num_attention_heads": heads,
            "num_key_value_heads": heads,
            "vocab_size": vocab,
            "max_position_embeddings": 4096,
        }
    )


def qkv_bias_per_layer(model):
    return (model.num_attention_heads + 2 * model.num_key_value_heads) * model.head_dim if model.qkv_bias else 0


def qk_norm_per_layer(model):
    return 2 * model.head_dim if model.qk_norm else 0


# ---------------------------------------------------------------------------------------------
# Parameter counts
# ---------------------------------------------------------------------------------------------

# Totals published on the Hugging Face model pages (safetensors parameter count) of these models.
PUBLISHED_PARAMETERS = {
    "qwen2.5-0.5b": 494_032_768,
    "qwen2.5-1.5b": 1_543_714_304,
    "qwen2.5-7b": 7_615_616_512,
    "qwen2.5-14b": 14_770_033_664,
    "qwen2.5-32b": 32_763_876_352,
    "qwen2.5-72b": 72_706_203_648,
    "llama-3.1-8b": 8_030_261_248,
    "llama-3.1-70b": 70_553_706_496,
    "qwen3-8b": 8_190_735_360,
    "qwen3-32b": 32_762_123_264,
}


def test_known_models_have_their_published_parameter_counts():
    assert set(PUBLISHED_PARAMETERS) == set(mp.KNOWN_MODELS)
    for name, expected in PUBLISHED_PARAMETERS.items():
        assert mp.hf_parameter_count(known(name)) == expected, name


@pytest.mark.parametrize("name", sorted(mp.KNOWN_MODELS))
def test_parameter_count_matches_megatron_formula(name):
    model = known(name)
    total, _ = megatron_parameters(megatron_args(model, vocab=model.vocab_size))
    # Megatron's formula has no QKV bias (Qwen2) and no per-head q/k norms (Qwen3).
    extra = model.num_layers * (qkv_bias_per_layer(model) + qk_norm_per_layer(model))
    assert mp.hf_parameter_count(model) == total + extra


@pytest.mark.parametrize("arch", ["qwen2", "qwen2_tied", "llama3", "qwen3"])
def test_parameter_count_matches_transformers_model(arch):
    from tiny_models import build_tiny_model, tiny_config

    hf_model = build_tiny_model(arch)
    numel = sum(p.numel() for p in hf_model.parameters())  # tied weights are one parameter
    assert mp.hf_parameter_count(read_hf_config(tiny_config(arch).to_dict())) == numel


def test_rollout_weights_sum_to_the_model_over_engine_ranks():
    for name in ("qwen2.5-7b", "qwen3-8b", "qwen2.5-0.5b"):
        model = known(name)
        assert mp.rollout_weight_parameters(model, 1) == mp.hf_parameter_count(model)
        layer = mp.layer_parameters(model)
        replicated = model.num_layers * layer.replicated + model.hidden_size  # on every engine rank
        tp = 2
        assert tp * mp.rollout_weight_parameters(model, tp) == mp.hf_parameter_count(model) + (tp - 1) * replicated


def test_kv_cache_per_token():
    assert mp.kv_cache_bytes_per_token(known("qwen2.5-7b"), 2) == 2 * 28 * 2 * 128 * 2  # 4 KV heads / 2
    assert mp.kv_cache_bytes_per_token(known("qwen2.5-32b"), 8) == 2 * 64 * 1 * 128 * 2
    # rollout TP 16 > 8 KV heads: each GPU keeps a replicated head, as vLLM does
    assert mp.kv_cache_bytes_per_token(known("llama-3.1-70b"), 16) == 2 * 80 * 1 * 128 * 2
    weights = mp.rollout_weight_parameters(known("llama-3.1-70b"), 16)
    assert weights > mp.hf_parameter_count(known("llama-3.1-70b")) / 16  # K/V weights replicated too


# ---------------------------------------------------------------------------------------------
# Weight + optimizer bytes per GPU
# ---------------------------------------------------------------------------------------------


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


# ---------------------------------------------------------------------------------------------
# Activations
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("tp", [1, 2, 4, 8])
@pytest.mark.parametrize("pp, vpp", [(1, None), (2, None), (4, None), (4, 2)])
@pytest.mark.parametrize("ffn_ratio", [4, 3])
def test_activations_equal_megatron_under_its_assumptions(tp, pp, vpp, ffn_ratio):
    """Multi-head attention, a plain MLP and dropout masks: Megatron's per-stage formula (SP)."""
    hidden = 1024
    model = megatron_like_shape(hidden=hidden, ffn=ffn_ratio * hidden, layers=8)
    seq = 4096
    reference = megatron_activation_bytes(megatron_args(model, tp, pp, seq_length=seq, vpp=vpp))
    ours = mp.stage_activation_bytes(
        model, tp, pp, 0, vpp=vpp, sequence_parallel=True, gated_mlp=False, dropout_masks=True
    )
    # Megatron divides everything by TP at the end, the int64 token ids included; they are not split.
    in_flight = mp.in_flight_microbatches(pp, vpp, 0)
    token_ids = mp.TOKEN_ID_BYTES * seq * in_flight * (1 - 1 / tp)
    assert ours.per_token * seq == pytest.approx(reference + token_ids, rel=1e-12)


@pytest.mark.parametrize("tp", [1, 2, 4, 8])
def test_layer_activations_without_sequence_parallel_equal_megatron(tp):
    model = megatron_like_shape(hidden=2048, heads=16)  # ffn = 4h, as that formula assumes
    seq = 1000
    reference = megatron_layer_activation_bytes_without_sp(megatron_args(model, tp, seq_length=seq))
    ours = mp.layer_activation_bytes_per_token(model, tp, False, gated_mlp=False, dropout_masks=True)
    assert ours * seq == pytest.approx(reference, rel=1e-12)


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_qwen7b_layer_activations_differ_from_megatron_by_documented_terms(tp):
    model = known("qwen2.5-7b")
    h, g, d, f = model.hidden_size, model.num_key_value_heads, model.head_dim, model.ffn_hidden_size
    mha_kv = 4 * (h - g * d)  # Megatron assumes multi-head K and V (2 x 2h); ours are g x d wide
    # Sequence parallel: Megatron's per-layer term is h (18 + 4 f / h) / TP.
    megatron_sp = h * (18 + 4 * f / h) / tp
    expected_sp = (
        megatron_sp
        - 2 * h / tp  # no dropout in our models: no 1-byte masks after attention and MLP
        - mha_kv / tp
        + 2 * f / tp  # SwiGLU saves gate and up (4f) where a plain MLP saves its f-wide input (2f)
    )
    assert mp.layer_activation_bytes_per_token(model, tp, True) == pytest.approx(expected_sp, rel=1e-12)
    # Without sequence parallelism: h (10 + 24 / TP), where 16h of the 24h is the MLP at ffn = 4h.
    megatron = megatron_layer_activation_bytes_without_sp(megatron_args(model, tp, seq_length=1))
    expected = megatron - 2 * h - mha_kv / tp + (6 * f - 16 * h) / tp  # masks are replicated here
    assert mp.layer_activation_bytes_per_token(model, tp, False) == pytest.approx(expected, rel=1e-12)


def test_qwen7b_tp4_stage_activations_vs_megatron():
    """The whole first-and-last stage at TP=4, PP=1, SP, no recompute."""
    model, tp, seq = known("qwen2.5-7b"), 4, 8192
    h, g, d, f = model.hidden_size, model.num_key_value_heads, model.head_dim, model.ffn_hidden_size
    reference = megatron_activation_bytes(megatron_args(model, tp, seq_length=seq)) / seq
    layer_difference = (-2 * h - 4 * (h - g * d) + 2 * f) / tp  # as in the test above
    expected = (
        reference
        + model.num_layers * layer_difference
        - h / tp  # no embedding dropout mask
        + mp.TOKEN_ID_BYTES * (1 - 1 / tp)  # token ids are not split by TP
    )
    # The output side coincides: Megatron's 4 h + 4 V (fp32 logits) and our final-norm and output-layer
    # inputs (2 x 2h) plus bf16 logits and their gradient (2 x 2V), all over TP.
    ours = mp.stage_activation_bytes(model, tp, 1, 0, sequence_parallel=True)
    assert ours.per_token == pytest.approx(expected, rel=1e-12)
    assert ours.fixed == 8 * mp.LOGPROB_CHUNK_TOKENS * padded_vocab_size(model.vocab_size, tp) / tp


def test_full_recompute_by_hand_for_qwen32b_tp8():
    # h=5120, a=40, g=8, d=128, f=27648, 64 layers; V padded to 152576 (multiple of 128 x 8).
    layer_inputs = 64 * 2 * 5120 // 8  # 81920: each layer's input, split by SP
    one_layer = (8 * 5120 + 2 * (40 + 16) * 128 + 2 * 40 * 128 + 6 * 27648) // 8  # 28928, recomputed
    output = (4 * 5120 + 4 * 152576) // 8  # 78848
    ours = mp.stage_activation_bytes(known("qwen2.5-32b"), 8, 1, 0, sequence_parallel=True, recompute=True)
    assert ours.per_token == layer_inputs + one_layer + 8 + output == 189704
    no_recompute = mp.stage_activation_bytes(known("qwen2.5-32b"), 8, 1, 0, sequence_parallel=True)
    assert no_recompute.per_token == 64 * one_layer + 8 + output


def test_in_flight_microbatches():
    assert [mp.in_flight_microbatches(4, None, s) for s in range(4)] == [4, 3, 2, 1]
    assert mp.in_flight_microbatches(1, None, 0) == 1
    for pp, vpp in [(2, 2), (4, 2), (4, 3), (8, 4)]:
        # Stage 0 of the interleaved schedule: Megatron's memory factor.
        assert mp.in_flight_microbatches(pp, vpp, 0) == pytest.approx(pp * (1 + (pp - 1) / (pp * vpp)))
        assert mp.in_flight_microbatches(pp, vpp, pp - 1) == pytest.approx(((vpp - 1) * pp + 1) / vpp)


def test_temperature_keeps_one_more_logits_copy():
    model, tp = known("qwen2.5-7b"), 2
    plain = mp.output_activation_bytes_per_token(model, tp, True, temperature=1.0)
    scaled = mp.output_activation_bytes_per_token(model, tp, True, temperature=0.7)
    assert scaled - plain == 2 * padded_vocab_size(model.vocab_size, tp) / tp


# ---------------------------------------------------------------------------------------------
# Megatron-Core: parameters per rank of a real GPTModel
# ---------------------------------------------------------------------------------------------


def _megatron_rank_parameters(layouts: list) -> dict:
    """Worker (4 processes under torchrun): each rank's parameter count for every tiny architecture."""
    import torch

    from megatron_dapo.distributed import ParallelLayout, init_distributed, teardown
    from megatron_dapo.model.builder import build_gpt_models
    from tiny_models import ARCHS, tiny_config

    rows = []
    for index, spec in enumerate(layouts):
        if index:
            teardown(keep_process_group=True)
        layout = ParallelLayout(tp=spec["tp"], pp=spec["pp"], vpp=spec.get("vpp"))
        init_distributed(layout, timeout_s=240, seed=0)
        from megatron.core import parallel_state as ps

        for arch in ARCHS:
            cfg = read_hf_config(tiny_config(arch).to_dict())
            models = build_gpt_models(cfg, layout, torch.float32, transformer_engine="off", init_weights=False)
            numel = sum(p.numel() for model in models for p in model.parameters())
            rows.append({"layout": spec, "arch": arch, "pp_rank": ps.get_pipeline_model_parallel_rank(), "numel": numel})
    teardown()
    return {"rows": rows}


@pytest.mark.timeout(300)
def test_stage_parameters_match_megatron_models():
    from tiny_models import ARCHS, tiny_config
    from torchrun_utils import run_torchrun_function

    layouts = [{"tp": 2, "pp": 2}, {"tp": 1, "pp": 2, "vpp": 2}]
    result = run_torchrun_function(Path(__file__), "_megatron_rank_parameters", nproc=4, kwargs={"layouts": layouts}, timeout=280)
    result.check()
    rows = [row for rank in result.rank_results for row in rank["rows"]]
    assert len(rows) == 4 * len(layouts) * len(ARCHS)
    for row in rows:
        cfg = read_hf_config(tiny_config(row["arch"]).to_dict())
        expected = mp.stage_parameters(cfg, row["layout"]["tp"], row["layout"]["pp"], row["pp_rank"])
        assert row["numel"] == expected, row


def test_stage_parameters_single_stage_tied_and_untied():
    # PP = 1: a tied model keeps one vocab matrix, an untied one two (vocab padded for TP).
    for name in ("qwen2.5-0.5b", "qwen2.5-7b"):
        model = known(name)
        for tp in (1, 2):
            layer = mp.layer_parameters(model)
            vocab = padded_vocab_size(model.vocab_size, tp) * model.hidden_size // tp
            matrices = 1 if model.tie_word_embeddings else 2
            expected = model.num_layers * (layer.tensor_parallel // tp + layer.replicated) + matrices * vocab + model.hidden_size
            assert mp.stage_parameters(model, tp, 1, 0) == expected


# ---------------------------------------------------------------------------------------------
# The plan and the command line
# ---------------------------------------------------------------------------------------------


def plan_for(overrides, model="qwen2.5-7b", nodes=2, gpus_per_node=8, **kwargs):
    cfg = load_config(None, overrides)
    cluster = mp.ClusterShape(nodes=nodes, gpus_per_node=gpus_per_node)
    return mp.plan_memory(cfg, known(model), cluster, model_name=model, **kwargs)


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


OFFLOAD_ALL = ["actor.offload_params=true", "actor.offload_grads=true", "actor.offload_optimizer=true", "rollout.sleep_level=2"]


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


def test_offload_table_lines():
    table = mp.format_plan(plan_for(["parallel.tp=4", "parallel.sequence_parallel=true", "rollout.tp=2", "rollout.engine=vllm", *OFFLOAD_ALL]))
    assert "actor offload while generating (actor.offload_*)" in table and "params, grads, optimizer" in table
    assert "host memory, pinned (per GPU, per node)" in table
    assert "weight sync: params + kept + engine weights + bucket" in table
    # (79.1 GiB - 6 reserve - 0.94 gathered results) / 79.1 = 0.912, rounded down
    assert "largest rollout.gpu_memory_utilization: 0.91 with this offload (" in table
    assert "with the actor resident, 0.91 with params, grads and optimizer offloaded" in table
    assert "79.1 GiB per GPU (H100 80GB as reported)" in table
    assert "profiled activation peak (16384 tokens, 1024 seqs)" in table and "in the pool" in table
    assert "KV cache (pool - weights - activation peak)" in table
    assert "result buffers while generating (gathered rollouts)" in table


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


def test_cli_json_and_table(capsys):
    code = mp.main(["--model", "qwen2.5-7b", "--nodes", "2", "--json", "parallel.tp=4"])
    out = json.loads(capsys.readouterr().out)
    assert code in (0, 3) and (code == 0) == out["fits"]
    assert out["world_size"] == 16 and out["dp"] == 4 and out["hf_parameters"] == PUBLISHED_PARAMETERS["qwen2.5-7b"]
    assert out["stages"][0]["actor_distributed_optimizer"]["total"] == pytest.approx(
        mp.actor_memory(mp.stage_parameters(known("qwen2.5-7b"), 4, 1, 0), "bfloat16", 4).total
    )
    # Options after the overrides, overrides first: the same plan as a table.
    code = mp.main(["parallel.tp=4", "--nodes", "2", "--model", "qwen2.5-7b"])
    table = capsys.readouterr().out
    assert "largest trainer.max_tokens_per_micro_batch: " + str(out["max_tokens_per_micro_batch"]) in table
    assert "DP=4" in table and "not built (no KL)" in table


def test_cli_errors_and_exit_codes(capsys):
    assert mp.main(["--model", "qwen2.5-7b", "parallel.tp=8"]) == 1
    assert "plan error: 'parallel.tp'=8 does not divide" in capsys.readouterr().err
    assert mp.main(["model.hf_dir=/nonexistent"]) == 1
    assert "pass --model" in capsys.readouterr().err
    # A 72B actor with TP=1 cannot fit one GPU: the plan prints and says so with exit status 3.
    assert mp.main(["--model", "qwen2.5-72b", "--gpus-per-node", "1", "--nodes", "1"]) == 3
    assert "NO" in capsys.readouterr().out


def test_model_shape_from_hf_dir(tmp_path, capsys):
    from tiny_models import tiny_config

    model_dir = tmp_path / "tiny-qwen3"
    model_dir.mkdir()
    (model_dir / "config.json").write_text(json.dumps(tiny_config("qwen3").to_dict()))
    code = mp.main([f"model.hf_dir={model_dir}", "--gpus-per-node", "2", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert code == 0 and out["model_name"] == "tiny-qwen3" and out["architecture"] == "Qwen3ForCausalLM"
    assert out["hf_parameters"] == mp.hf_parameter_count(read_hf_config(model_dir))


def test_tools_script_runs_from_a_checkout():
    result = subprocess.run(
        [sys.executable, str(REPO / "tools" / "plan_memory.py"), "--model", "qwen2.5-0.5b", "--gpus-per-node", "2"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
    )
    assert result.returncode == 0, result.stderr
    assert "memory plan: qwen2.5-0.5b" in result.stdout
    assert int(result.stdout.split("largest trainer.max_tokens_per_micro_batch: ")[1].split()[0]) > 22528


# ---------------------------------------------------------------------------------------------
# What the GPU reports, what vLLM takes from its pool, what the step holds next to it
# ---------------------------------------------------------------------------------------------


def test_gpu_capacity_is_what_torch_reports_not_the_marketing_size():
    """The table keeps the lowest published `total_memory` of each GPU (module doc: PyTorch's
    "total capacity of 79.10 GiB" on an H100 80GB, vLLM's "total_gpu_memory (79.11GiB)".."(79.25GiB)",
    H200 "(139.81GiB)"); the default cluster is H100s and the CLI takes --gpu or --gpu-memory-gib."""
    assert {k: v.memory_gib for k, v in mp.GPU_MODELS.items()} == {
        "h100": 79.1, "h200": 139.8, "a100-80gb": 79.1, "a100-40gb": 39.3,
    }  # fmt: skip
    for model in mp.GPU_MODELS.values():
        marketed = float(model.label.split()[-1].removesuffix("GB"))
        assert marketed - 1.3 < model.memory_gib < marketed  # what the driver leaves of the size on the box
    assert mp.ClusterShape().gpu_memory_bytes == pytest.approx(79.1 * mp.GIB)
    default = plan_for([])
    h200 = mp.plan_memory(load_config(None, []), known("qwen2.5-7b"), mp.ClusterShape(2, 8, 139.8, "h200"))
    assert h200.gpu_memory == pytest.approx(139.8 * mp.GIB) and h200.rollout.pool > default.rollout.pool


def test_cli_gpu_choice(capsys):
    mp.main(["--model", "qwen2.5-7b", "--nodes", "2", "--json", "parallel.tp=4", "--gpu", "h200"])
    assert json.loads(capsys.readouterr().out)["gpu_memory"] == pytest.approx(139.8 * mp.GIB)
    mp.main(["--model", "qwen2.5-7b", "--nodes", "2", "--json", "parallel.tp=4", "--gpu-memory-gib", "78"])
    assert json.loads(capsys.readouterr().out)["gpu_memory"] == pytest.approx(78 * mp.GIB)
    mp.main(["--model", "qwen2.5-7b", "--nodes", "2", "parallel.tp=4"])
    assert "79.1 GiB per GPU (H100 80GB as reported)" in capsys.readouterr().out


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
    assert g.generation_total - r.generation_total == pytest.approx(r.activation_peak)
    assert any("sglang" in note for note in sglang.notes)


def test_result_buffers_are_two_engines_of_gathered_rollouts():
    """`experience.pack_samples`: 8 bytes per response token, 4 per prompt token; a rank holds the buffer
    it receives and the previous one (tensor_gather.share_from_contributors)."""
    plan = plan_for(["parallel.tp=4", "rollout.tp=2", "trainer.gen_batch_size=64", "trainer.train_batch_size=64", "rollout.n=16",
                     "rollout.max_prompt_length=1024", "rollout.max_response_length=8192"])  # fmt: skip
    r = plan.rollout
    assert r.engines == 8 and r.generation_sequences_per_engine == 64 * 16 // 8
    one_engine = 128 * 8192 * 8 + 8 * 1024 * 4  # 128 responses of 8 prompts
    assert r.result_buffers == 2 * one_engine
    assert r.generation_total == pytest.approx(r.actor_kept + r.pool + r.result_buffers + plan.reserve)
