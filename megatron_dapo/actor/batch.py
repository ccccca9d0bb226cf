"""The typed batch the actor consumes, and the model inputs of one micro-batch built from it.

    batch = PolicyBatch.from_token_lists(prompts, responses, old_log_probs=..., advantages=...)
    plan = plan_micro_batches(batch.model_lengths(), max_tokens=8192, micro_batch_size=1, packed=False)
    micro = [build_micro_batch(batch, indices, packed=False) for indices in plan]

Token alignment. A sequence is its prompt (``p`` tokens) followed by its response (``r`` tokens).
Response token ``j`` is predicted by the logits at position ``p - 1 + j``, so the model reads the
first ``p + r - 1`` tokens (the last token predicts nothing we need) and the label of position
``t`` is token ``t + 1``. Everything the loss needs is aligned with the response: ``[n, R]`` where
column ``j`` is response token ``j`` and ``R`` is the response width of the batch.

Two input layouts, chosen by the attention implementation:

* padded: ``[rows, S]`` right-padded, one sequence per row; the local (non-TE) attention needs an
  explicit causal mask, and right padding with causal attention never lets a real token see a pad;
* packed (THD): all sequences of the micro-batch concatenated in one row with
  ``PackedSeqParams``; only Transformer Engine's attention honours it (see data/micro_batches.py).

In both, ``gather_index[k, j]`` is the flat position in ``labels.flatten()`` (and in the flattened
per-token model output) of response token ``j`` of sequence ``k``, so the rest of the actor never
needs to know which layout ran.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import torch

from megatron_dapo.actor.routing import micro_batch_routing
from megatron_dapo.data.micro_batches import pack_sequences, round_up, split_into_micro_batches
from megatron_dapo.distributed.context_parallel import split_for_cp_rank

__all__ = [
    "MicroBatch",
    "PolicyBatch",
    "build_micro_batch",
    "plan_micro_batches",
    "split_for_context_parallel",
    "split_mini_batches",
]

_PER_RESPONSE_TOKEN_FIELDS = ("old_log_probs", "ref_log_probs", "rollout_log_probs")


@dataclass
class PolicyBatch:
    """The sequences of one data-parallel rank, with what the policy loss needs per response token.

    Shapes (``n`` sequences, prompt width ``P``, response width ``R``):

    * ``prompt_ids`` ``[n, P]`` long, LEFT-padded: prompt ``i`` is ``prompt_ids[i, P - prompt_lengths[i]:]``
      (the layout batched generation returns);
    * ``prompt_lengths`` ``[n]``, each >= 1 (the first response token needs a position to be predicted from);
    * ``response_ids`` ``[n, R]`` long, RIGHT-padded: response ``i`` is ``response_ids[i, :response_lengths[i]]``;
    * ``response_lengths`` ``[n]``, each in ``[0, R]``;
    * ``response_mask`` ``[n, R]`` bool, optional: the tokens that enter the loss. Default: every real
      response token. It may only switch tokens off (e.g. the overlong filter masking a whole row);
    * ``old_log_probs``, ``ref_log_probs``, ``rollout_log_probs`` ``[n, R]`` float, optional: log-probs of
      the response tokens under the behaviour policy (the actor before this update), the reference
      model, and the rollout engine (for the truncated-IS correction);
    * ``advantages`` ``[n, R]`` per token or ``[n]`` per sequence, optional;
    * ``routed_experts`` ``[n, T, L, k]`` integer, optional (mixture-of-experts models): the k experts
      each of the L MoE layers routes token ``t`` of `tokens_of` ``(i)`` to, ``T`` = `sequence_width`.
      When set, the forward passes replay it instead of routing (`actor.routing`);
    * ``rollout_routed_experts``: the same, as the rollout engine routed (for R3 and the mismatch metric).

    ``compute_log_probs`` needs only the token fields; ``update`` needs ``old_log_probs`` and
    ``advantages`` (and ``ref_log_probs`` with a KL loss). An empty batch (``n = 0``) is valid: a
    rank whose sequences were all filtered out still takes part in every collective.
    """

    prompt_ids: torch.Tensor
    prompt_lengths: torch.Tensor
    response_ids: torch.Tensor
    response_lengths: torch.Tensor
    response_mask: Optional[torch.Tensor] = None
    old_log_probs: Optional[torch.Tensor] = None
    advantages: Optional[torch.Tensor] = None
    ref_log_probs: Optional[torch.Tensor] = None
    rollout_log_probs: Optional[torch.Tensor] = None
    routed_experts: Optional[torch.Tensor] = None
    rollout_routed_experts: Optional[torch.Tensor] = None

    def __post_init__(self) -> None:
        self.prompt_lengths = torch.as_tensor(self.prompt_lengths, dtype=torch.long)
        self.response_lengths = torch.as_tensor(self.response_lengths, dtype=torch.long)
        if self.prompt_ids.dim() != 2 or self.response_ids.dim() != 2:
            raise ValueError(
                f"prompt_ids and response_ids must be [n, width], got {tuple(self.prompt_ids.shape)} "
                f"and {tuple(self.response_ids.shape)}"
            )
        n, prompt_width = self.prompt_ids.shape
        width = self.response_ids.shape[1]
        for name in ("response_ids", "prompt_lengths", "response_lengths"):
            if getattr(self, name).shape[0] != n:
                raise ValueError(f"{name} has {getattr(self, name).shape[0]} rows, prompt_ids has {n}")
        if n and (int(self.prompt_lengths.min()) < 1 or int(self.prompt_lengths.max()) > prompt_width):
            raise ValueError(f"prompt_lengths must be in [1, {prompt_width}] (the prompt_ids width)")
        if n and (int(self.response_lengths.min()) < 0 or int(self.response_lengths.max()) > width):
            raise ValueError(f"response_lengths must be in [0, {width}] (the response_ids width)")
        real = self.response_valid_mask()
        if self.response_mask is not None:
            if tuple(self.response_mask.shape) != (n, width):
                raise ValueError(f"response_mask must be [{n}, {width}], got {tuple(self.response_mask.shape)}")
            self.response_mask = self.response_mask.bool()
            if bool((self.response_mask & ~real).any()):
                raise ValueError("response_mask marks tokens past the end of a response (response_lengths)")
        for name in _PER_RESPONSE_TOKEN_FIELDS:
            value = getattr(self, name)
            if value is not None and tuple(value.shape) != (n, width):
                raise ValueError(f"{name} must be [{n}, {width}] like response_ids, got {tuple(value.shape)}")
        if self.advantages is not None and tuple(self.advantages.shape) not in ((n, width), (n,)):
            raise ValueError(f"advantages must be [{n}, {width}] or [{n}], got {tuple(self.advantages.shape)}")
        for name in ("routed_experts", "rollout_routed_experts"):
            value = getattr(self, name)
            if value is not None and (value.dim() != 4 or tuple(value.shape[:2]) != (n, self.sequence_width)):
                raise ValueError(
                    f"{name} must be [{n}, {self.sequence_width}, layers, top-k] (sequence_width = prompt width + "
                    f"response width - 1), got {tuple(value.shape)}"
                )

    # ------------------------------------------------------------------ construction

    @classmethod
    def from_token_lists(
        cls,
        prompts: Sequence[Sequence[int] | torch.Tensor],
        responses: Sequence[Sequence[int] | torch.Tensor],
        response_width: Optional[int] = None,
        pad_token_id: int = 0,
        **fields: Any,
    ) -> "PolicyBatch":
        """Build from per-sequence token lists (prompts left-padded, responses right-padded).

        ``response_width`` defaults to the longest response; the per-token ``fields`` must already
        have that width.
        """
        if len(prompts) != len(responses):
            raise ValueError(f"{len(prompts)} prompts but {len(responses)} responses")
        prompt_list = [torch.as_tensor(p, dtype=torch.long).reshape(-1) for p in prompts]
        response_list = [torch.as_tensor(r, dtype=torch.long).reshape(-1) for r in responses]
        prompt_width = max((p.numel() for p in prompt_list), default=1)
        width = max((r.numel() for r in response_list), default=0) if response_width is None else response_width
        n = len(prompt_list)
        prompt_ids = torch.full((n, prompt_width), pad_token_id, dtype=torch.long)
        response_ids = torch.full((n, width), pad_token_id, dtype=torch.long)
        for i, (p, r) in enumerate(zip(prompt_list, response_list)):
            if r.numel() > width:
                raise ValueError(f"response {i} has {r.numel()} tokens, more than response_width={width}")
            prompt_ids[i, prompt_width - p.numel():] = p
            response_ids[i, : r.numel()] = r
        return cls(
            prompt_ids=prompt_ids,
            prompt_lengths=torch.tensor([p.numel() for p in prompt_list], dtype=torch.long),
            response_ids=response_ids,
            response_lengths=torch.tensor([r.numel() for r in response_list], dtype=torch.long),
            **fields,
        )

    # ------------------------------------------------------------------ views

    @property
    def num_sequences(self) -> int:
        return self.prompt_ids.shape[0]

    @property
    def response_width(self) -> int:
        """``R``: the width of every response-aligned tensor."""
        return self.response_ids.shape[1]

    @property
    def sequence_width(self) -> int:
        """``T``: positions of a sequence the model can read, prompt width + response width - 1 (at least 1)."""
        return max(self.prompt_ids.shape[1] + self.response_width - 1, 1)

    def read_mask(self) -> torch.Tensor:
        """``[n, T]`` bool, True on the positions of `tokens_of` the model reads (`model_lengths`)."""
        lengths = torch.tensor(self.model_lengths(), dtype=torch.long)
        return torch.arange(self.sequence_width)[None, :] < lengths[:, None]

    def response_valid_mask(self) -> torch.Tensor:
        """``[n, R]`` bool, True on the real tokens of each response."""
        columns = torch.arange(self.response_width, device=self.response_ids.device)
        return columns[None, :] < self.response_lengths.to(self.response_ids.device)[:, None]

    def loss_mask(self) -> torch.Tensor:
        """``[n, R]`` bool, True on the tokens that enter the loss."""
        return self.response_mask if self.response_mask is not None else self.response_valid_mask()

    def model_lengths(self) -> list[int]:
        """Tokens the model reads per sequence: ``prompt + response - 1`` (at least 1)."""
        return [max(int(p) + int(r) - 1, 1) for p, r in zip(self.prompt_lengths, self.response_lengths)]

    def tokens_of(self, index: int) -> torch.Tensor:
        """Prompt then response tokens of sequence ``index``, without padding."""
        p, r = int(self.prompt_lengths[index]), int(self.response_lengths[index])
        prompt_width = self.prompt_ids.shape[1]
        return torch.cat([self.prompt_ids[index, prompt_width - p:], self.response_ids[index, :r]])

    def select(self, indices: Sequence[int] | torch.Tensor) -> "PolicyBatch":
        """The sub-batch of the given rows (in that order)."""
        index = torch.as_tensor(list(indices) if not isinstance(indices, torch.Tensor) else indices, dtype=torch.long)
        values = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            values[f.name] = None if value is None else value[index.to(value.device)]
        return PolicyBatch(**values)


def split_mini_batches(batch: PolicyBatch, num_mini_batches: int) -> list[PolicyBatch]:
    """Cut a rank's batch into ``num_mini_batches`` contiguous parts (sizes differ by at most one).

    Every rank must call `MegatronActor.update` with the same number of mini-batches; a part may be
    empty when a rank holds fewer sequences than that.
    """
    if num_mini_batches < 1:
        raise ValueError(f"num_mini_batches must be >= 1, got {num_mini_batches}")
    bounds = torch.linspace(0, batch.num_sequences, num_mini_batches + 1).round().long().tolist()
    return [batch.select(range(bounds[i], bounds[i + 1])) for i in range(num_mini_batches)]


# --------------------------------------------------------------------------------------------
# Micro-batch planning
# --------------------------------------------------------------------------------------------


def plan_micro_batches(
    lengths: Sequence[int],
    *,
    max_tokens: int,
    micro_batch_size: int,
    packed: bool,
    min_count: int = 1,
) -> list[list[int]]:
    """Group sequence indices into at least ``min_count`` micro-batches.

    With a token budget (``max_tokens > 0``) this is `data.micro_batches.split_into_micro_batches`
    with the cost model of the layout (packed: sum of lengths; padded: rows x longest). Without one,
    consecutive groups of ``micro_batch_size`` sequences. Missing micro-batches (a rank with less
    data than the others) are empty lists, run as zero-token micro-batches.
    """
    if max_tokens > 0:
        return split_into_micro_batches(lengths, max_tokens, min_num_micro_batches=min_count, packed=packed)
    if micro_batch_size < 1:
        raise ValueError(f"micro_batch_size must be >= 1, got {micro_batch_size}")
    groups = [list(range(i, min(i + micro_batch_size, len(lengths)))) for i in range(0, len(lengths), micro_batch_size)]
    return groups + [[] for _ in range(max(0, min_count - len(groups)))]


# --------------------------------------------------------------------------------------------
# Micro-batch model inputs
# --------------------------------------------------------------------------------------------


@dataclass
class MicroBatch:
    """Model inputs of one micro-batch and its response-aligned loss inputs.

    ``input_ids``, ``position_ids`` and ``labels`` are ``[rows, S]`` (padded) or ``[1, T]`` (packed).
    The response-aligned tensors are ``[k, W]`` for the ``k`` sequences of the micro-batch, ``W``
    its longest response; ``sequence_index`` says which rows of the `PolicyBatch` they are.
    A micro-batch with no sequence (``k = 0``) still has one row of padding so that it can run
    through the pipeline schedule; its loss is exactly zero.
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    labels: torch.Tensor
    attention_mask: Optional[torch.Tensor]
    """Megatron convention (True = masked); None lets the attention apply its own causal mask."""
    packed_seq_params: Optional[Any]
    """Megatron's ``PackedSeqParams`` (THD layout) or None (padded rows)."""
    gather_index: torch.Tensor
    """``[k, W]`` long: flat position (in ``labels.flatten()`` and the flattened per-token model output)
    of response token ``j`` of sequence ``k``; past a response's end it repeats a valid position."""
    response_valid: torch.Tensor
    """``[k, W]`` bool: real response tokens."""
    loss_mask: torch.Tensor
    """``[k, W]`` bool: tokens in the loss (a subset of ``response_valid``)."""
    sequence_index: torch.Tensor
    """``[k]`` rows of the `PolicyBatch` this micro-batch holds."""
    old_log_probs: Optional[torch.Tensor] = None
    advantages: Optional[torch.Tensor] = None
    ref_log_probs: Optional[torch.Tensor] = None
    rollout_log_probs: Optional[torch.Tensor] = None
    real_tokens: int = 0
    """Tokens of real sequences the model reads."""
    computed_tokens: int = 0
    """Token positions the model computes (real + padding), over the whole sequence (all CP ranks)."""
    token_source: Optional[torch.Tensor] = None
    """``[rows, S]`` long, before any context-parallel split: the flat position ``i * T + t`` in the
    batch's ``[n, T]`` sequence positions of each input position, -1 on padding (`actor.routing`)."""
    routed_experts: Optional[torch.Tensor] = None
    """``[rows, S, L, k]`` long, before any context-parallel split: the routing replayed at each input
    position (from `PolicyBatch.routed_experts`), or None (the routers choose)."""
    context_parallel: int = 1
    """CP size the model inputs are split over (`split_for_context_parallel`); 1: full sequences. The
    per-token outputs are gathered back to full order over the CP group before ``gather_index`` applies."""

    @property
    def num_sequences(self) -> int:
        return int(self.sequence_index.numel())

    @property
    def seq_length(self) -> int:
        return self.input_ids.shape[1]

    @property
    def rows(self) -> int:
        return self.input_ids.shape[0]


