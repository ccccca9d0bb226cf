"""Group-relative advantages (GRPO / DAPO, and Dr. GRPO without std normalisation).

Every response of a prompt forms a group; its advantage is how much better it scored than its
siblings. The functions here are vectorised over samples and never loop in Python over a tensor.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Union

import torch

GroupIds = Union[torch.Tensor, Sequence[Hashable]]

__all__ = ["GroupIds", "index_groups", "grpo_advantages", "token_advantages"]


def index_groups(group_ids: GroupIds, device: torch.device | None = None) -> tuple[torch.Tensor, list]:
    """Map each sample to a dense group index, groups numbered in order of first appearance.

    Args:
        group_ids: one id per sample: a 1-D integer tensor, or a sequence of hashables (e.g. the
            uid strings of the prompts). Samples of a group need not be contiguous.
        device: device of the returned index (default: that of a tensor input, else CPU).

    Returns:
        ``(inverse, unique_ids)``: ``inverse[i]`` is the group index (0..G-1) of sample ``i`` as a
        long tensor, and ``unique_ids[g]`` the id of group ``g`` (Python values, in the order in
        which each group first appears).
    """
    if isinstance(group_ids, torch.Tensor):
        if group_ids.dim() != 1:
            raise ValueError(f"group_ids must be 1-D, got shape {tuple(group_ids.shape)}")
        if group_ids.is_floating_point() or group_ids.is_complex():
            raise TypeError(f"tensor group_ids must be integer or bool, got {group_ids.dtype}")
        device = group_ids.device if device is None else device
        if group_ids.numel() == 0:
            return torch.zeros(0, dtype=torch.long, device=device), []
        unique, sorted_inverse = torch.unique(group_ids, return_inverse=True)
        # torch.unique sorts; renumber the groups by the position of their first sample so that
        # both input kinds number groups the same way (arrival order, which sampling relies on).
        positions = torch.arange(group_ids.numel(), device=group_ids.device)
        first_pos = torch.full((unique.numel(),), group_ids.numel(), dtype=torch.long, device=group_ids.device)
        first_pos = first_pos.scatter_reduce(0, sorted_inverse, positions, reduce="amin")
        order = torch.argsort(first_pos)
        rank = torch.empty_like(order)
        rank[order] = torch.arange(order.numel(), device=order.device)
        return rank[sorted_inverse].to(device), unique[order].tolist()

    if isinstance(group_ids, (str, bytes)):
        raise TypeError("group_ids must be a tensor or a sequence of ids, not a single string")
    # Arbitrary hashables cannot be vectorised; one dict lookup per sample is the minimum.
    index_of: dict[Hashable, int] = {}
    inverse = [index_of.setdefault(gid, len(index_of)) for gid in group_ids]
    return torch.tensor(inverse, dtype=torch.long, device=device), list(index_of)


def grpo_advantages(
    scores: torch.Tensor,
    group_ids: GroupIds,
    norm_by_std: bool = True,
    eps: float = 1e-6,
) -> torch.Tensor:
    """Per-sequence group-relative advantage.

    ``A_i = (r_i - mean_g) / (std_g + eps)`` with ``mean_g``/``std_g`` over the group ``g`` of
    sample ``i``; the std is Bessel-corrected (divides by ``n_g - 1``, like ``torch.std``).
    With ``norm_by_std=False`` (Dr. GRPO) ``A_i = r_i - mean_g``.

    Degenerate groups never produce NaN:
      * a group of one sample has mean = its score and std defined as 1, so its advantage is 0;
      * a group whose scores are all equal (zero std) gets advantages of exactly 0 (detected
        with group min == group max, so float rounding of the mean cannot leak through).

    Statistics are computed in float64 and the result is returned in ``scores.dtype``.

    Args:
        scores: 1-D float tensor, one (shaped) reward per response.
        group_ids: group of each response (see `index_groups`); groups need not be contiguous.
        norm_by_std: divide by the group std (GRPO/DAPO) or not (Dr. GRPO).
        eps: added to the std before dividing.

    Raises:
        ValueError: on shape mismatch or non-finite scores.
    """
    if scores.dim() != 1 or not scores.is_floating_point():
        raise ValueError(f"scores must be a 1-D float tensor, got shape {tuple(scores.shape)} dtype {scores.dtype}")
    inverse, unique_ids = index_groups(group_ids, device=scores.device)
    if inverse.numel() != scores.numel():
        raise ValueError(f"{scores.numel()} scores but {inverse.numel()} group ids")
    if not bool(torch.isfinite(scores).all()):
        raise ValueError("scores contain NaN or inf; the reward function returned a non-finite value")
    num_groups = len(unique_ids)
    x = scores.to(torch.float64)

    counts = torch.zeros(num_groups, dtype=torch.float64, device=x.device).index_add_(0, inverse, torch.ones_like(x))
    mean = torch.zeros_like(counts).index_add_(0, inverse, x) / counts.clamp_min(1)
    group_min = torch.full_like(counts, float("inf")).scatter_reduce(0, inverse, x, reduce="amin")
    group_max = torch.full_like(counts, float("-inf")).scatter_reduce(0, inverse, x, reduce="amax")
    constant = group_min == group_max  # also true for groups of one

    centred = torch.where(constant[inverse], torch.zeros_like(x), x - mean[inverse])
    if not norm_by_std:
        return centred.to(scores.dtype)

    sq_dev = torch.zeros_like(counts).index_add_(0, inverse, centred * centred)
    var = sq_dev / (counts - 1).clamp_min(1)
    std = torch.where(counts > 1, var.sqrt(), torch.ones_like(var))
    return (centred / (std[inverse] + eps)).to(scores.dtype)


def token_advantages(advantages: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """Broadcast per-sequence advantages ``[B]`` to tokens ``[B, T]``; 0 where the mask is 0.

    ``response_mask`` is ``[B, T]`` (bool or 0/1); nonzero marks a valid response token.
    """
    if advantages.dim() != 1 or response_mask.dim() != 2 or advantages.shape[0] != response_mask.shape[0]:
        raise ValueError(
            f"expected advantages [B] and response_mask [B, T], got {tuple(advantages.shape)} and "
            f"{tuple(response_mask.shape)}"
        )
    expanded = advantages.unsqueeze(-1).expand(response_mask.shape)
    return torch.where(response_mask.bool(), expanded, torch.zeros_like(expanded))
