"""Rollout experience: generate + score one batch of prompts, merge replicas, build the policy batch.

`Samples` is the driver loop's record of one generation batch: one entry per response (prompt-major,
the n responses of a prompt contiguous) with named fields, so the loop never passes an untyped
"data proto" around. The leader of each data-parallel replica produces its share
(`generate_and_score`); `gather_samples` gives every rank the whole batch in the same order, so that
dynamic sampling and advantages are computed identically everywhere.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Optional, Sequence

import torch

from megatron_dapo.rollout.base import SamplingParams


@dataclass
class Samples:
    """Per-response fields of a batch of generations (all lists of the same length)."""

    uid: list[str]
    """The prompt group of each response (unique within a training step)."""
    prompt_ids: list[list[int]]
    response_ids: list[list[int]]
    rollout_log_probs: list[list[float]]
    truncated: list[bool]
    """Stopped by the length limit (the engine's finish reason)."""
    score: list[float]
    """Reward used for advantages: math score (or the minimum reward) + overlong penalty."""
    acc: list[bool]
    pred: list[Any]
    overlong_penalty: list[float]
    data_source: list[str]

    def __len__(self) -> int:
        return len(self.uid)

    def as_fields(self) -> dict[str, Any]:
        """The fields as `DynamicSamplingBuffer` stores them (lists, indexed by sample)."""
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @classmethod
    def from_fields(cls, values: dict[str, Any]) -> "Samples":
        return cls(**{f.name: list(values[f.name]) for f in fields(cls)})

    @classmethod
    def concat(cls, parts: Sequence["Samples"]) -> "Samples":
        return cls(**{f.name: [v for part in parts for v in getattr(part, f.name)] for f in fields(cls)})


def generate_and_score(
    rollout,
    reward_manager,
    examples: Sequence[Any],
    params: SamplingParams,
    uid_prefix: str,
    *,
    validating: bool = False,
    apply_overlong: bool = True,
) -> Optional[Samples]:
    """Leader of a replica: generate `params.n` responses per example and score them; None elsewhere.

    `examples` are `data.PromptExample`s (prompt ids, ground truth, data source, extra info); the uid
    of example i is ``f"{uid_prefix}{i}"``.
    """
    if not rollout.is_leader:
        return None
    if not examples:
        return Samples.concat([])
    out = rollout.generate([ex.prompt_ids for ex in examples], params)
    owners = [examples[i] for i in out.prompt_index]
    rewards = reward_manager.score(
        out.response_ids,
        [ex.ground_truth for ex in owners],
        data_sources=[ex.data_source for ex in owners],
        extra_infos=[ex.extra_info for ex in owners],
        validating=validating,
        apply_overlong=apply_overlong,
    )
    log_probs = out.log_probs or [torch.zeros(len(r)) for r in out.response_ids]
    return Samples(
        uid=[f"{uid_prefix}{i}" for i in out.prompt_index],
        prompt_ids=[list(ex.prompt_ids) for ex in owners],
        response_ids=[list(map(int, r)) for r in out.response_ids],
        rollout_log_probs=[lp.float().tolist() for lp in log_probs],
        truncated=[bool(t) for t in out.truncated.tolist()],
        score=rewards.scores.tolist(),
        acc=[bool(a) for a in rewards.acc.tolist()],
        pred=list(rewards.preds),
        overlong_penalty=rewards.overlong_penalty.tolist(),
        data_source=[ex.data_source for ex in owners],
    )


def gather_samples(local: Optional[Samples]) -> Samples:
    """Every rank gets all replicas' samples, replica 0 first (world collective)."""
    from megatron_dapo.distributed.objects import gather_from_leaders

    return Samples.concat(gather_from_leaders(local))


def build_policy_batch(
    samples: Samples,
    advantages: torch.Tensor,
    pad_token_id: int,
    response_width: int,
    mask_truncated: bool = False,
):
    """The `PolicyBatch` of `samples` (advantages per sequence; rollout log-probs kept for
    mismatch metrics and truncated IS). `mask_truncated` drops truncated responses from the loss
    (DAPO's overlong filtering, `algorithm.overlong_filter`)."""
    from megatron_dapo.actor import PolicyBatch

    rollout = torch.zeros(len(samples), response_width)
    for row, values in enumerate(samples.rollout_log_probs):
        rollout[row, : len(values)] = torch.tensor(values, dtype=torch.float32)
    batch = PolicyBatch.from_token_lists(
        samples.prompt_ids,
        samples.response_ids,
        response_width=response_width,
        pad_token_id=pad_token_id,
        advantages=advantages.float(),
        rollout_log_probs=rollout,
    )
    if mask_truncated:
        keep = ~torch.tensor(samples.truncated, dtype=torch.bool)
        batch.response_mask = batch.response_valid_mask() & keep[:, None]
    return batch
