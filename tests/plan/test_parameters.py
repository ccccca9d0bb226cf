"""Parameter counts (plan/parameters.py) against Megatron's formula, transformers' `sum(p.numel())` of
real tiny HF models built here, and the totals published for the built-in models (for the mixtures of
experts the activated parameters too). Megatron-Core's own count per rank, dense and expert:
test_parameters_megatron_core.py."""

from __future__ import annotations

import math

import pytest

from megatron_dapo import plan as mp
from megatron_dapo.config import ConfigError
from megatron_dapo.model.hf_config import read_hf_config
from megatron_dapo.model.mapping import padded_vocab_size
from tests.support.plans import known
from tests.support.plan_references import (
    PUBLISHED_MOE_BILLIONS,
    PUBLISHED_PARAMETERS,
    megatron_args,
    megatron_parameters,
    qk_norm_per_layer,
    qkv_bias_per_layer,
    router_per_layer,
)

MOE_MODELS = sorted(name for name in mp.KNOWN_MODELS if known(name).is_moe)


def test_known_models_have_their_published_parameter_counts():
    assert set(PUBLISHED_PARAMETERS) == set(mp.KNOWN_MODELS)
    for name, expected in PUBLISHED_PARAMETERS.items():
        assert mp.hf_parameter_count(known(name)) == expected, name


def test_moe_models_have_their_published_total_and_active_parameters():
    assert MOE_MODELS == sorted(PUBLISHED_MOE_BILLIONS) == ["qwen3-235b-a22b", "qwen3-30b-a3b"]

    def card(count, digits):  # the cards cut the figure off: 3.35B activated is written 3.3B
        return math.floor(count / 1e9 * 10**digits) / 10**digits

    for name, ((total, total_digits), (active, active_digits)) in PUBLISHED_MOE_BILLIONS.items():
        model = known(name)
        assert card(mp.hf_parameter_count(model), total_digits) == total, name
        assert card(mp.hf_active_parameter_count(model), active_digits) == active, name
    # Qwen3-30B-A3B by hand: attention 18.87M + norms + router 0.26M + 8 of 128 experts of 4.72M, 48
    # layers, two 151936 x 2048 embeddings, the final norm.
    h, layers, expert = 2048, 48, 3 * 2048 * 768
    attention = 2048 * (32 + 2 * 4) * 128 + 32 * 128 * 2048
    per_layer = attention + 2 * h + 2 * 128 + 128 * h
    active = layers * (per_layer + 8 * expert) + 2 * 151936 * h + h
    assert mp.hf_active_parameter_count(known("qwen3-30b-a3b")) == active == 3_353_032_704
    assert mp.hf_parameter_count(known("qwen3-30b-a3b")) == active + layers * 120 * expert
    # A dense model is all active.
    assert mp.hf_active_parameter_count(known("qwen3-8b")) == mp.hf_parameter_count(known("qwen3-8b"))


@pytest.mark.parametrize("name", sorted(mp.KNOWN_MODELS))
def test_parameter_count_matches_megatron_formula(name):
    model = known(name)
    total, _ = megatron_parameters(megatron_args(model, vocab=model.vocab_size))
    # Megatron's formula has no QKV bias (Qwen2), no per-head q/k norms (Qwen3) and no MoE router.
    extra = model.num_layers * (qkv_bias_per_layer(model) + qk_norm_per_layer(model) + router_per_layer(model))
    assert mp.hf_parameter_count(model) == total + extra


@pytest.mark.parametrize("arch", ["qwen2", "qwen2_tied", "llama3", "qwen3", "qwen3_moe", "qwen2_moe"])
def test_parameter_count_matches_transformers_model(arch):
    from tests.support.tiny_models import build_tiny_model, tiny_config

    hf_model = build_tiny_model(arch)
    numel = sum(p.numel() for p in hf_model.parameters())  # tied weights are one parameter
    assert mp.hf_parameter_count(read_hf_config(tiny_config(arch).to_dict())) == numel


