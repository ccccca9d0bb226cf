"""The mixture-of-experts side of the actor's update: the routers' auxiliary losses and their metrics.

Megatron adds the load-balancing loss and the router z-loss to the gradient itself (an autograd
function on the router's output, `MoEAuxLossAutoScaler`), scaled for its own conventions. Ours
differ: the policy loss arrives already divided by the global token count, and the gradients are
summed, not averaged, over micro-batches and data-parallel ranks (`actor.optim`). Left alone, Megatron's
per-token mode would multiply every micro-batch's auxiliary loss by its token count and nothing
would divide it again: the load-balancing term would weigh thousands of times its coefficient.

So the routers use Megatron's plain mode (`calculate_per_token_loss` off on the router only: the
auxiliary loss attached as it is, scaled by 1 in the backward, see `schedules.forward_step`), and
during an update the coefficients are divided by (micro-batches x data-parallel replicas). The sum
that DDP then forms is the MEAN of the per-micro-batch auxiliary losses over micro-batches and
replicas, times the configured coefficient: Megatron's own definition in its default training
(`MoEAuxLossAutoScaler.set_loss_scale(1 / num_microbatches)` plus DDP's average). Context-parallel
and sequence-parallel ranks each hold part of a micro-batch's tokens and their parts add up, as in
Megatron.

Metrics of one step (`MoEStepStats`, every rank gets the same values):

    moe_aux_loss       the load-balancing loss (without its coefficient), mean over layers and micro-batches
    moe_z_loss         the router z-loss (without its coefficient), likewise; only when it is on
    moe_load_ratio_mean / moe_load_ratio_max
                       per layer, tokens of the busiest expert / mean tokens per expert (1 = balanced),
                       over every token the routers saw in the update (padding included), then the
                       mean and the worst layer
"""

from __future__ import annotations

import contextlib
from typing import Iterator, Sequence

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps
from megatron.core.transformer.moe import moe_utils
from megatron.core.transformer.moe.router import Router

__all__ = ["MoEStepStats", "auxiliary_loss_scale", "find_routers", "prepare_routers"]

# Megatron's names in its auxiliary-loss tracker (`moe_utils.save_to_aux_losses_tracker`) -> ours, and
# whether a rank's value is its part of the micro-batch's loss (the load-balancing loss is linear in
# the rank's own tokens' router probabilities) or a mean over its tokens (the z-loss), as Megatron
# reduces them (`reduce_aux_losses_tracker_across_ranks`: a reduce group for the first only).
_TRACKED = {"load_balancing_loss": ("moe_aux_loss", True), "z_loss": ("moe_z_loss", False)}


def find_routers(models: Sequence[torch.nn.Module]) -> list[Router]:
    """This rank's MoE routers (one per MoE layer of its pipeline stage), in layer order."""
    return [module for model in models for module in model.modules() if isinstance(module, Router)]


def prepare_routers(models: Sequence[torch.nn.Module]) -> list[Router]:
    """Switch the routers to Megatron's plain auxiliary-loss mode (module doc); returns them."""
    routers = find_routers(models)
    for router in routers:
        if not hasattr(router, "calculate_per_token_loss"):  # set in Router.__init__ (megatron-core 0.16 to 0.19)
            raise RuntimeError(f"{type(router).__name__} has no calculate_per_token_loss: this Megatron-Core scales "
                               "the auxiliary losses in a way actor/moe.py does not know; use megatron-core 0.16 to 0.19")  # fmt: skip
        router.calculate_per_token_loss = False
    return routers


@contextlib.contextmanager
def auxiliary_loss_scale(routers: Sequence[Router], micro_batches: int, data_parallel: int) -> Iterator[None]:
    """Within: the routers' auxiliary-loss coefficients divided by micro-batches x replicas (module doc).

    The coefficients live on the models' `TransformerConfig`, which the routers read at every forward.
    """
    configs = {id(router.config): router.config for router in routers}.values()
    divisor = float(micro_batches * data_parallel)
    saved = [(config, config.moe_aux_loss_coeff, config.moe_z_loss_coeff) for config in configs]
    try:
        for config, aux, z in saved:
            config.moe_aux_loss_coeff = _divided(aux, divisor)
            config.moe_z_loss_coeff = None if z is None else z / divisor
        yield
    finally:
        for config, aux, z in saved:
            config.moe_aux_loss_coeff, config.moe_z_loss_coeff = aux, z


def _divided(coeff, divisor: float):
    if isinstance(coeff, (list, tuple)):  # one coefficient per load-balancing type
        return type(coeff)(c / divisor for c in coeff)
    return coeff / divisor


class MoEStepStats:
    """Collects one update's auxiliary losses and expert loads; `finish` reduces them over all ranks.

        stats = MoEStepStats(routers, num_layers, num_experts, device)
        stats.start()
        ... every mini-batch's forward and backward ...
        metrics = stats.finish(micro_batches=...)      # a collective over the whole world
    """

    def __init__(self, routers: Sequence[Router], num_layers: int, num_experts: int, device: torch.device) -> None:
        self.routers = list(routers)
        self.loads = torch.zeros(num_layers, num_experts, dtype=torch.float64, device=device)
        self._hooks: list = []

    def start(self) -> None:
        moe_utils.clear_aux_losses_tracker()
        self.loads.zero_()
        self._hooks = [router.register_forward_hook(self._count_tokens) for router in self.routers]

    def _count_tokens(self, router: Router, inputs, outputs) -> None:
        if not torch.is_grad_enabled():  # the first pass of a recomputed layer: its recompute counts
            return
        routing_map = outputs[1]  # [tokens, experts] bool: token t goes to expert e
        self.loads[router.layer_number - 1] += routing_map.sum(dim=0).to(self.loads)

    def finish(self, micro_batches: int) -> dict[str, float]:
        """The step's metrics. `micro_batches`: how many this rank ran (the same on every replica)."""
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
        metrics: dict[str, float] = {}
        tracker = moe_utils.get_moe_layer_wise_logging_tracker()
        for name, (key, parts_add_up) in _TRACKED.items():
            if name not in tracker:
                continue
            per_layer = _sum_over_model_ranks(tracker[name]["values"].to(torch.float64))
            per_layer /= micro_batches * ps.get_data_parallel_world_size()
            if not parts_add_up:
                per_layer /= ps.get_tensor_and_context_parallel_world_size()
            metrics[key] = float(per_layer.mean())
        moe_utils.clear_aux_losses_tracker()
        loads = _sum_over_model_ranks(self.loads)
        ratio = loads.max(dim=1).values / loads.mean(dim=1).clamp_min(1e-12)
        metrics.update(moe_load_ratio_mean=float(ratio.mean()), moe_load_ratio_max=float(ratio.max()))
        return metrics


def _sum_over_model_ranks(per_layer: torch.Tensor) -> torch.Tensor:
    """Per-layer values summed over pipeline stages (each holds its own layers), the tokens' TP x CP
    parts and the data-parallel replicas."""
    total = per_layer.clone()
    for group in (
        ps.get_pipeline_model_parallel_group(),
        ps.get_tensor_and_context_parallel_group(),
        ps.get_data_parallel_group(),
    ):
        if dist.get_world_size(group) > 1:
            dist.all_reduce(total, group=group)
    return total
