"""Activation bytes (plan/activations.py) against Megatron's formula: equal under its assumptions,
different by the documented terms for the real architectures, and worked by hand for one recipe;
the MoE layer's terms and the token dispatcher's buffers by hand."""

from __future__ import annotations

import pytest

from megatron_dapo import plan as mp
from megatron_dapo.model.hf_config import read_hf_config
from megatron_dapo.model.mapping import padded_vocab_size
from tests.support.plans import known
from tests.support.plan_references import (
    megatron_activation_bytes,
    megatron_args,
    megatron_layer_activation_bytes_without_sp,
    megatron_like_shape,
)


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


def test_moe_layer_activations_by_hand_qwen3_30b_a3b_tp2():
    """Attention and the four h-wide inputs as for a dense layer; router scores, the top-8 expert input
    rows (gathered over expert-TP: not split by TP) with their SwiGLU intermediates split by TP."""
    model, tp = known("qwen3-30b-a3b"), 2
    h, a, g, d, e, k, i = 2048, 32, 4, 128, 128, 8, 768
    attention = (8 * h) / tp + (2 * (a + 2 * g) * d + 2 * a * d) / tp
    router = 6 * e / tp
    rows = k * (2 * h + 4 + 6 * i / tp)
    assert mp.moe_activation_bytes_per_token(model, tp, True) == router + rows
    assert mp.layer_activation_bytes_per_token(model, tp, True) == attention + router + rows == 69024
    # Unfused SwiGLU (local spec): silu(gate) and the activation before the routing probability, 4I/TP per row.
    assert mp.layer_activation_bytes_per_token(model, tp, True, fused_swiglu=False) == 69024 + k * 4 * i / tp
    # The dense MLP width of the config (intermediate_size, unused by a Qwen3-MoE) does not enter.
    wider = read_hf_config({**mp.KNOWN_MODELS["qwen3-30b-a3b"], "intermediate_size": 99999})
    assert mp.layer_activation_bytes_per_token(wider, tp, True) == 69024


def test_moe_shared_expert_activations():
    from tests.support.tiny_models import tiny_moe_config

    qwen2_moe = read_hf_config(tiny_moe_config("qwen2_moe").to_dict())  # 4 experts of 32, top-2, shared 48, h 64
    assert mp.moe_activation_bytes_per_token(qwen2_moe, 1, False) == 6 * 4 + 2 * (2 * 64 + 4 + 6 * 32) + 6 * 48
    assert mp.moe_activation_bytes_per_token(qwen2_moe, 2, True, fused_swiglu=False) == (
        6 * 4 / 2 + 2 * (2 * 64 + 4 + 10 * 32 / 2) + 8 * 48 / 2
    )


def test_token_dispatch_buffers():
    """In and out, top-k rows of 2h bytes per token, once per stage whatever EP is (alltoall); the
    allgather dispatcher adds the EP x TP group's gathered hidden states."""
    model = known("qwen3-30b-a3b")
    assert mp.dispatch_buffer_bytes_per_token(model, 8) == mp.dispatch_buffer_bytes_per_token(model, 1) == 2 * 8 * 2 * 2048
    assert mp.dispatch_buffer_bytes_per_token(model, 4, "allgather") == 2 * (8 + 4) * 2 * 2048
    assert mp.dispatch_buffer_bytes_per_token(known("qwen2.5-7b"), 1) == 0
    for recompute in (False, True):
        plain = mp.stage_activation_bytes(model, 2, 1, 0, sequence_parallel=True, recompute=recompute, ep=8)
        full_layer = mp.layer_activation_bytes_per_token(model, 2, True)
        layers = 48 * (mp.layer_input_bytes_per_token(model, 2, True) if recompute else full_layer)
        one_layer = full_layer if recompute else 0
        output = mp.TOKEN_ID_BYTES + mp.output_activation_bytes_per_token(model, 2, True)
        assert plain.per_token == pytest.approx(layers + one_layer + output + 2 * 8 * 2 * 2048, rel=1e-12)
