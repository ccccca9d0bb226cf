"""The experts of an HF mixture-of-experts layer as transformers 5 holds them in memory.

A checkpoint (and our weight sync) names every expert's matrices apart:

    model.layers.L.mlp.experts.E.gate_proj.weight   [I, H]
    model.layers.L.mlp.experts.E.up_proj.weight     [I, H]
    model.layers.L.mlp.experts.E.down_proj.weight   [H, I]

while a loaded transformers model (Qwen3-MoE, Qwen2-MoE) holds one 3-D parameter per matrix kind:

    model.layers.L.mlp.experts.gate_up_proj         [E, 2I, H]   gate rows first, then up
    model.layers.L.mlp.experts.down_proj            [E, H, I]

`expert_slot` says where a per-expert tensor lives in the fused parameter, so an engine that runs the
transformers model (the embedded engine) loads pushed experts in place, one slice each, and reads
them back under the checkpoint names. Pure: names and views, no copies.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterator, Optional

if TYPE_CHECKING:
    import torch

__all__ = ["ExpertSlot", "expert_slot", "is_fused_experts", "slots_per_fused", "unfused_experts"]

_PER_EXPERT = re.compile(r"^(?P<experts>.+\.experts)\.(?P<expert>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)\.weight$")
_FUSED = {"gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1), "down_proj": ("down_proj", None)}


@dataclass(frozen=True)
class ExpertSlot:
    """Where one expert's matrix sits in a fused parameter."""

    fused_name: str
    """e.g. "model.layers.0.mlp.experts.gate_up_proj"."""
    expert: int
    half: Optional[int]
    """0 (gate) or 1 (up) of gate_up_proj's rows; None for down_proj (the whole [H, I] matrix)."""

    def view(self, fused: "torch.Tensor") -> "torch.Tensor":
        """The slice of `fused` that holds this matrix (a view: copying into it updates the parameter)."""
        if not 0 <= self.expert < fused.shape[0]:
            raise KeyError(f"{self.fused_name} holds {fused.shape[0]} experts, not expert {self.expert}")
        matrix = fused[self.expert]
        if self.half is None:
            return matrix
        rows = matrix.shape[0] // 2
        return matrix[self.half * rows : (self.half + 1) * rows]


def expert_slot(name: str) -> Optional[ExpertSlot]:
    """The fused slot of a per-expert checkpoint name; None for any other name."""
    match = _PER_EXPERT.match(name)
    if match is None:
        return None
    fused, half = _FUSED[match["proj"]]
    return ExpertSlot(f"{match['experts']}.{fused}", int(match["expert"]), half)


def is_fused_experts(name: str, tensor: "torch.Tensor") -> bool:
    """A transformers parameter holding every expert's matrices of one kind ([E, ...], 3-D)."""
    return name.endswith((".experts.gate_up_proj", ".experts.down_proj")) and tensor.dim() == 3


def slots_per_fused(fused_name: str, fused: "torch.Tensor") -> int:
    """How many per-expert tensors fill the fused parameter (2E for gate_up_proj, E for down_proj)."""
    return fused.shape[0] * (2 if fused_name.endswith("gate_up_proj") else 1)


def unfused_experts(fused_name: str, fused: "torch.Tensor") -> Iterator[tuple[str, "torch.Tensor"]]:
    """The checkpoint names and views of a fused expert parameter's matrices (expert by expert)."""
    experts, _, kind = fused_name.rpartition(".")
    projections = {"gate_up_proj": ("gate_proj", "up_proj"), "down_proj": ("down_proj",)}[kind]
    for expert in range(fused.shape[0]):
        for proj in projections:
            name = f"{experts}.{expert}.{proj}.weight"
            yield name, expert_slot(name).view(fused)
