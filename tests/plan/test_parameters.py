"""Parameter counts (plan/parameters.py) against Megatron's formula, transformers' `sum(p.numel())` of
real tiny HF models built here, and the totals published for the built-in models. Megatron-Core's own
count per rank: test_parameters_megatron_core.py."""

from __future__ import annotations

import pytest

from megatron_dapo import plan as mp
from megatron_dapo.model.hf_config import read_hf_config
from megatron_dapo.model.mapping import padded_vocab_size
from tests.plan.conftest import known
from tests.plan.references import (
    PUBLISHED_PARAMETERS,
    megatron_args,
    megatron_parameters,
    qk_norm_per_layer,
    qkv_bias_per_layer,
)


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
