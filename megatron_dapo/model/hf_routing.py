"""The experts an HF transformers mixture-of-experts model routes each token to, recorded from its forward.

transformers 5's Qwen3-MoE and Qwen2-MoE layers call a router module (``mlp.gate``,
``Qwen3MoeTopKRouter`` / ``Qwen2MoeTopKRouter``) that returns ``(logits, top-k weights, top-k
indices)`` for the flattened ``[batch * seq]`` tokens (batch-major). The embedded rollout engine
records the indices of every forward (prefill and each decode step) for rollout routing replay
(`actor.routing`):

    recorder = RoutingRecorder(model)           # forward hooks on every MoE layer's router
    with recorder:
        model(input_ids)
    experts = recorder.take(batch, seq)         # [batch, seq, layers, top-k] int32
"""

from __future__ import annotations

from typing import Optional

import torch

__all__ = ["RoutingRecorder", "hf_moe_routers"]


def hf_moe_routers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The router of each MoE layer, in layer order (empty for a dense model)."""
    decoder = getattr(model, "model", model)
    routers = []
    for layer in getattr(decoder, "layers", []):
        mlp = getattr(layer, "mlp", None)
        if mlp is not None and hasattr(mlp, "experts") and hasattr(mlp, "gate"):
            routers.append(mlp.gate)
    return routers


class RoutingRecorder:
    """Records the top-k expert indices of every MoE router while active (see the module doc)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.routers = hf_moe_routers(model)
        if not self.routers:
            raise ValueError(f"{type(model).__name__} has no mixture-of-experts router to record")
        self._hooks: list = []
        self._last: list[Optional[torch.Tensor]] = [None] * len(self.routers)

    @property
    def num_layers(self) -> int:
        return len(self.routers)

    def __enter__(self) -> "RoutingRecorder":
        for index, router in enumerate(self.routers):
            self._hooks.append(router.register_forward_hook(self._hook(index)))
        return self

    def __exit__(self, *exc_info) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks = []

    def _hook(self, index: int):
        def record(module, inputs, outputs) -> None:
            if not (isinstance(outputs, tuple) and len(outputs) == 3):
                raise RuntimeError(
                    f"{type(module).__name__} returned {type(outputs).__name__}, not (logits, weights, indices): "
                    "this transformers version's MoE router is not the one hf_routing knows (transformers 5)"
                )
            self._last[index] = outputs[2]

        return record

    def take(self, rows: int, seq: int) -> torch.Tensor:
        """``[rows, seq, layers, k]`` int32: the last forward's routing (its input was ``[rows, seq]``)."""
        if any(t is None for t in self._last):
            raise RuntimeError("no forward recorded since the last take()")
        stacked = torch.stack([t.reshape(rows, seq, -1) for t in self._last], dim=2).to(torch.int32)
        self._last = [None] * len(self.routers)
        return stacked
