"""Per-token log-probabilities and entropy from vocab-parallel logits, without gathering the vocabulary.

Megatron's output layer with ``parallel_output=True`` leaves every tensor-parallel (TP) rank with a
contiguous slice of the vocabulary: logits ``[s, b, V/tp]``. The policy loss needs, per token,
``log p(target)`` and the entropy ``H``, both normalised over the *full* vocabulary. Gathering
``[tokens, V]`` on one rank is exactly what a 20k-token response with a 152k vocabulary cannot afford,
so, like Megatron's vocab-parallel cross-entropy, we only exchange per-token statistics:

* ``m``   = max over the vocabulary (all_reduce MAX),
* ``s``   = sum_j exp(z_j - m),  ``a`` = sum_j exp(z_j - m) (z_j - m),  ``t`` = z_target - m
  (one all_reduce SUM of the three, stacked; only the rank owning the target contributes ``t``).

Then ``log p(target) = t - log s`` and ``H = -sum_j p_j log p_j = log s - a / s``.

Memory: everything that touches ``[tokens, V/tp]`` in float32 is computed ``chunk_size`` tokens at a time,
so at most a few fp32 ``[chunk_size, V/tp]`` temporaries exist at once, whatever the input length. The
autograd function saves only the input (by reference, no copy) and per-token float32 statistics
(``m``, ``log s``, ``H``); backward recomputes the softmax chunk by chunk, needing no communication:
the gradient w.r.t. this rank's shard is local once the global log-normaliser is known, and Megatron's
ColumnParallelLinear backward sums the input gradient across TP ranks itself.

Gradients (``p = softmax(z)`` over the full vocabulary, ``j`` restricted to this rank's columns):

* ``d log p(target) / d z_j = 1[j == target] - p_j``
* ``d H / d z_j = -p_j (log p_j + H)``: from ``dp_i/dz_j = p_i (1[i==j] - p_j)``,
  ``dH/dz_j = -sum_i (log p_i + 1) p_i (1[i==j] - p_j) = -p_j (log p_j + 1) + p_j (1 - H)``.

Layout: the vocabulary is the last dimension and every leading dimension is a token dimension, so both
Megatron's ``[s, b, V/tp]`` and ``[b, s, V/tp]`` work unchanged as long as ``target_ids`` has the same
leading shape (``[s, b]`` or ``[b, s]``); outputs take that shape too. No transpose is needed.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = ["token_log_probs_and_entropy"]


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """bf16/fp16/fp32 logits are reduced in fp32; fp64 stays fp64 (used by the gradient checks)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _all_reduce(tensor: torch.Tensor, op: dist.ReduceOp, group: dist.ProcessGroup | None) -> None:
    if group is not None:
        dist.all_reduce(tensor, op=op, group=group)