def test_rollout_weights_sum_to_the_model_over_engine_ranks():
    for name in ("qwen2.5-7b", "qwen3-8b", "qwen2.5-0.5b", "qwen3-30b-a3b"):
        model = known(name)
        assert mp.rollout_weight_parameters(model, 1) == mp.hf_parameter_count(model)
        layer = mp.layer_parameters(model)
        replicated = model.num_layers * layer.replicated + model.hidden_size  # on every engine rank
        tp = 2
        assert tp * mp.rollout_weight_parameters(model, tp) == mp.hf_parameter_count(model) + (tp - 1) * replicated


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


def test_moe_layer_parts():
    """Router and shared-expert gate on every rank, the shared expert split like an MLP, the experts apart."""
    from tests.support.tiny_models import tiny_moe_config

    qwen2_moe = read_hf_config(tiny_moe_config("qwen2_moe").to_dict())  # h 64, 4 experts of 32, shared 48
    layer = mp.layer_parameters(qwen2_moe)
    h, heads, groups, d = 64, 4, 2, 16
    attention = h * (heads + 2 * groups) * d + (heads + 2 * groups) * d + heads * d * h
    assert layer.tensor_parallel == attention + 3 * h * 48
    assert layer.replicated == 2 * h + 4 * h + h  # norms, router [4, h], shared-expert gate [1, h]
    assert layer.expert == 4 * 3 * h * 32


@pytest.mark.parametrize("name", MOE_MODELS)
def test_expert_parameters_divide_by_ep_and_tp(name):
    model = known(name)
    whole = mp.stage_parameter_split(model, 1, 1, 0, ep=1)
    assert whole.expert == model.num_layers * mp.layer_parameters(model).expert
    for tp, ep in [(1, 8), (2, 8), (4, 4), (2, 16), (4, 32), (1, 128)]:
        split = mp.stage_parameter_split(model, tp, 1, 0, ep=ep)
        assert split.expert * ep * tp == whole.expert  # whole experts over EP, each over expert-TP = TP
        assert split.dense == mp.stage_parameter_split(model, tp, 1, 0, ep=1).dense  # EP leaves the dense part
        assert split.total == mp.stage_parameters(model, tp, 1, 0, ep=ep)
    # Over pipeline stages the experts go with their layers.
    stages = [mp.stage_parameter_split(model, 2, 2, s, ep=8) for s in (0, 1)]
    assert stages[0].expert == stages[1].expert == mp.stage_parameter_split(model, 2, 1, 0, ep=8).expert // 2


def test_dense_stage_has_no_expert_part():
    split = mp.stage_parameter_split(known("qwen2.5-7b"), 4, 2, 1)
    assert split.expert == 0 and split.dense == mp.stage_parameters(known("qwen2.5-7b"), 4, 2, 1)


def test_bad_expert_parallel_sizes_are_config_errors():
    moe, dense = known("qwen3-30b-a3b"), known("qwen2.5-7b")
    with pytest.raises(ConfigError, match=r"parallel.ep=3 does not divide the model's num_experts=128: use parallel.ep in"):
        mp.stage_parameters(moe, 1, 1, 0, ep=3)
    with pytest.raises(ConfigError, match=r"parallel.ep=2 needs a mixture-of-experts model .*: set parallel.ep=1"):
        mp.stage_parameters(dense, 1, 1, 0, ep=2)
    # TP must split each expert (and the shared expert): the MoE width is what it is checked against.
    odd = read_hf_config({**mp.KNOWN_MODELS["qwen3-30b-a3b"], "moe_intermediate_size": 100})
    with pytest.raises(ConfigError, match=r"'parallel.tp'=8 does not divide the model's moe_intermediate_size=100"):
        mp.stage_parameters(odd, 8, 1, 0, ep=8)
    with pytest.raises(ConfigError, match=r"'rollout.tp'=8 does not divide the model's moe_intermediate_size=100"):
        mp.rollout_weight_parameters(odd, 8)
