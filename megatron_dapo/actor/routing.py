"""Rollout routing replay for mixture-of-experts actors (R2 / R3), and the routing-mismatch metric.

An MoE router picks each token's experts with a top-k over logits, a discontinuous choice: the
rollout engine and the actor, computing the same model with different kernels, route some tokens to
different experts, and their log-probs then differ by far more than rounding (the mismatch that
collapses MoE RL runs). Replay removes it: the actor's forward passes take the experts recorded
elsewhere instead of choosing them, with the gate weights still computed from its own router
logits at those experts (so the router keeps its gradient).

    actor.router_replay: off   the actor routes as it likes
                         r2    replay the routing the actor itself chose in its old-log-prob pass
                               (the update's forwards then route like the behaviour policy did)
                         r3    replay the rollout engine's routing in the old-log-prob pass and the
                               update (the engine returns it with every response)

One representation travels between the parts: ``routed_experts`` ``[n, T, L, k]`` integer (of
`routing_dtype(E)`: 1 byte an entry up to 128 experts, 2 up to 32768), the k
experts each of the L MoE layers sends token t of sequence i to, t counting the sequence's prompt
then response tokens (`PolicyBatch.tokens_of`), for the ``p + r - 1`` tokens the model reads. A
micro-batch turns it into the model input layout with `MicroBatch.token_source` (the canonical
position of each input position, -1 on padding), and `local_token_order` puts that in the order a
Megatron router sees its tokens on this rank: the sequence-major ``[s, b]`` flattening of the
hidden states, after the context-parallel split (this rank's 2 of 2*CP chunks) and, with sequence
parallelism, this tensor-parallel rank's ``s / TP`` slice. Padding positions take experts
``0..k-1``: a padded token's routing changes nothing a real token sees (causal attention).

Megatron-Core (0.16+) holds a `RouterReplay` per router when `moe_enable_routing_replay` is set; we
drive each router's instance directly (never its process-wide list, which also holds the reference
model's routers). Under full activation recompute the router runs again in the backward pass
(grad enabled, the first pass ran without grad inside the checkpoint): those calls take the
backward queue (`REPLAY_BACKWARD`), in micro-batch order as the schedule runs them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch
import torch.distributed as dist

from megatron_dapo.distributed.context_parallel import split_for_cp_rank

__all__ = [
    "ROUTING_UNKNOWN",
    "RoutingMismatch",
    "RoutingPass",
    "fill_routing",
    "local_token_order",
    "micro_batch_routing",
    "pooled_routing_mismatch",
    "reduce_recorded",
    "routing_dtype",
    "routing_mismatch",
    "scatter_recorded",
]

ROUTING_UNKNOWN = -1
"""The entry of a position no routing covers (padding, tokens past a sequence's end)."""


def routing_dtype(num_experts: int) -> torch.dtype:
    """The smallest signed integer type holding expert ids 0..E-1 and `ROUTING_UNKNOWN`.

    Routing is the bulk of an MoE rollout: L x k entries per token (48 x 8 for Qwen3-30B-A3B),
    ~190 times a token's id and log-prob at 4 bytes an entry. One byte holds up to 128 experts,
    two up to 32768; the routing keeps this type from the engine's output to the micro-batch,
    which widens only its own slice to the int64 the routers index with."""
    if num_experts < 1:
        raise ValueError(f"routing needs a mixture-of-experts model, got num_experts={num_experts}")
    if num_experts <= 128:
        return torch.int8
    if num_experts <= 32768:
        return torch.int16
    return torch.int32


def fill_routing(shape: Sequence[int], device=None) -> torch.Tensor:
    """Routing of positions no token occupies: experts 0..k-1 in every layer (valid, distinct)."""
    *lead, layers, topk = shape
    return torch.arange(topk, device=device).expand(*lead, layers, topk).clone()


def micro_batch_routing(routed_experts: torch.Tensor, token_source: torch.Tensor) -> torch.Tensor:
    """``[rows, S, L, k]`` long: the routing of each input position of a micro-batch.

    ``routed_experts`` is the batch's ``[n, T, L, k]`` (-1 where unknown); ``token_source`` ``[rows, S]``
    the canonical flat position (``i * T + t``) of each input position, -1 where there is no token.
    """
    n, width, layers, topk = routed_experts.shape
    flat = routed_experts.reshape(n * width, layers, topk)
    source = token_source.to(flat.device)
    if flat.shape[0] == 0:  # an empty share: its micro-batch is one row of padding
        return fill_routing((*source.shape, layers, topk), flat.device)
    # The micro-batch's positions first, then the widening: int64 of this slice only, never of the batch.
    taken = flat[source.clamp(min=0)].to(torch.long)
    # Padding, and positions the routing does not cover (negative entries), take the fill routing.
    missing = ((source < 0)[..., None] | (taken < 0).any(dim=-1))[..., None]
    return torch.where(missing, fill_routing(taken.shape, taken.device), taken)


def local_token_order(
    per_position: torch.Tensor, cp_size: int = 1, cp_rank: int = 0, sp_size: int = 1, sp_rank: int = 0
) -> torch.Tensor:
    """``[rows, S, ...]`` per input position -> ``[tokens, ...]`` in the order this rank's routers see them.

    Context parallelism keeps chunks ``cp_rank`` and ``2*CP-1-cp_rank`` of the sequence; Megatron's
    hidden states are ``[s, b, h]`` and the router flattens them sequence-major; sequence
    parallelism gives tensor-parallel rank r the r-th ``s / TP`` slice of that sequence dimension.
    """
    local = split_for_cp_rank(per_position, 1, cp_size, cp_rank)
    local = local.transpose(0, 1)  # [s, b, ...]
    if sp_size > 1:
        if local.shape[0] % sp_size:
            raise ValueError(f"sequence length {local.shape[0]} is not a multiple of the sequence-parallel size {sp_size}")
        step = local.shape[0] // sp_size
        local = local[sp_rank * step : (sp_rank + 1) * step]
    return local.reshape(-1, *local.shape[2:])


def scatter_recorded(
    target: torch.Tensor, recorded: torch.Tensor, positions: torch.Tensor, layer: int
) -> None:
    """Write a router's recorded ``[tokens, k]`` into ``target`` ``[n, T, L, k]`` at layer ``layer``.

    ``positions`` ``[tokens]`` is each local token's canonical flat position (`local_token_order` of
    the micro-batch's ``token_source``); padding (-1) is skipped.
    """
    n, width, layers, topk = target.shape
    real = positions >= 0
    flat = target.view(n * width, layers, topk)
    flat[positions[real].to(flat.device), layer] = recorded[real.to(recorded.device)].to(flat)


@dataclass(frozen=True)
class RoutingMismatch:
    """Tokens the engine and the actor routed differently (model-read tokens of real sequences)."""

    tokens: float
    """Tokens compared."""
    differing_tokens: float
    """Tokens whose experts differ in at least one layer."""
    token_layers: float
    """(token, layer) pairs compared."""
    differing_token_layers: float

    def metrics(self) -> dict[str, float]:
        return {
            "routing_mismatch_token_frac": self.differing_tokens / self.tokens if self.tokens else 0.0,
            "routing_mismatch_layer_frac": self.differing_token_layers / self.token_layers if self.token_layers else 0.0,
        }


def routing_mismatch(engine: torch.Tensor, actor: torch.Tensor, read: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per token: (differs in any compared layer, number of differing layers), over the layers the
    actor recorded (entries >= 0). ``engine`` and ``actor`` ``[n, T, L, k]``; ``read`` ``[n, T]`` bool
    marks the tokens the model reads. Expert order within a token's k does not matter."""
    known = (actor >= 0).all(dim=-1)  # [n, T, L]: layers on this pipeline stage
    same = (engine.sort(dim=-1).values == actor.sort(dim=-1).values).all(dim=-1)
    differs = (~same) & known & read[..., None]
    return differs.any(dim=-1), differs.sum(dim=-1)


class RoutingPass:
    """Replay or record the routers of this rank's model chunks over one pass of micro-batches.

        with RoutingPass(chunks, replay=True, recompute=...) as routing:
            ... in forward_step, before the chunk's forward:  routing.before_forward(chunk, local)
            ... after it (recording):                          routing.recorded(chunk)

    ``local`` is ``[tokens, L, k]`` in the chunk routers' token order (`local_token_order`); each
    router takes its layer's column (``layer_number - 1``).
    """

    def __init__(self, chunk_routers: dict[int, list], *, replay: bool, recompute: bool) -> None:
        from megatron.core.transformer.moe.router_replay import RouterReplayAction

        self._actions = RouterReplayAction
        self.chunk_routers = chunk_routers
        self.replay = replay
        self.recompute = recompute
        self._hooks: list = []
        for routers in chunk_routers.values():
            for router in routers:
                if getattr(router, "router_replay", None) is None:
                    raise RuntimeError(
                        "the MoE routers have no RouterReplay: build the model with moe_enable_routing_replay "
                        "(model.builder does for MoE models; megatron-core >= 0.16)"
                    )

    def __enter__(self) -> "RoutingPass":
        for routers in self.chunk_routers.values():
            for router in routers:
                router.router_replay.clear_indices()
                if self.replay:
                    self._hooks.append(router.register_forward_pre_hook(self._choose_action))
                else:
                    router.router_replay.set_router_replay_action(self._actions.RECORD)
        return self

    def __exit__(self, *exc_info) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
        for routers in self.chunk_routers.values():
            for router in routers:
                router.router_replay.clear_indices()
                router.router_replay.clear_router_replay_action()

    def _choose_action(self, router, inputs) -> None:
        # With full recompute, the first pass runs inside the checkpoint without grad and the
        # backward's re-run with it: that one takes the queued routing of the oldest micro-batch.
        backward = self.recompute and torch.is_grad_enabled()
        action = self._actions.REPLAY_BACKWARD if backward else self._actions.REPLAY_FORWARD
        router.router_replay.set_router_replay_action(action)

    def before_forward(self, chunk: torch.nn.Module, local: Optional[torch.Tensor]) -> None:
        """Give the chunk's routers this micro-batch's routing (``[tokens, L, k]``) before its forward."""
        if not self.replay:
            return
        for router in self.chunk_routers[id(chunk)]:
            router.router_replay.set_target_indices(local[:, router.layer_number - 1].contiguous())

    def recorded(self, chunk: torch.nn.Module) -> list[tuple[int, torch.Tensor]]:
        """(layer index, ``[tokens, k]``) the chunk's routers chose in the forward that just ran."""
        return [(router.layer_number - 1, router.router_replay.get_recorded_indices()) for router in self.chunk_routers[id(chunk)]]


def pooled_routing_mismatch(engine: torch.Tensor, actor: torch.Tensor, read: torch.Tensor, stage_group, data_group) -> RoutingMismatch:
    """`routing_mismatch` over the whole batch (a collective): a token differs when it does in a
    layer of any pipeline stage; counts summed over the data-parallel replicas."""
    read = read.to(actor.device)
    differs, differing_layers = routing_mismatch(engine.to(actor.device), actor, read)
    differs = differs.to(torch.int64)
    if stage_group is not None and dist.get_world_size(stage_group) > 1:
        dist.all_reduce(differs, op=dist.ReduceOp.MAX, group=stage_group)  # any layer of any stage
        dist.all_reduce(differing_layers, group=stage_group)  # each stage counts its own layers
    tokens = float(read.sum())
    counts = torch.tensor(
        [tokens, float(differs[read].sum()), tokens * actor.shape[2], float(differing_layers[read].sum())],
        dtype=torch.float64, device=actor.device,
    )  # fmt: skip
    if data_group is not None and dist.get_world_size(data_group) > 1:
        dist.all_reduce(counts, group=data_group)
    return RoutingMismatch(*(float(c) for c in counts))


def reduce_recorded(routing: torch.Tensor, group) -> torch.Tensor:
    """Combine what the ranks of ``group`` recorded (each holds its tokens, -1 elsewhere)."""
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(routing, op=dist.ReduceOp.MAX, group=group)
    return routing
