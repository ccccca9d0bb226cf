"""DAPO's soft overlong punishment (paper eq. 13) and the optional overlong loss filter.

Length shaping is a function of token counts only. Whether a response was truncated comes from
the rollout engine (finish reason "length" or a token count at the limit), never from its text.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["overlong_loss_mask", "overlong_penalty", "validate_overlong_settings"]


def validate_overlong_settings(max_response_length: int, buffer_length: int, penalty_factor: float) -> None:
    """Raise ValueError, naming the config key, when the overlong settings cannot describe eq. 13."""
    if max_response_length < 1:
        raise ValueError(f"'rollout.max_response_length' must be >= 1, got {max_response_length}")
    if buffer_length < 0:
        raise ValueError(f"'algorithm.overlong_buffer.len' must be >= 0 (0 disables the penalty), got {buffer_length}")
    if buffer_length > max_response_length:
        raise ValueError(
            f"'algorithm.overlong_buffer.len'={buffer_length} is longer than "
            f"'rollout.max_response_length'={max_response_length}: shorten the buffer or raise the max length"
        )
    if not penalty_factor >= 0:  # also rejects NaN
        raise ValueError(f"'algorithm.overlong_buffer.penalty_factor' must be >= 0, got {penalty_factor}")


def overlong_penalty(
    response_lengths: torch.Tensor | Sequence[int],
    max_response_length: int,
    buffer_length: int,
    penalty_factor: float,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Per-response length penalty of DAPO eq. 13, scaled by `penalty_factor`.

    With ``L_max = max_response_length`` and ``L_cache = buffer_length``:

    * ``0`` for ``|y| <= L_max - L_cache``;
    * ``((L_max - L_cache) - |y|) / L_cache * penalty_factor`` for ``L_max - L_cache < |y| <= L_max``
      (linear from 0 down to ``-penalty_factor`` at ``L_max``);
    * ``-penalty_factor`` for ``|y| > L_max``.

    ``buffer_length == 0`` disables the penalty (all zeros). Accepts a 1-D integer tensor or a
    list of ints; returns a tensor of `dtype` (float32 unless asked otherwise; the reward manager
    asks for float64 so that score + penalty is rounded once, as in verl) on the input's device.
    """
    validate_overlong_settings(max_response_length, buffer_length, penalty_factor)
    if isinstance(response_lengths, torch.Tensor):
        lengths = response_lengths
    else:
        lengths = torch.as_tensor(list(response_lengths), dtype=torch.int64)
    if lengths.dim() != 1:
        raise ValueError(f"response_lengths must be 1-D, got shape {tuple(lengths.shape)}")
    if lengths.dtype.is_floating_point or lengths.dtype == torch.bool:
        raise ValueError(f"response_lengths must hold integer token counts, got dtype {lengths.dtype}")
    if lengths.numel() and int(lengths.min()) < 0:
        raise ValueError("response_lengths must be >= 0")
    if buffer_length == 0 or penalty_factor == 0:
        return torch.zeros(lengths.shape, dtype=dtype, device=lengths.device)

    # float64 so that the ratio is exact for any realistic length before the final cast.
    expected = float(max_response_length - buffer_length)
    inside = (expected - lengths.to(torch.float64)) / buffer_length * penalty_factor
    penalty = torch.clamp(inside, max=0.0)
    penalty = torch.where(lengths > max_response_length, torch.full_like(penalty, -float(penalty_factor)), penalty)
    return penalty.to(dtype)


def overlong_loss_mask(truncated: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """The response mask with every truncated response's row zeroed (DAPO's overlong filtering).

    `truncated` is a ``[B]`` bool tensor taken from the engine (finish reason or token count);
    `response_mask` is ``[B, T]``. Returns a new tensor of `response_mask`'s dtype; the input is
    not modified.
    """
    if truncated.dtype != torch.bool:
        raise ValueError(f"truncated must be a bool tensor, got dtype {truncated.dtype}")
    if response_mask.dim() != 2 or truncated.shape != response_mask.shape[:1]:
        raise ValueError(
            f"truncated {tuple(truncated.shape)} must be [B] for a response_mask of shape [B, T], "
            f"got {tuple(response_mask.shape)}"
        )
    keep = (~truncated).to(device=response_mask.device).unsqueeze(1)
    return response_mask * keep.to(response_mask.dtype) if response_mask.dtype != torch.bool else response_mask & keep