def _local_target_index(
    targets: torch.Tensor, vocab_start: int, num_valid_columns: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Column of each target inside this shard (0 where not owned) and whether this shard owns it."""
    local = targets - vocab_start
    owned = (local >= 0) & (local < num_valid_columns)
    return torch.where(owned, local, torch.zeros_like(local)), owned


class _VocabParallelLogProbsEntropy(torch.autograd.Function):
    """Chunked, vocab-parallel ``log p(target)`` and entropy; backward recomputes per chunk."""

    @staticmethod
    def forward(
        ctx,
        logits: torch.Tensor,  # [N, V_local]; columns >= num_valid_columns are vocab padding
        targets: torch.Tensor,  # [N] full-vocabulary ids
        group: dist.ProcessGroup | None,
        vocab_start: int,
        num_valid_columns: int,
        chunk_size: int,
        compute_entropy: bool,
    ):
        ctx.set_materialize_grads(False)
        num_tokens = logits.shape[0]
        cdtype = _compute_dtype(logits.dtype)
        valid = logits[:, :num_valid_columns]

        # Pass 1: the per-token max. amax in the input dtype is exact (a max selects an element)
        # and allocates only [N], so the whole input can be reduced at once.
        if num_valid_columns > 0:
            row_max = valid.amax(dim=-1).to(cdtype)
        else:  # this shard holds only vocabulary padding
            row_max = torch.full((num_tokens,), float("-inf"), dtype=cdtype, device=logits.device)
        _all_reduce(row_max, dist.ReduceOp.MAX, group)

        # Pass 2: local partial sums, chunk by chunk in the compute dtype.
        # stats[0] = sum exp(z - m), stats[1] = sum exp(z - m) (z - m), stats[2] = z_target - m.
        stats = torch.zeros((3, num_tokens), dtype=cdtype, device=logits.device)
        local_index, owned = _local_target_index(targets, vocab_start, num_valid_columns)
        if num_valid_columns > 0:
            for start in range(0, num_tokens, chunk_size):
                end = min(start + chunk_size, num_tokens)
                # copy=True: for fp32/fp64 input .to() would alias the input and sub_ would overwrite it.
                shifted = valid[start:end].to(cdtype, copy=True)
                shifted.sub_(row_max[start:end, None])
                exp = torch.exp(shifted)
                stats[0, start:end] = exp.sum(dim=-1)
                if compute_entropy:
                    # A batched dot product: no third [chunk, V] temporary for exp * shifted.
                    stats[1, start:end] = torch.linalg.vecdot(exp, shifted)
                del exp
                target_shifted = shifted.gather(-1, local_index[start:end, None]).squeeze(-1)
                stats[2, start:end] = torch.where(owned[start:end], target_shifted, 0.0)
                del shifted
        _all_reduce(stats, dist.ReduceOp.SUM, group)

        log_sum_exp = torch.log(stats[0])  # log s, relative to row_max
        log_probs = stats[2] - log_sum_exp
        entropy = log_sum_exp - stats[1] / stats[0] if compute_entropy else None

        ctx.save_for_backward(logits, targets, row_max, log_sum_exp, entropy if compute_entropy else None)
        ctx.vocab_start = vocab_start
        ctx.num_valid_columns = num_valid_columns
        ctx.chunk_size = chunk_size
        if compute_entropy:
            return log_probs, entropy
        return log_probs, None

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_log_probs: torch.Tensor | None, grad_entropy: torch.Tensor | None):
        logits, targets, row_max, log_sum_exp, entropy = ctx.saved_tensors
        num_tokens = logits.shape[0]
        num_valid = ctx.num_valid_columns
        cdtype = row_max.dtype
        if grad_entropy is not None and entropy is None:
            raise RuntimeError("entropy gradient requested but entropy was not computed")
        # Padding columns were excluded from the softmax: their gradient is exactly zero.
        grad_logits = torch.zeros_like(logits) if num_valid < logits.shape[1] else torch.empty_like(logits)
        if grad_log_probs is None and grad_entropy is None or num_valid == 0:
            return grad_logits.zero_(), None, None, None, None, None, None

        local_index, owned = _local_target_index(targets, ctx.vocab_start, num_valid)
        log_normaliser = row_max + log_sum_exp  # log sum_j exp(z_j), global
        for start in range(0, num_tokens, ctx.chunk_size):
            end = min(start + ctx.chunk_size, num_tokens)
            log_p = logits[start:end, :num_valid].to(cdtype, copy=True)  # never alias the input
            log_p.sub_(log_normaliser[start:end, None])
            p = torch.exp(log_p)
            # grad = p * (-g_logp - g_H (log p + H)) + g_logp * onehot, built in place in log_p.
            if grad_entropy is not None:
                g_h = grad_entropy[start:end, None].to(cdtype)
                grad = log_p.add_(entropy[start:end, None]).mul_(-g_h)
                if grad_log_probs is not None:
                    grad.sub_(grad_log_probs[start:end, None].to(cdtype))
            else:
                grad = log_p.copy_(grad_log_probs[start:end, None].to(cdtype).neg().expand_as(log_p))
            grad.mul_(p)
            del p
            if grad_log_probs is not None:
                g_lp = grad_log_probs[start:end].to(cdtype)
                grad.scatter_add_(
                    -1,
                    local_index[start:end, None],
                    torch.where(owned[start:end], g_lp, 0.0)[:, None],
                )
            grad_logits[start:end, :num_valid] = grad
            del grad, log_p
        return grad_logits, None, None, None, None, None, None


def token_log_probs_and_entropy(
    logits_shard: torch.Tensor,
    target_ids: torch.Tensor,
    tp_group: dist.ProcessGroup | None = None,
    vocab_start: int | None = None,
    chunk_size: int = 4096,
    compute_entropy: bool = True,
    vocab_size: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per-token ``log p(target)`` and entropy from this TP rank's vocabulary shard of the logits.

    Args:
        logits_shard: ``[..., V/tp]`` logits of this rank's contiguous vocabulary slice, any float dtype
            (bf16 is fine and is never copied to fp32 as a whole). Leading dimensions are tokens:
            Megatron's ``[s, b, V/tp]`` and ``[b, s, V/tp]`` both work with no transpose. Pass a
            contiguous tensor: a non-contiguous view (e.g. a transpose) is flattened with ``reshape``,
            which then copies the input once in its own dtype.
        target_ids: integer ids in the full vocabulary ``[0, vocab_size)``, shape ``logits_shard.shape[:-1]``.
            Padding positions must still hold a valid id (e.g. 0) and be masked out of the loss by the
            caller; an out-of-range id is owned by no rank and gives a meaningless value.
        tp_group: the tensor-parallel group; ``None`` or a group of size 1 is the single-process path.
        vocab_start: first full-vocabulary id of this shard; default ``rank_in_group * V/tp``
            (Megatron's equal contiguous split).
        chunk_size: tokens per fp32 chunk; peak extra memory is a few ``chunk_size x V/tp`` fp32 buffers.
        compute_entropy: when False the entropy is neither computed nor returned (``None``).
        vocab_size: the unpadded vocabulary size. Megatron pads the vocabulary (to a multiple of
            ``make_vocab_size_divisible_by * tp``); columns at ids ``>= vocab_size`` are excluded from
            the softmax so log-probs match the rollout engine's. ``None``: every column is real.

    Returns:
        ``(log_probs, entropy)``, each of shape ``target_ids.shape``, float32 (float64 for float64
        logits), identical on every rank of ``tp_group``. Both are differentiable w.r.t.
        ``logits_shard``; the gradient is this shard's slice of the full-vocabulary gradient.
    """
    if logits_shard.shape[:-1] != target_ids.shape:
        raise ValueError(
            f"target_ids shape {tuple(target_ids.shape)} must equal the token dimensions of logits "
            f"{tuple(logits_shard.shape[:-1])} (logits are [..., tokens, vocab/tp])"
        )
    if not logits_shard.is_floating_point():
        raise TypeError(f"logits must be floating point, got {logits_shard.dtype}")
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")

    if tp_group is not None and dist.get_world_size(tp_group) == 1:
        tp_group = None
    shard_width = logits_shard.shape[-1]
    if vocab_start is None:
        vocab_start = 0 if tp_group is None else dist.get_rank(tp_group) * shard_width
    num_valid_columns = shard_width
    if vocab_size is not None:
        num_valid_columns = max(0, min(shard_width, vocab_size - vocab_start))

    token_shape = target_ids.shape
    flat_logits = logits_shard.reshape(-1, shard_width)
    flat_targets = target_ids.reshape(-1).long()
    log_probs, entropy = _VocabParallelLogProbsEntropy.apply(
        flat_logits, flat_targets, tp_group, vocab_start, num_valid_columns, chunk_size, compute_entropy
    )
    log_probs = log_probs.view(token_shape)
    if entropy is not None:
        entropy = entropy.view(token_shape)
    return log_probs, entropy
