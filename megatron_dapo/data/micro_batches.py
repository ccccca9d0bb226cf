"""Token-budget micro-batches (dynamic batch size) and the packed / padded inputs built from them.

Splitting. DAPO responses range from a few hundred to 20k tokens, so a fixed number of sequences per
micro-batch either wastes memory on short ones or runs out on long ones. `split_into_micro_batches`
instead fills each micro-batch up to `trainer.max_tokens_per_micro_batch` tokens, with one of two cost
models, chosen by the caller from the attention path it will use:

* packed (``packed=True``): padding removed, sequences concatenated (THD format); a micro-batch
  costs the *sum* of its lengths;
* padded (``packed=False``): right-padded ``[count, max_len]``; a micro-batch costs ``max_len * count``.

When packing is possible (Megatron-Core 0.16, checked in its source):

* ``PackedSeqParams(qkv_format="thd", cu_seqlens_q/kv, ...)`` is honoured only by
  ``TEDotProductAttention`` (the Transformer Engine layer spec; TE's flash/fused backends). The local
  ``DotProductAttention`` (``megatron/core/transformer/dot_product_attention.py``) asserts
  ``packed_seq_params is None`` ("Packed sequence is not supported by DotProductAttention"), so the
  local spec (the CPU path, no TE) must use the padded variant.
* The offsets given to attention are the padded slot boundaries, for ``cu_seqlens_q/kv`` and
  ``cu_seqlens_q/kv_padded`` alike and as one tensor object, as Megatron-LM's data schedule
  (``megatron/core/datasets/data_schedule.py``, "Transformer Engine has a bug of cu_seqlens") and
  verl's ``preprocess_packed_seqs`` do. It is exact here: a sequence's padding follows it inside its
  slot, so under the causal mask no real token attends to padding, and the padding's outputs are
  never read (loss mask 0). Passing the same object also keeps TE's ``pad_between_seqs``
  auto-detection False (it compares ``cu_seqlens_q_padded is cu_seqlens_q``), so the FlashAttention
  backends stay eligible; separate real offsets would make TE treat the batch as padded between
  sequences. TE < 1.10 drops the ``_padded`` fields, which is harmless with equal offsets.
* Context parallelism with THD splits every sequence into ``2 * cp`` pieces
  (``tex.thd_get_partitioned_indices``, TE >= 1.10): pad each sequence to a multiple of ``2 * cp``
  (times ``tp`` with sequence parallelism, so the packed total also splits evenly across TP ranks).
* Rotary embeddings in THD use ``cu_seqlens`` (the padded ones when given), so positions restart per
  sequence inside attention; ``position_ids`` below restart per sequence as well.

Right padding with causal attention needs no extra attention mask: a real token never attends to
the padding after it, and the local path builds the causal mask itself when ``attention_mask`` is None.
"""

from __future__ import annotations

import bisect
import warnings
from dataclasses import dataclass
from typing import Sequence

import torch
from megatron.core.packed_seq_params import PackedSeqParams

__all__ = [
    "micro_batch_cost",
    "split_into_micro_batches",
    "pad_overhead",
    "round_up",
    "PackedBatch",
    "pack_sequences",
    "unpack",
    "PaddedBatch",
    "pad_sequences",
    "unpad",
]


# ----------------------------------------------------------------------------- splitting


def micro_batch_cost(lengths: Sequence[int], packed: bool) -> int:
    """Tokens computed for one micro-batch: sum of lengths packed, ``max_len * count`` padded."""
    if not lengths:
        return 0
    return sum(lengths) if packed else max(lengths) * len(lengths)


