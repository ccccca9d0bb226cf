"""SDPA core attention (megatron_dapo/model/sdpa_attention.py) == Megatron's DotProductAttention == HF.

In this process (no parallel state needed):
- the module's output and q/k/v gradients against a float64 softmax-attention written here (GQA,
  causal, explicit masks with fully masked rows, custom softmax scale, single-query decoding), and
  its refusals;
- causal-mask recognition and its memo (a mask modified in place is checked again);
- the layer spec: only `core_attention` is swapped, the input spec is untouched, "megatron" keeps
  Megatron's module.
In a plain single process (TP=1) and under torchrun with 2 gloo ranks (TP=2), `worker` below:
- the module alone vs Megatron's `DotProductAttention` on random float32 q/k/v with GQA (outputs
  and q/k/v gradients, several mask forms) within 1e-6 scaled by max(1, largest magnitude) - the
  float32 rounding floor: Megatron's own gradients differ from float64 by ~1e-6 where they reach ~8;
- whole tiny Qwen2 and Qwen3 models (GQA; Qwen3 with head_dim != hidden/heads) built with
  attention="sdpa" and "megatron": logits within 1e-5 of each other and of HF transformers (eager,
  float32), and the gradients of a vocab-parallel cross-entropy equal within 1e-5 for every parameter.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from tests.support.torchrun_utils import run_torchrun_function

MODULE_TOL = 1e-6
MODEL_TOL = 1e-5
MODEL_ARCHS = ("qwen2", "qwen3")
BATCH, SEQ_LEN = 2, 24


# ---------------------------------------------------------------------------------------------
# Helpers shared by the in-process tests and the worker
# ---------------------------------------------------------------------------------------------


def _config(heads: int = 8, groups: int = 2, head_dim: int = 16, tp: int = 1, **overrides):
    from megatron.core.transformer.transformer_config import TransformerConfig

    kwargs = dict(
        num_layers=1,
        hidden_size=heads * head_dim,
        num_attention_heads=heads,
        num_query_groups=groups,
        kv_channels=head_dim,
        attention_dropout=0.0,
        hidden_dropout=0.0,
        masked_softmax_fusion=False,
        attention_softmax_in_fp32=True,
        tensor_model_parallel_size=tp,
        use_cpu_initialization=True,
        params_dtype=torch.float32,
    )
    kwargs.update(overrides)
    return TransformerConfig(**kwargs)


def _qkv(sq, sk, b, heads, groups, hn, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(sq, b, heads, hn, generator=g, dtype=dtype)
    k = torch.randn(sk, b, groups, hn, generator=g, dtype=dtype)
    v = torch.randn(sk, b, groups, hn, generator=g, dtype=dtype)
    return q, k, v


def _causal(s: int) -> torch.Tensor:
    from megatron_dapo.model.builder import causal_attention_mask

    return causal_attention_mask(s)


def _scaled_diff(got: torch.Tensor, want: torch.Tensor) -> float:
    """max |got - want| / max(1, max |want|): float32 rounding grows with the values' magnitude
    (Megatron's own float32 gradients differ from float64 by ~1e-6 where they reach ~8)."""
    return float((got.double() - want.double()).abs().max() / max(1.0, float(want.abs().max())))


def _padding_mask(b: int, s: int) -> torch.Tensor:
    """Causal + left padding, True = masked; row 0 of batch 1 sees nothing (fully masked row)."""
    from megatron_dapo.model.builder import causal_attention_mask

    mask = causal_attention_mask(s).expand(b, 1, s, s).clone()
    mask[1, :, :, :3] = True  # batch 1: the first 3 keys are padding
    return mask


# ---------------------------------------------------------------------------------------------
# In-process: against an independent float64 reference
# ---------------------------------------------------------------------------------------------


def _reference(q, k, v, mask, scale):
    """Plain softmax attention in float64; Megatron conventions (mask True = masked, -10000 fill)."""
    sq, b, heads, hn = q.shape
    groups = k.shape[2]
    k = k.double().repeat_interleave(heads // groups, dim=2)
    v = v.double().repeat_interleave(heads // groups, dim=2)
    scores = torch.einsum("qbnh,kbnh->bnqk", q.double(), k) * scale
    if mask is not None:
        scores = scores.masked_fill(mask, -10000.0)
    probs = scores.softmax(dim=-1)
    return torch.einsum("bnqk,kbnh->qbnh", probs, v).reshape(sq, b, heads * hn)


def _sdpa_module(config, mask_type=None, **kwargs):
    from megatron.core.transformer.enums import AttnMaskType

    from megatron_dapo.model.sdpa_attention import SDPADotProductAttention

    module = SDPADotProductAttention(
        config, layer_number=1, attn_mask_type=mask_type or AttnMaskType.causal, attention_type="self", **kwargs
    )
    return module.eval()


@pytest.mark.parametrize("case", ["causal_none", "causal_explicit", "padding", "no_mask", "decode", "scale"])
def test_module_matches_float64_reference(case):
    from megatron.core.transformer.enums import AttnMaskType

    from megatron_dapo.model.builder import causal_attention_mask

    heads, groups, hn, b, s = 8, 2, 16, 2, 12
    config = _config(heads, groups, hn)
    scale = 1.0 / math.sqrt(hn)
    mask_type, kwargs, sq = AttnMaskType.causal, {}, s
    if case == "causal_none":
        mask, ref_mask = None, causal_attention_mask(s)
    elif case == "causal_explicit":
        mask = ref_mask = causal_attention_mask(s)
    elif case == "padding":
        mask = ref_mask = _padding_mask(b, s)
    elif case == "no_mask":
        mask_type, mask, ref_mask = AttnMaskType.no_mask, None, None
    elif case == "decode":  # one new query attends to every cached key, as in Megatron
        sq, mask, ref_mask = 1, None, None
    else:
        scale, kwargs = 0.37, {"softmax_scale": 0.37}
        mask = ref_mask = causal_attention_mask(s)
    q, k, v = (t.requires_grad_() for t in _qkv(sq, s, b, heads, groups, hn, seed=3))
    out = _sdpa_module(config, mask_type, **kwargs)(q, k, v, mask, attn_mask_type=mask_type)
    assert out.shape == (sq, b, heads * hn) and out.dtype == torch.float32
    weights = torch.randn(out.shape, generator=torch.Generator().manual_seed(5))
    (out * weights).sum().backward()
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    expected = _reference(q64, k64, v64, ref_mask, scale)
    (expected * weights.double()).sum().backward()
    assert (out.double() - expected).abs().max().item() <= MODULE_TOL
    for label, got, want in (("dq", q.grad, q64.grad), ("dk", k.grad, k64.grad), ("dv", v.grad, v64.grad)):
        assert _scaled_diff(got, want) <= MODULE_TOL, label
    if case == "padding":  # the fully masked query row gets no gradient, as in Megatron
        # Batch 1: queries 0-2 see only padding keys; query 5 sees three real ones.
        assert q.grad[:3, 1].abs().max() == 0 and q.grad[5, 1].abs().max() > 1e-3


def test_module_dropout_is_off_in_eval():
    config = _config(attention_dropout=0.5)
    q, k, v = _qkv(10, 10, 2, 8, 2, 16)
    out = _sdpa_module(config)(q, k, v, None)
    assert (out.double() - _reference(q, k, v, _causal(10), 0.25)).abs().max().item() <= MODULE_TOL


def test_module_refuses_what_it_does_not_support():
    module = _sdpa_module(_config())
    q, k, v = _qkv(6, 6, 1, 8, 2, 16)
    with pytest.raises(NotImplementedError, match="packed"):
        module(q, k, v, None, packed_seq_params=object())
    with pytest.raises(NotImplementedError, match="attention_bias"):
        module(q, k, v, None, attention_bias=torch.zeros(1, 8, 6, 6))
    with pytest.raises(NotImplementedError, match="some_future_argument"):
        module(q, k, v, None, some_future_argument=1)
    module(q, k, v, None, some_future_argument=None)  # an unused new keyword is fine
    with pytest.raises(TypeError, match="boolean"):
        module(q, k, v, torch.zeros(1, 1, 6, 6))
    with pytest.raises(ValueError, match="sq == sk"):
        module(*_qkv(4, 6, 1, 8, 2, 16), None)
    with pytest.raises(NotImplementedError, match="sliding-window"):
        _sdpa_module(_config(window_size=(4, 0)))


def test_context_parallel_module_refuses_explicit_masks_and_odd_local_length():
    from types import SimpleNamespace

    config = _config()
    config.context_parallel_size = 2  # set after validation: TransformerConfig checks CP against the world
    module = _sdpa_module(config, pg_collection=SimpleNamespace(tp=None, cp=object()))
    with pytest.raises(NotImplementedError, match="no explicit attention_mask"):
        module(*_qkv(4, 4, 1, 8, 2, 16), _causal(4))
    with pytest.raises(ValueError, match="odd local length 3"):
        module(*_qkv(3, 3, 1, 8, 2, 16), None)


def test_causal_mask_recognition():
    from megatron_dapo.model.sdpa_attention import is_causal_mask

    full = _causal(8)
    assert is_causal_mask(full, 8, 8)
    assert is_causal_mask(full[..., :5, :5], 5, 5)  # the actor's sliced views of one mask
    assert is_causal_mask(full.expand(3, 2, 8, 8), 8, 8)
    assert not is_causal_mask(full, 8, 7)
    assert not is_causal_mask(full.long(), 8, 8)
    assert not is_causal_mask(_padding_mask(2, 8), 8, 8)
    assert not is_causal_mask(~full, 8, 8)


def test_causal_memo_rechecks_a_mask_modified_in_place():
    from megatron_dapo.model.sdpa_attention import _CausalMaskMemo

    memo = _CausalMaskMemo(size=2)
    mask = _causal(6)
    assert memo.is_causal(mask, 6, 6)
    assert memo.is_causal(mask, 6, 6)
    mask[0, 0, 4, 1] = True  # now masks a past key: no longer the causal mask
    assert not memo.is_causal(mask, 6, 6)
    others = [_causal(4) for _ in range(3)]
    for other in others:  # the memo stays bounded
        assert memo.is_causal(other, 4, 4)
    assert len(memo.entries) <= 2


def test_modified_mask_changes_the_output():
    """A module given a no-longer-causal mask (same tensor) must not reuse the causal fast path."""
    module = _sdpa_module(_config())
    q, k, v = _qkv(6, 6, 1, 8, 2, 16)
    mask = _causal(6)
    first = module(q, k, v, mask)
    mask[..., 3:, 0] = True
    second = module(q, k, v, mask)
    assert (second.double() - _reference(q, k, v, mask, 0.25)).abs().max().item() <= MODULE_TOL
    assert not torch.allclose(first, second)


def _same_spec(a, b) -> bool:
    """Specs equal as values: megatron-core 0.19 builds the MLP spec as a functools.partial, a new one
    per call, and partials compare by identity."""
    import functools

    if isinstance(a, functools.partial) and isinstance(b, functools.partial):
        return a.func == b.func and a.args == b.args and a.keywords == b.keywords
    return a == b


def test_layer_spec_swaps_only_core_attention():
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    from megatron_dapo.model import builder
    from megatron_dapo.model.hf_config import read_hf_config
    from megatron_dapo.model.sdpa_attention import SDPADotProductAttention, with_sdpa_core_attention
    from tests.support.tiny_models import tiny_config

    cfg = read_hf_config(tiny_config("qwen3").to_dict())
    local = builder._layer_spec(cfg, False, "megatron")
    sdpa = builder._layer_spec(cfg, False)
    assert local.submodules.self_attention.submodules.core_attention is DotProductAttention
    assert sdpa.submodules.self_attention.submodules.core_attention is SDPADotProductAttention
    for name in ("linear_qkv", "linear_proj", "q_layernorm", "k_layernorm"):
        assert getattr(sdpa.submodules.self_attention.submodules, name) == getattr(
            local.submodules.self_attention.submodules, name
        ), name
    assert _same_spec(sdpa.submodules.mlp, local.submodules.mlp)
    assert sdpa.submodules.self_attention.params == local.submodules.self_attention.params
    swapped = with_sdpa_core_attention(local)
    assert local.submodules.self_attention.submodules.core_attention is DotProductAttention  # untouched
    assert swapped.submodules.self_attention.submodules.core_attention is SDPADotProductAttention
    with pytest.raises(ValueError, match="sdpa"):
        builder._layer_spec(cfg, False, "flash")


# ---------------------------------------------------------------------------------------------
# Worker: runs on every rank of a launch (not collected by pytest: no test_ prefix)
# ---------------------------------------------------------------------------------------------


def _module_vs_megatron(tp: int) -> dict:
    """Max |diff| of outputs and q/k/v gradients, SDPA module vs DotProductAttention, per mask form."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType

    from megatron_dapo.model.builder import causal_attention_mask

    heads, groups, hn, b, s = 8, 2, 16, 2, 12
    config = _config(heads, groups, hn, tp=tp)
    diffs = {}
    cases = {
        "causal_none": (AttnMaskType.causal, None, {}),
        "causal_explicit": (AttnMaskType.causal, causal_attention_mask(s), {}),
        "padding": (AttnMaskType.causal, _padding_mask(b, s), {}),
        "no_mask": (AttnMaskType.no_mask, None, {}),
        "scale": (AttnMaskType.causal, causal_attention_mask(s), {"softmax_scale": 0.37}),
    }
    for name, (mask_type, mask, kwargs) in cases.items():
        outputs = []
        for cls in (DotProductAttention, None):
            if cls is None:
                module = _sdpa_module(config, mask_type, **kwargs)
            else:
                module = cls(config, layer_number=1, attn_mask_type=mask_type, attention_type="self", **kwargs)
            module.train()  # dropout is 0: train mode must match too
            q, k, v = (t.requires_grad_() for t in _qkv(s, s, b, heads // tp, groups // tp, hn, seed=7))
            out = module(q, k, v, mask, attn_mask_type=mask_type)
            weights = torch.randn(out.shape, generator=torch.Generator().manual_seed(11))
            (out * weights).sum().backward()
            outputs.append([out.detach(), q.grad, k.grad, v.grad])
        diffs[name] = {
            label: _scaled_diff(ours, megatron) for label, megatron, ours in zip(("out", "dq", "dk", "dv"), *outputs)
        }
        diffs[name]["out_absmax"] = float(outputs[0][0].abs().max())
    return diffs


def _dropout_in_training(tp: int) -> dict:
    """With dropout 0.5 in train mode the output differs from eval and stays finite."""
    module = _sdpa_module(_config(tp=tp, attention_dropout=0.5))
    q, k, v = _qkv(10, 10, 2, 8 // tp, 2 // tp, 16)
    evaluated = module(q, k, v, None)
    module.train()
    trained = module(q, k, v, None)
    return {"finite": bool(torch.isfinite(trained).all()), "differs": not torch.allclose(evaluated, trained)}


def _model_comparison(arch: str, model_dir: str, layout, input_ids: torch.Tensor) -> dict:
    from megatron.core import tensor_parallel

    from megatron_dapo.model.builder import build_gpt_models, causal_attention_mask
    from megatron_dapo.model.debug import megatron_logits
    from megatron_dapo.model.hf_config import read_hf_config
    from megatron_dapo.model.load import load_hf_into_megatron
    from tests.support.tiny_models import load_hf_model

    cfg = read_hf_config(model_dir)
    with torch.no_grad():
        hf_logits = load_hf_model(Path(model_dir))(input_ids=input_ids).logits
    labels = torch.roll(input_ids, -1, dims=1)
    position_ids = torch.arange(input_ids.shape[1]).unsqueeze(0).expand_as(input_ids)
    mask = causal_attention_mask(input_ids.shape[1])
    logits, grads, spec = {}, {}, {}
    for attention in ("sdpa", "megatron"):
        (model,) = build_gpt_models(
            cfg, layout, torch.float32, transformer_engine="off", init_weights=False, attention=attention
        )
        load_hf_into_megatron([model], model_dir, cfg)
        spec[attention] = type(model.decoder.layers[0].self_attention.core_attention).__name__
        logits[attention] = megatron_logits([model], input_ids, vocab_size=cfg.vocab_size)
        model.train()
        local_logits = model(input_ids, position_ids, mask)  # [b, s, padded vocab / tp]
        if attention == "sdpa":
            logits["sdpa_local"] = local_logits.detach().clone()  # the loss below works in place
            with torch.no_grad():  # no mask at all: the causal mask type alone
                logits["sdpa_mask_none"] = model(input_ids, position_ids, None)
        loss = tensor_parallel.vocab_parallel_cross_entropy(local_logits.float(), labels).mean()
        loss.backward()
        grads[attention] = {name: p.grad.detach().clone() for name, p in model.named_parameters()}
    grad_diff = max(float((grads["sdpa"][n] - grads["megatron"][n]).abs().max()) for n in grads["sdpa"])
    return {
        "core_attention": spec,
        "sdpa_vs_megatron": float((logits["sdpa"] - logits["megatron"]).abs().max()),
        "sdpa_vs_hf": float((logits["sdpa"] - hf_logits).abs().max()),
        "megatron_vs_hf": float((logits["megatron"] - hf_logits).abs().max()),
        "mask_none_vs_explicit": float((logits["sdpa_mask_none"] - logits["sdpa_local"]).abs().max()),
        "hf_absmax": float(hf_logits.abs().max()),
        "grad_max_abs_diff": grad_diff,
        "grad_absmax": max(float(g.abs().max()) for g in grads["megatron"].values()),
        "grads_compared": len(grads["sdpa"]),
        "grad_names_equal": sorted(grads["sdpa"]) == sorted(grads["megatron"]),
    }


def worker(model_dirs: dict) -> dict:
    """One rank of a TP=world_size launch: module-level and whole-model comparisons."""
    import os

    from megatron_dapo.distributed import ParallelLayout, init_distributed, teardown

    tp = int(os.environ.get("WORLD_SIZE", "1"))
    ctx = init_distributed(ParallelLayout(tp=tp, pp=1), timeout_s=120, seed=5)
    try:
        input_ids = torch.randint(0, 300, (BATCH, SEQ_LEN), generator=torch.Generator().manual_seed(99))
        return {
            "rank": ctx.rank,
            "tp": tp,
            "module": _module_vs_megatron(tp),
            "dropout": _dropout_in_training(tp),
            "models": {arch: _model_comparison(arch, model_dirs[arch], ctx.layout, input_ids) for arch in MODEL_ARCHS},
        }
    finally:
        teardown()


# ---------------------------------------------------------------------------------------------
# Launches and assertions
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module", params=[1, 2], ids=["tp1", "tp2"])
def launch(request, tiny_model_dirs):
    nproc = request.param
    result = run_torchrun_function(
        Path(__file__),
        "worker",
        nproc=nproc,
        kwargs={"model_dirs": {arch: str(tiny_model_dirs[arch]) for arch in MODEL_ARCHS}},
        timeout=240,
        use_torchrun=nproc > 1,
    )
    result.check()
    assert all(r is not None for r in result.rank_results), result.tail()
    return result.rank_results


def test_module_matches_megatron_dot_product_attention(launch):
    for rank in launch:
        for case, diffs in rank["module"].items():
            assert diffs["out_absmax"] > 0.1, case
            for label in ("out", "dq", "dk", "dv"):
                assert diffs[label] <= MODULE_TOL, (rank["rank"], case, label, diffs[label])


def test_dropout_applies_only_in_training(launch):
    for rank in launch:
        assert rank["dropout"] == {"finite": True, "differs": True}


@pytest.mark.parametrize("arch", MODEL_ARCHS)
def test_whole_model_logits_and_gradients(launch, arch):
    for rank in launch:
        case = rank["models"][arch]
        assert case["core_attention"] == {"sdpa": "SDPADotProductAttention", "megatron": "DotProductAttention"}
        assert case["hf_absmax"] > 1.0  # logits of order 1: the tolerance means something
        assert case["sdpa_vs_megatron"] <= MODEL_TOL, case
        assert case["sdpa_vs_hf"] <= MODEL_TOL, case
        assert case["megatron_vs_hf"] <= MODEL_TOL, case
        assert case["mask_none_vs_explicit"] == 0.0, case
        assert case["grad_names_equal"] and case["grads_compared"] > 10
        assert case["grad_absmax"] > 1e-3, case
        assert case["grad_max_abs_diff"] <= MODEL_TOL, case
