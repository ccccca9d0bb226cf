"""Per-expert checkpoint names against transformers' fused in-memory experts (`model/hf_experts.py`),
checked on the real Qwen3-MoE module of transformers: its forward uses exactly the slices named."""

import torch

from megatron_dapo.model.hf_experts import expert_slot, is_fused_experts, slots_per_fused, unfused_experts
from tests.support.tiny_models import build_tiny_model


def test_names_map_to_the_slices_transformers_computes_with():
    model = build_tiny_model("qwen3_moe")
    experts = model.model.layers[1].mlp.experts
    gate_up, down = experts.gate_up_proj.detach(), experts.down_proj.detach()
    inter = gate_up.shape[1] // 2
    gate = expert_slot("model.layers.1.mlp.experts.3.gate_proj.weight")
    up = expert_slot("model.layers.1.mlp.experts.3.up_proj.weight")
    down_slot = expert_slot("model.layers.1.mlp.experts.3.down_proj.weight")
    assert gate.fused_name == up.fused_name == "model.layers.1.mlp.experts.gate_up_proj" and (gate.half, up.half) == (0, 1)
    assert down_slot.fused_name == "model.layers.1.mlp.experts.down_proj" and down_slot.half is None
    assert torch.equal(gate.view(gate_up), gate_up[3, :inter]) and torch.equal(up.view(gate_up), gate_up[3, inter:])
    assert gate.view(gate_up).data_ptr() == gate_up[3].data_ptr()  # a view: copying into it loads the parameter
    # The expert's output as transformers computes it, from the three named matrices.
    x = torch.randn(5, gate_up.shape[2])
    by_names = (experts.act_fn(x @ gate.view(gate_up).T) * (x @ up.view(gate_up).T)) @ down_slot.view(down).T
    fused_gate, fused_up = torch.nn.functional.linear(x, gate_up[3]).chunk(2, dim=-1)
    assert torch.allclose(by_names, torch.nn.functional.linear(experts.act_fn(fused_gate) * fused_up, down[3]))
    assert expert_slot("model.layers.1.mlp.gate.weight") is None and expert_slot("model.layers.1.mlp.experts.gate_up_proj") is None


def test_unfused_listing_covers_every_slot_once():
    model = build_tiny_model("qwen3_moe")
    for name, param in model.named_parameters():
        if not is_fused_experts(name, param):
            continue
        listed = list(unfused_experts(name, param.detach()))
        assert len(listed) == slots_per_fused(name, param)
        assert len({n for n, _ in listed}) == len(listed)
        for per_expert, tensor in listed:
            assert torch.equal(expert_slot(per_expert).view(param.detach()), tensor)
    assert not is_fused_experts("model.layers.0.mlp.gate.weight", torch.zeros(4, 64))