def _best_fit_decreasing(order: list[int], lengths: Sequence[int], budget: int) -> list[list[int]]:
    """Few micro-batches: each sequence, longest first, joins the fullest one it still fits in.

    Best-fit decreasing stays within a bin or two of ``ceil(total / budget)`` on DAPO-like lengths.
    Free space is kept sorted as ``(free, bin)`` pairs, so ties go to the lower bin: deterministic.
    """
    bins: list[list[int]] = []
    free: list[tuple[int, int]] = []  # sorted (free tokens, bin index)
    for index in order:
        n = lengths[index]
        pos = bisect.bisect_left(free, (n, -1))
        if pos < len(free):
            room, b = free.pop(pos)
            bins[b].append(index)
            bisect.insort(free, (room - n, b))
        else:  # opens a new bin; an over-long sequence gets one with no room left
            bins.append([index])
            bisect.insort(free, (max(budget - n, -1), len(bins) - 1))
    return bins


def _split_costliest_until(bins: list[list[int]], lengths: Sequence[int], target: int, packed: bool) -> list[list[int]]:
    """Split the costliest multi-sequence bin in two until there are ``target`` bins.

    Splitting never raises a bin's cost, so a split that met the budget still does.
    """
    bins = [list(b) for b in bins]
    while len(bins) < target:
        splittable = [i for i, b in enumerate(bins) if len(b) > 1]
        if not splittable:
            raise AssertionError("cannot split further: fewer sequences than micro-batches")
        worst = max(splittable, key=lambda i: (micro_batch_cost([lengths[j] for j in bins[i]], packed), -i))
        members = sorted(bins.pop(worst), key=lambda j: (-lengths[j], j))
        if packed:  # alternate longest-first so both halves carry similar token counts
            halves = [members[0::2], members[1::2]]
        else:  # keep similar lengths together: the longer half and the shorter half
            halves = [members[: len(members) // 2], members[len(members) // 2 :]]
        bins.extend(halves)
    return bins


def _best_transfer(
    heavy: list[int], light: list[int], lengths: Sequence[int], gap: int, room: int
) -> tuple[int, int, int | None] | None:
    """The move (one sequence heavy -> light) or swap that best halves ``gap`` within ``room`` tokens.

    Returns ``(score, sequence from heavy, sequence from light or None)``; a transfer of ``d`` tokens
    with ``0 < d < gap`` always narrows the pair's gap. A move may not empty ``heavy``.
    """
    heavy_sorted = sorted((lengths[i], i) for i in heavy)
    heavy_lengths = [n for n, _ in heavy_sorted]
    best = None
    candidates: list[tuple[int, int | None]] = [(lengths[j], j) for j in light]
    if len(heavy) > 1:
        candidates.insert(0, (0, None))  # a plain move
    for back, j in candidates:
        pos = bisect.bisect_left(heavy_lengths, back + gap / 2)
        for p in (pos - 1, pos):
            if 0 <= p < len(heavy_sorted):
                out, i = heavy_sorted[p]
                delta = out - back
                if 0 < delta < gap and delta <= room:
                    score = abs(gap - 2 * delta)
                    if best is None or score < best[0]:
                        best = (score, i, j)
    return best


def _rebalance(bins: list[list[int]], lengths: Sequence[int], budget: int, width: int = 8) -> list[list[int]]:
    """Even out packed token counts by moves and swaps from heavy to light micro-batches.

    Each step tries the ``width`` heaviest multi-sequence bins against the ``width`` lightest bins
    and applies the first transfer found. A transfer of ``0 < d < gap`` tokens from a heavier to a
    lighter bin makes the sum of squared loads strictly fall (no cycles); no bin goes over budget or
    becomes empty. Single-sequence bins only receive: giving away their sequence would empty them.
    Stops when no such pair admits a transfer, or after ``2 * len(lengths)`` steps.
    """
    bins = [list(b) for b in bins]
    loads = [sum(lengths[i] for i in b) for b in bins]
    # Both kept sorted by (load, bin); a step changes two entries.
    receivers = sorted((load, b) for b, load in enumerate(loads))
    givers = sorted((loads[b], b) for b in range(len(bins)) if len(bins[b]) > 1)

    def update(b: int, change: int, count_before: int) -> None:
        receivers.pop(bisect.bisect_left(receivers, (loads[b], b)))
        if count_before > 1:
            givers.pop(bisect.bisect_left(givers, (loads[b], b)))
        loads[b] += change
        bisect.insort(receivers, (loads[b], b))
        if len(bins[b]) > 1:
            bisect.insort(givers, (loads[b], b))

    for _ in range(2 * len(lengths)):
        found = None
        for _, heavy in reversed(givers[-width:]):
            for _, light in receivers[:width]:
                gap = loads[heavy] - loads[light]
                if gap >= 2:
                    found = _best_transfer(bins[heavy], bins[light], lengths, gap, budget - loads[light])
                if found is not None:
                    break
            if found is not None:
                break
        if found is None:
            break
        _, out, back = found
        counts = len(bins[heavy]), len(bins[light])
        bins[heavy].remove(out)
        bins[light].append(out)
        delta = lengths[out]
        if back is not None:
            bins[light].remove(back)
            bins[heavy].append(back)
            delta -= lengths[back]
        update(heavy, -delta, counts[0])
        update(light, delta, counts[1])
    return bins


def _split_packed(order: list[int], lengths: Sequence[int], budget: int, min_bins: int) -> list[list[int]]:
    bins = _best_fit_decreasing(order, lengths, budget)
    if len(bins) < min_bins:
        bins = _split_costliest_until(bins, lengths, min_bins, True)
    return _rebalance(bins, lengths, budget)


def _greedy_padded_segments(order: list[int], lengths: Sequence[int], limit: int) -> list[list[int]]:
    """Cut the longest-first order into consecutive groups of padded cost <= ``limit``.

    Each group starts at its longest sequence ``L`` and takes ``max(1, limit // L)`` sequences; taking
    as many as fit is optimal for consecutive groups, since any part of a fitting group also fits.
    """
    segments, start = [], 0
    while start < len(order):
        longest = max(lengths[order[start]], 1)
        take = max(1, limit // longest)
        segments.append(order[start : start + take])
        start += take
    return segments


def _split_padded(order: list[int], lengths: Sequence[int], budget: int, min_bins: int) -> list[list[int]]:
    # Sorting by length and cutting into consecutive groups keeps similar lengths together, which is
    # what minimises padding.
    num_bins = max(min_bins, len(_greedy_padded_segments(order, lengths, budget)))
    # Smallest per-bin limit that still needs at most num_bins groups: the most even split of the
    # costliest micro-batch (binary search; the group count only falls as the limit grows).
    lo, hi = 1, budget
    while lo < hi:
        mid = (lo + hi) // 2
        if len(_greedy_padded_segments(order, lengths, mid)) <= num_bins:
            hi = mid
        else:
            lo = mid + 1
    bins = _greedy_padded_segments(order, lengths, lo)
    return _split_costliest_until(bins, lengths, num_bins, False)


def split_into_micro_batches(
    seq_lengths: Sequence[int],
    max_tokens_per_micro_batch: int,
    min_num_micro_batches: int = 1,
    packed: bool = True,
) -> list[list[int]]:
    """Group sample indices into micro-batches of at most ``max_tokens_per_micro_batch`` tokens.

    Args:
        seq_lengths: tokens per sample (prompt + response, without padding).
        max_tokens_per_micro_batch: the token budget (``trainer.max_tokens_per_micro_batch``).
        min_num_micro_batches: return at least this many micro-batches. Data-parallel ranks must run
            the same number of micro-batches in the pipeline schedule: the trainer all-reduces MAX of
            each rank's ``len(split(...))`` and splits again with that minimum; the result then has
            exactly that many micro-batches on every rank (a rank never needs more than its own count).
        packed: the cost model - True: sum of lengths (padding removed, THD packing); False: right
            padding, ``max_len * count``.

    Returns:
        A list of micro-batches, each a list of sample indices in ascending order; every index appears
        exactly once. Micro-batches are ordered by cost, largest first (an out-of-memory shows on the
        first one). The number is ``max(min_num_micro_batches, needed)``, where ``needed`` is the
        smallest count this balancing finds within budget. With ``min_num_micro_batches`` at most the
        number of samples all micro-batches are non-empty; with more it ends with empty micro-batches,
        which the caller must still run as zero-token micro-batches (zero loss, no gradient) so the
        schedule stays in step with the other ranks. An empty input gives ``min_num_micro_batches``
        empty micro-batches.

    Balance: packed micro-batches come from best-fit decreasing (few micro-batches), then moves and
    swaps between the heaviest and lightest ones even out their token counts within the budget.
    Padded ones are consecutive runs of the length-sorted samples (similar lengths together, least
    padding), with the costliest micro-batch made as cheap as the micro-batch count allows; their
    costs are less even (a long sequence that cannot share costs only its own length).

    A sample longer than the budget does not fit anywhere: it gets a micro-batch of its own and a
    ``UserWarning`` says how many there were. (Config validation already requires the budget to hold
    ``max_prompt_length + max_response_length``, so in training this only signals a bug upstream.)
    """
    budget = int(max_tokens_per_micro_batch)
    if budget < 1:
        raise ValueError(f"'trainer.max_tokens_per_micro_batch' must be >= 1 here, got {max_tokens_per_micro_batch}")
    if min_num_micro_batches < 1:
        raise ValueError(f"min_num_micro_batches must be >= 1, got {min_num_micro_batches}")
    lengths = [int(n) for n in seq_lengths]
    if any(n < 0 for n in lengths):
        raise ValueError("sequence lengths must be >= 0")
    over_long = [n for n in lengths if n > budget]
    if over_long:
        warnings.warn(
            f"{len(over_long)} sequence(s) exceed 'trainer.max_tokens_per_micro_batch'={budget} "
            f"(longest {max(over_long)} tokens) and each run as a micro-batch of their own; raise "
            f"trainer.max_tokens_per_micro_batch to at least {max(over_long)} to bound memory",
            stacklevel=2,
        )

    num_samples = len(lengths)
    if num_samples == 0:
        return [[] for _ in range(min_num_micro_batches)]
    if min_num_micro_batches >= num_samples:
        # One sample per micro-batch, then the empty ones that keep the schedule in step.
        singles = [[i] for i in sorted(range(num_samples), key=lambda i: (-lengths[i], i))]
        return singles + [[] for _ in range(min_num_micro_batches - num_samples)]

    order = sorted(range(num_samples), key=lambda i: (-lengths[i], i))
    split = _split_packed if packed else _split_padded
    bins = [sorted(b) for b in split(order, lengths, budget, min_num_micro_batches)]
    bins.sort(key=lambda b: (-micro_batch_cost([lengths[i] for i in b], packed), b[0]))
    return bins


def pad_overhead(micro_batches: Sequence[Sequence[int]], seq_lengths: Sequence[int], packed: bool) -> float:
    """Fraction of computed tokens that are padding: ``1 - real / computed`` (0.0 when packed)."""
    real = sum(int(seq_lengths[i]) for mb in micro_batches for i in mb)
    computed = sum(micro_batch_cost([int(seq_lengths[i]) for i in mb], packed) for mb in micro_batches)
    return 0.0 if computed == 0 else 1.0 - real / computed


# ----------------------------------------------------------------------------- packed (THD) inputs


def round_up(n: int, multiple: int) -> int:
    """`n` rounded up to a multiple of `multiple` (a padded length)."""
    return -(-n // multiple) * multiple


def _check_masks(sequences: Sequence[torch.Tensor], loss_masks: Sequence[torch.Tensor] | None) -> None:
    if any(s.dim() != 1 for s in sequences):
        raise ValueError("each sequence must be a 1-D tensor of token ids")
    if loss_masks is not None:
        if len(loss_masks) != len(sequences):
            raise ValueError(f"got {len(loss_masks)} loss masks for {len(sequences)} sequences")
        for i, (s, m) in enumerate(zip(sequences, loss_masks)):
            if m.shape != s.shape:
                raise ValueError(f"loss mask {i} has shape {tuple(m.shape)}, sequence has {tuple(s.shape)}")


@dataclass
class PackedBatch:
    """Sequences concatenated into one row for Megatron's THD format.

    ``input_ids``, ``position_ids`` and ``loss_mask`` are ``[1, total]``: sequence ``i`` occupies
    ``[cu_seqlens_padded[i], cu_seqlens_padded[i] + length_i)`` followed by its padding slot (if any).
    ``cu_seqlens`` holds the real cumulative lengths and ``cu_seqlens_padded`` the slot boundaries
    (equal when ``pad_to_multiple_of`` is 1), both int32 ``[n + 1]`` starting at 0.
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    loss_mask: torch.Tensor
    cu_seqlens: torch.Tensor
    cu_seqlens_padded: torch.Tensor
    max_seqlen: int

    @property
    def lengths(self) -> torch.Tensor:
        return self.cu_seqlens[1:] - self.cu_seqlens[:-1]

    def packed_seq_params(self):
        """Megatron's ``PackedSeqParams`` for this batch (``qkv_format='thd'``; needs TE attention).

        Every offset field is ``cu_seqlens_padded`` (one object) and ``max_seqlen`` the longest slot:
        see the module docstring for why the real offsets are not passed.
        """
        offsets = self.cu_seqlens_padded
        return PackedSeqParams(
            qkv_format="thd",
            cu_seqlens_q=offsets,
            cu_seqlens_kv=offsets,
            cu_seqlens_q_padded=offsets,
            cu_seqlens_kv_padded=offsets,
            max_seqlen_q=self.max_seqlen,
            max_seqlen_kv=self.max_seqlen,
        )


def pack_sequences(
    sequences: Sequence[torch.Tensor],
    pad_to_multiple_of: int = 1,
    pad_token_id: int = 0,
    loss_masks: Sequence[torch.Tensor] | None = None,
) -> PackedBatch:
    """Concatenate 1-D token id tensors into a :class:`PackedBatch`.

    Args:
        sequences: one 1-D id tensor per sample (prompt + response, no padding).
        pad_to_multiple_of: round every sequence's slot up to this multiple (``2 * cp``, times ``tp``
            with sequence parallelism; see the module docstring); padding holds ``pad_token_id``
            with loss mask 0.
        loss_masks: optional per-sample masks (e.g. 1 on response tokens); default 1 on every real token.
    """
    if pad_to_multiple_of < 1:
        raise ValueError(f"pad_to_multiple_of must be >= 1, got {pad_to_multiple_of}")
    _check_masks(sequences, loss_masks)
    lengths = [int(s.numel()) for s in sequences]
    slots = [round_up(n, pad_to_multiple_of) for n in lengths]
    total = sum(slots)
    device = sequences[0].device if sequences else torch.device("cpu")
    dtype = sequences[0].dtype if sequences else torch.long
    input_ids = torch.full((1, total), pad_token_id, dtype=dtype, device=device)
    position_ids = torch.zeros((1, total), dtype=torch.long, device=device)
    loss_mask = torch.zeros((1, total), dtype=torch.float32, device=device)
    offset = 0
    for i, (seq, n, slot) in enumerate(zip(sequences, lengths, slots)):
        input_ids[0, offset : offset + n] = seq
        position_ids[0, offset : offset + slot] = torch.arange(slot, device=device)
        loss_mask[0, offset : offset + n] = 1.0 if loss_masks is None else loss_masks[i].to(torch.float32)
        offset += slot
    cu_seqlens = torch.zeros(len(lengths) + 1, dtype=torch.int32, device=device)
    cu_seqlens[1:] = torch.cumsum(torch.tensor(lengths, dtype=torch.int32, device=device), 0)
    cu_seqlens_padded = torch.zeros_like(cu_seqlens)
    cu_seqlens_padded[1:] = torch.cumsum(torch.tensor(slots, dtype=torch.int32, device=device), 0)
    return PackedBatch(
        input_ids=input_ids,
        position_ids=position_ids,
        loss_mask=loss_mask,
        cu_seqlens=cu_seqlens,
        cu_seqlens_padded=cu_seqlens_padded,
        max_seqlen=max(slots, default=0),
    )


def unpack(
    per_token_values: torch.Tensor,
    cu_seqlens: torch.Tensor,
    cu_seqlens_padded: torch.Tensor | None = None,
) -> list[torch.Tensor]:
    """Split per-token values of a packed row back into one tensor per sequence.

    ``per_token_values`` is ``[total, ...]`` or ``[1, total, ...]`` (e.g. log-probs of a packed
    forward); padding slots (``cu_seqlens_padded``) are dropped. Returns views, in sample order.
    """
    values = per_token_values[0] if per_token_values.dim() >= 2 and per_token_values.shape[0] == 1 else per_token_values
    starts = (cu_seqlens_padded if cu_seqlens_padded is not None else cu_seqlens)[:-1].tolist()
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).tolist()
    return [values[start : start + n] for start, n in zip(starts, lengths)]


# ----------------------------------------------------------------------------- padded inputs


@dataclass
class PaddedBatch:
    """Right-padded ``[b, max_len]`` inputs for attention paths without packing (the local spec).

    ``valid_mask`` is True on real tokens (note: Megatron's own ``attention_mask`` uses the opposite
    convention, True = masked; with right padding and causal attention pass ``attention_mask=None``).
    ``loss_mask`` is float, 0 on padding. ``position_ids`` count 0.. on every row (padding included).
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    valid_mask: torch.Tensor
    loss_mask: torch.Tensor
    lengths: torch.Tensor


def pad_sequences(
    sequences: Sequence[torch.Tensor],
    pad_token_id: int = 0,
    loss_masks: Sequence[torch.Tensor] | None = None,
    pad_to_multiple_of: int = 1,
) -> PaddedBatch:
    """Right-pad 1-D token id tensors to ``[b, max_len]`` (``max_len`` rounded up to ``pad_to_multiple_of``,
    e.g. ``tp`` with sequence parallelism)."""
    if pad_to_multiple_of < 1:
        raise ValueError(f"pad_to_multiple_of must be >= 1, got {pad_to_multiple_of}")
    _check_masks(sequences, loss_masks)
    lengths = [int(s.numel()) for s in sequences]
    width = round_up(max(lengths, default=0), pad_to_multiple_of)
    device = sequences[0].device if sequences else torch.device("cpu")
    dtype = sequences[0].dtype if sequences else torch.long
    input_ids = torch.full((len(sequences), width), pad_token_id, dtype=dtype, device=device)
    loss_mask = torch.zeros((len(sequences), width), dtype=torch.float32, device=device)
    for i, (seq, n) in enumerate(zip(sequences, lengths)):
        input_ids[i, :n] = seq
        loss_mask[i, :n] = 1.0 if loss_masks is None else loss_masks[i].to(torch.float32)
    length_tensor = torch.tensor(lengths, dtype=torch.long, device=device)
    positions = torch.arange(width, device=device)
    return PaddedBatch(
        input_ids=input_ids,
        position_ids=positions.expand(len(sequences), width).clone(),
        valid_mask=positions[None, :] < length_tensor[:, None],
        loss_mask=loss_mask,
        lengths=length_tensor,
    )


def unpad(per_token_values: torch.Tensor, lengths: torch.Tensor | Sequence[int]) -> list[torch.Tensor]:
    """Rows of ``[b, max_len, ...]`` values cut to each sequence's length (views, in sample order)."""
    return [per_token_values[i, : int(n)] for i, n in enumerate(lengths)]