def build_micro_batch(
    batch: PolicyBatch,
    indices: Sequence[int],
    *,
    packed: bool = False,
    pad_token_id: int = 0,
    pad_to_multiple_of: int = 1,
    device: Optional[torch.device] = None,
) -> MicroBatch:
    """Model inputs for the sequences ``indices`` of ``batch`` (see the module docstring).

    Args:
        packed: THD layout (one row, ``PackedSeqParams``; needs Transformer Engine attention) instead
            of right-padded rows.
        pad_to_multiple_of: padded: the row length is rounded up to it; packed: every sequence slot
            is (sequence parallelism needs the tensor-parallel size here).

    ``attention_mask`` is left None: causal attention needs no other mask with right padding, and
    the caller sets an explicit causal mask where the attention implementation wants one.
    """
    device = device or batch.prompt_ids.device
    indices = [int(i) for i in indices]
    count = len(indices)
    sequences = [batch.tokens_of(i).to(device) for i in indices]
    inputs = [s[:-1] if s.numel() > 1 else s for s in sequences]
    labels = [s[1:] if s.numel() > 1 else torch.full_like(s, pad_token_id) for s in sequences]
    prompt_lengths = [int(batch.prompt_lengths[i]) for i in indices]
    response_lengths = [int(batch.response_lengths[i]) for i in indices]
    width = max(response_lengths, default=0)
    if not inputs:  # a zero-token micro-batch: one row of padding keeps the pipeline in step
        inputs = [torch.full((pad_to_multiple_of,), pad_token_id, dtype=torch.long, device=device)]
        labels = [inputs[0].clone()]

    if packed:
        packed_inputs = pack_sequences(inputs, pad_to_multiple_of=pad_to_multiple_of, pad_token_id=pad_token_id)
        packed_labels = pack_sequences(labels, pad_to_multiple_of=pad_to_multiple_of, pad_token_id=pad_token_id)
        input_ids, position_ids, label_ids = packed_inputs.input_ids, packed_inputs.position_ids, packed_labels.input_ids
        starts = packed_inputs.cu_seqlens_padded[:-1].to(torch.long)
        attention_mask, packed_seq_params = None, packed_inputs.packed_seq_params()
        token_source = torch.full((1, input_ids.shape[1]), -1, dtype=torch.long, device=device)
    else:
        seq_length = round_up(max(x.numel() for x in inputs), pad_to_multiple_of)
        rows = len(inputs)
        input_ids = torch.full((rows, seq_length), pad_token_id, dtype=torch.long, device=device)
        label_ids = torch.full((rows, seq_length), pad_token_id, dtype=torch.long, device=device)
        for row, (x, y) in enumerate(zip(inputs, labels)):
            input_ids[row, : x.numel()] = x
            label_ids[row, : y.numel()] = y
        position_ids = torch.arange(seq_length, device=device).expand(rows, seq_length).contiguous()
        starts = torch.arange(rows, device=device, dtype=torch.long) * seq_length
        attention_mask, packed_seq_params = None, None
        token_source = torch.full((rows, seq_length), -1, dtype=torch.long, device=device)
    # Input position starts[k] + t of sequence indices[k] is its token t, canonical position indices[k] * T + t.
    flat_source = token_source.view(-1)
    for k, index in enumerate(indices):
        length = inputs[k].numel()
        start = int(starts[k])
        flat_source[start : start + length] = index * batch.sequence_width + torch.arange(length, device=device)

    columns = torch.arange(width, device=device)
    if count:
        first = starts[:count] + torch.tensor(prompt_lengths, device=device) - 1
        lengths = torch.tensor(response_lengths, device=device)
        response_valid = columns[None, :] < lengths[:, None]
        # Positions past a response's end are clamped onto its first one: valid index, masked value.
        gather_index = first[:, None] + torch.where(response_valid, columns[None, :], 0)
    else:
        response_valid = torch.zeros((0, width), dtype=torch.bool, device=device)
        gather_index = torch.zeros((0, width), dtype=torch.long, device=device)
    index = torch.tensor(indices, dtype=torch.long)

    def rows_of(value: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        if value is None:
            return None
        taken = value[index.to(value.device)]
        return (taken[:, :width] if taken.dim() == 2 else taken).to(device)

    real = sum(x.numel() for x in inputs) if count else 0
    routed = None
    if batch.routed_experts is not None:
        routed = micro_batch_routing(batch.routed_experts, token_source)
    return MicroBatch(
        input_ids=input_ids,
        position_ids=position_ids,
        labels=label_ids,
        attention_mask=attention_mask,
        packed_seq_params=packed_seq_params,
        gather_index=gather_index,
        response_valid=response_valid,
        loss_mask=rows_of(batch.loss_mask()) if count else response_valid.clone(),
        sequence_index=index.to(device),
        old_log_probs=rows_of(batch.old_log_probs),
        advantages=rows_of(batch.advantages),
        ref_log_probs=rows_of(batch.ref_log_probs),
        rollout_log_probs=rows_of(batch.rollout_log_probs),
        real_tokens=real,
        computed_tokens=int(input_ids.numel()),
        token_source=token_source,
        routed_experts=routed,
    )



def split_for_context_parallel(micro_batch: MicroBatch, cp_size: int, cp_rank: int) -> MicroBatch:
    """This context-parallel rank's part of a padded micro-batch (Megatron's 2*CP chunk layout).

    ``input_ids``, ``position_ids`` and ``labels`` keep chunks ``cp_rank`` and ``2*CP-1-cp_rank`` of the
    sequence dimension (`distributed.context_parallel.split_for_cp_rank`, the layout of Megatron's
    ``get_batch_on_this_cp_rank``, of its rotary embedding under CP and of TE's CP attention). The
    response-aligned fields stay whole: every CP rank computes the same loss from the gathered
    per-token log-probs. The row length must already be a multiple of 2*CP (``pad_to_multiple_of``).
    """
    if cp_size == 1:
        return micro_batch
    if micro_batch.packed_seq_params is not None:
        raise ValueError("context parallelism takes right-padded micro-batches, not packed (THD) ones")
    if micro_batch.context_parallel != 1:
        raise ValueError("micro-batch is already split for context parallelism")
    if micro_batch.attention_mask is not None:
        raise ValueError("under context parallelism the attention applies its own causal mask: pass none")
    return dataclasses.replace(
        micro_batch,
        input_ids=split_for_cp_rank(micro_batch.input_ids, 1, cp_size, cp_rank),
        position_ids=split_for_cp_rank(micro_batch.position_ids, 1, cp_size, cp_rank),
        labels=split_for_cp_rank(micro_batch.labels, 1, cp_size, cp_rank),
        context_parallel=cp_size,
    )
