"""Dynamic sampling (DAPO section 3.2): train only on prompt groups that carry a learning signal.

A group whose responses all have the same accuracy (all right or all wrong) gets zero
group-relative advantage, so it would only dilute the batch. DAPO drops such groups and keeps
generating until ``train_batch_size`` informative prompts are collected.

The filter looks at the raw per-sample metric (by default ``acc``), never at the overlong-shaped
reward: an all-wrong group whose responses have different lengths gets different shaped rewards
but still teaches nothing about correctness, and must be dropped.

Determinism across ranks: everything here is a pure function of its inputs. Feed every rank the
same (gathered) metric and group ids and each reaches the same keep / generate-again decision.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Optional, Union

import torch

from megatron_dapo.algorithm.advantage import GroupIds, index_groups
from megatron_dapo.errors import StopError

__all__ = [
    "GroupFilterResult",
    "select_informative_groups",
    "DynamicSamplingExhausted",
    "DynamicSamplingBuffer",
]

Field = Union[torch.Tensor, list]
Metric = Union[torch.Tensor, Sequence[float], Sequence[bool]]


@dataclass
class GroupFilterResult:
    """Outcome of `select_informative_groups` for one generation batch.

    Attributes:
        keep: bool tensor ``[N]``, True for the samples of kept groups.
        kept_group_ids: ids of the kept groups, in order of first appearance.
        group_index: long tensor ``[N]``, the group number (first-appearance order) of each sample.
        group_ids: ids of all groups, in order of first appearance.
        group_kept: bool tensor ``[G]``, whether each group is kept.
        num_groups: groups in the batch.
        num_kept: groups kept (metric not constant, or a group of one sample).
        num_all_correct: dropped groups where every sample has metric 1 (acc true).
        num_all_wrong: dropped groups where every sample has metric 0 (acc false).
        num_constant: dropped groups with another constant value (non-binary metric).
    Groups of one sample are always kept and counted in none of the three dropped categories;
    ``num_groups == num_kept + num_all_correct + num_all_wrong + num_constant``.
    """

    keep: torch.Tensor
    kept_group_ids: list
    group_index: torch.Tensor
    group_ids: list
    group_kept: torch.Tensor
    num_groups: int
    num_kept: int
    num_all_correct: int
    num_all_wrong: int
    num_constant: int


def _metric_tensor(metric: Metric) -> torch.Tensor:
    values = metric.detach().cpu() if isinstance(metric, torch.Tensor) else torch.as_tensor(list(metric))
    if values.dim() != 1:
        raise ValueError(f"metric must be 1-D (one value per sample), got shape {tuple(values.shape)}")
    values = values.to(torch.float64)
    if not bool(torch.isfinite(values).all()):
        raise ValueError("the dynamic-sampling metric contains NaN or inf")
    return values


def select_informative_groups(metric: Metric, group_ids: GroupIds, enabled: bool = True) -> GroupFilterResult:
    """Keep the groups whose ``metric`` is not constant across their samples.

    Args:
        metric: one value per sample (bool or float), e.g. the raw accuracy ``acc``.
        group_ids: group (prompt uid) of each sample; groups need not be contiguous.
        enabled: ``False`` keeps every group (the counts are still reported).

    Returns:
        A `GroupFilterResult`. A group of a single sample is kept.
    """
    values = _metric_tensor(metric)
    inverse, unique_ids = index_groups(group_ids, device=torch.device("cpu"))
    if inverse.numel() != values.numel():
        raise ValueError(f"{values.numel()} metric values but {inverse.numel()} group ids")
    num_groups = len(unique_ids)
    sizes = torch.zeros(num_groups, dtype=torch.long).index_add_(0, inverse, torch.ones_like(inverse))
    group_min = torch.full((num_groups,), float("inf"), dtype=torch.float64).scatter_reduce(
        0, inverse, values, reduce="amin"
    )
    group_max = torch.full((num_groups,), float("-inf"), dtype=torch.float64).scatter_reduce(
        0, inverse, values, reduce="amax"
    )
    constant = (group_min == group_max) & (sizes > 1)
    all_correct = constant & (group_min == 1)
    all_wrong = constant & (group_min == 0)
    group_kept = torch.ones_like(constant) if not enabled else ~constant
    keep = group_kept[inverse]
    return GroupFilterResult(
        keep=keep,
        kept_group_ids=[gid for gid, kept in zip(unique_ids, group_kept.tolist()) if kept],
        group_index=inverse,
        group_ids=unique_ids,
        group_kept=group_kept,
        num_groups=num_groups,
        num_kept=int(group_kept.sum()),
        num_all_correct=int(all_correct.sum()),
        num_all_wrong=int(all_wrong.sum()),
        num_constant=int((constant & ~all_correct & ~all_wrong).sum()),
    )


class DynamicSamplingExhausted(StopError, RuntimeError):
    """Too many generation batches without filling the train batch with informative groups."""


def _select(value: Field, index: torch.Tensor, name: str) -> Field:
    if isinstance(value, torch.Tensor):
        return value.index_select(0, index.to(value.device))
    if isinstance(value, (list, tuple)):
        return [value[i] for i in index.tolist()]
    raise TypeError(f"batch field {name!r} must be a torch.Tensor or a list, got {type(value).__name__}")


def _concat(parts: list[Field], name: str, pad_value: Any) -> Field:
    """Concatenate along dim 0; tensors are right-padded with ``pad_value`` on every other dim."""
    if all(isinstance(p, list) for p in parts):
        return [item for part in parts for item in part]
    if not all(isinstance(p, torch.Tensor) for p in parts):
        raise TypeError(f"batch field {name!r} is a tensor in some generation batches and a list in others")
    ndims = {p.dim() for p in parts}
    dtypes = {p.dtype for p in parts}
    if len(ndims) != 1 or len(dtypes) != 1:
        raise ValueError(f"batch field {name!r} changes rank or dtype between generation batches: {ndims}, {dtypes}")
    target = [max(p.shape[d] for p in parts) for d in range(1, parts[0].dim())]
    padded = []
    for part in parts:
        pad: list[int] = []  # F.pad order: last dim first, (left, right) pairs
        for d in reversed(range(1, part.dim())):
            pad += [0, target[d - 1] - part.shape[d]]
        padded.append(torch.nn.functional.pad(part, pad, value=pad_value) if any(pad) else part)
    return torch.cat(padded, dim=0)


class DynamicSamplingBuffer:
    """Accumulates informative prompt groups over generation batches until a train batch is full.

    One trainer path for both settings: with ``enabled=False`` every group is kept, and the batch
    is still trimmed to ``train_batch_size`` prompts.

    Usage per optimizer step::

        while not buffer.is_full:
            batch, acc, uids = generate_and_score()      # one generation batch
            buffer.add(batch, acc, uids)                 # raises DynamicSamplingExhausted
        train_batch = buffer.take()                      # train_batch_size * n samples
        log(buffer.stats)                                # counts of the step just taken

    ``stats`` and ``num_gen_batches`` describe the step in progress, or after `take` the step just
    taken until the next `add` starts a new one. Generation batches are counted per step,
    separately from optimizer steps.

    Args:
        train_batch_size: prompts (groups) per train batch.
        n_samples_per_prompt: responses per prompt; every group must have exactly this many.
        max_num_gen_batches: give up (raise) when this many generation batches in one step did
            not fill the batch; 0 means never give up.
        enabled: filter groups (DAPO dynamic sampling) or keep them all.
        pad_values: per-field padding value for tensors whose non-batch dims differ between
            generation batches (e.g. ``{"input_ids": pad_token_id}``); default 0.
        carry_over: keep the informative groups beyond ``train_batch_size`` for the next step
            (asynchronous training, where they cost nothing more to keep than to drop; `drop_stale`
            then removes those that grew too old) instead of discarding them (the paper's loop).
    """

    def __init__(
        self,
        train_batch_size: int,
        n_samples_per_prompt: int,
        max_num_gen_batches: int = 0,
        enabled: bool = True,
        pad_values: Optional[Mapping[str, Any]] = None,
        carry_over: bool = False,
    ) -> None:
        if train_batch_size < 1 or n_samples_per_prompt < 1:
            raise ValueError(
                "train_batch_size and n_samples_per_prompt must be >= 1, "
                f"got {train_batch_size}, {n_samples_per_prompt}"
            )
        if max_num_gen_batches < 0:
            raise ValueError(f"max_num_gen_batches must be >= 0 (0 = unlimited), got {max_num_gen_batches}")
        self.train_batch_size = train_batch_size
        self.n_samples_per_prompt = n_samples_per_prompt
        self.max_num_gen_batches = max_num_gen_batches
        self.enabled = enabled
        self.pad_values = dict(pad_values or {})
        self.carry_over = carry_over
        self._carried: Optional[dict[str, Field]] = None
        self._carried_groups = 0
        self._fields: Optional[tuple[str, ...]] = None
        self._reset()

    def _reset(self) -> None:
        """Start a step: empty, but for the groups a `carry_over` buffer kept from the last one."""
        self._parts: list[dict[str, Field]] = [self._carried] if self._carried is not None else []
        self._stored_groups = self._carried_groups
        self._carried, self._carried_groups = None, 0
        if not self._parts:
            self._fields = None
        self._seen_group_ids: set = set()
        self._stats = {
            "num_gen_batches": 0,
            "num_groups_generated": 0,
            "num_groups_kept": 0,
            "num_groups_all_correct": 0,
            "num_groups_all_wrong": 0,
            "num_groups_constant": 0,
            "num_samples_reward_failed": 0,
            "num_groups_carried": self._stored_groups,
            "num_groups_stale_dropped": 0,
        }
        self._first_reward_failure: Optional[str] = None
        self._taken = False

    @property
    def num_gen_batches(self) -> int:
        """Generation batches added in the current (or just taken) step."""
        return self._stats["num_gen_batches"]

    @property
    def num_stored_groups(self) -> int:
        """Kept groups held for the next train batch (at most ``train_batch_size``)."""
        return self._stored_groups

    def num_carried_groups(self, name: Optional[str] = None, oldest: Any = None) -> int:
        """After `take`: the groups kept for the next step (``carry_over``); with `name`, only those
        whose samples' field `name` is at least `oldest` (fresh enough to be trained then)."""
        if not self._taken or self._carried is None:
            return 0
        if name is None:
            return self._carried_groups
        fresh = sum(1 for value in self.carried_values(name) if value >= oldest)
        return fresh // self.n_samples_per_prompt

    def carried_values(self, name: str) -> list:
        """After `take`: field `name` of the carried groups' samples, as a list (empty without any)."""
        if not self._taken or self._carried is None or self._carried.get(name) is None:
            return []
        values = self._carried[name]
        return values.tolist() if isinstance(values, torch.Tensor) else list(values)

    def carried_state(self) -> Optional[dict]:
        """After `take`: the carried groups ({"groups": count, "fields": {name: values}}), None
        without any; `restore_carried` puts them back (a resumed asynchronous run)."""
        if not self._taken or self._carried is None:
            return None
        return {"groups": self._carried_groups, "fields": dict(self._carried)}

    def restore_carried(self, state: Optional[dict]) -> None:
        """The carried groups of `carried_state`, as if the step before had just been taken."""
        if self._stored_groups or self._parts:
            raise RuntimeError("the buffer holds groups already: restore carried groups into a fresh one")
        self._carried = None if state is None else dict(state["fields"])
        self._carried_groups = 0 if state is None else int(state["groups"])
        if self._carried is not None:
            self._fields = tuple(self._carried)
        self._taken = True

    def note_stale(self, num_groups: int) -> None:
        """Count groups dropped before `add` because their weights were too old (``num_groups_stale_dropped``)."""
        if self._taken:
            self._reset()
        self._stats["num_groups_stale_dropped"] += num_groups

    @property
    def is_full(self) -> bool:
        return self._stored_groups >= self.train_batch_size

    @property
    def stats(self) -> dict[str, int]:
        """Counts of the step: generation batches and groups generated / kept / all-correct /
        all-wrong / constant (``num_groups_kept`` counts every informative group, including
        those beyond ``train_batch_size`` that are discarded), and samples whose reward function
        failed (when `add` is told, else 0); with ``carry_over`` also the groups carried into the
        step from the last one and those `drop_stale` removed."""
        stats = dict(self._stats)
        if not self.carry_over:
            del stats["num_groups_carried"], stats["num_groups_stale_dropped"]
        return stats

    def add(
        self,
        batch: Mapping[str, Field],
        metric: Metric,
        group_ids: GroupIds,
        failures: Optional[Sequence[Optional[str]]] = None,
    ) -> GroupFilterResult:
        """Filter one generation batch and store its informative groups.

        Args:
            batch: fields indexed by sample along dim 0 (tensors or lists), all of the same length.
            metric: the per-sample filter metric (raw accuracy), one value per sample.
            group_ids: the group (prompt uid) of each sample; ids must not repeat across the
                generation batches of one step.
            failures: per sample, why its reward function failed (None where it scored). A failed
                sample counts as wrong, so a reward function that fails on everything makes every
                group "all wrong": the exhaustion error then names the failures, not the data.

        Returns:
            The `GroupFilterResult` of this batch.

        Raises:
            ValueError: a group does not have exactly ``n_samples_per_prompt`` samples, a group id
                was already stored in this step, or the fields disagree in length or names.
            DynamicSamplingExhausted: after this batch the train batch is still not full and
                ``max_num_gen_batches`` generation batches have been used.
        """
        if self._taken:
            self._reset()
        result = select_informative_groups(metric, group_ids, enabled=self.enabled)
        num_samples = result.group_index.numel()
        self._check_batch(batch, num_samples)
        self._check_group_sizes(result)

        stats = self._stats
        stats["num_gen_batches"] += 1
        stats["num_groups_generated"] += result.num_groups
        stats["num_groups_kept"] += result.num_kept
        stats["num_groups_all_correct"] += result.num_all_correct
        stats["num_groups_all_wrong"] += result.num_all_wrong
        stats["num_groups_constant"] += result.num_constant
        if failures is not None:
            if len(failures) != num_samples:
                raise ValueError(f"{len(failures)} reward failure entries for {num_samples} samples")
            failed = [reason for reason in failures if reason is not None]
            stats["num_samples_reward_failed"] += len(failed)
            if failed and self._first_reward_failure is None:
                self._first_reward_failure = str(failed[0])

        # Store whole groups, each contiguous, in order of first appearance; only as many as the
        # train batch still needs (the surplus would be discarded by `take` anyway), or all with carry_over.
        room = None if self.carry_over else self.train_batch_size - self._stored_groups
        kept_groups = result.group_kept.nonzero().flatten()[:room]
        if kept_groups.numel() > 0:
            repeated = set(result.group_ids[g] for g in kept_groups.tolist()) & self._seen_group_ids
            if repeated:
                raise ValueError(
                    f"group ids {sorted(map(str, repeated))[:5]} were already stored in this step; "
                    "every generation batch needs fresh uids or groups would merge"
                )
            self._seen_group_ids.update(result.group_ids[g] for g in kept_groups.tolist())
            # Stable sort of the samples by group rank keeps each group's samples in arrival order.
            rank = torch.full((result.num_groups,), -1, dtype=torch.long)
            rank[kept_groups] = torch.arange(kept_groups.numel())
            sample_rank = rank[result.group_index]
            selected = (sample_rank >= 0).nonzero().flatten()
            order = selected[torch.sort(sample_rank[selected], stable=True).indices]
            self._parts.append({name: _select(value, order, name) for name, value in batch.items()})
            self._stored_groups += kept_groups.numel()

        if (
            not self.is_full
            and self.max_num_gen_batches > 0
            and stats["num_gen_batches"] >= self.max_num_gen_batches
        ):
            raise DynamicSamplingExhausted(self._exhausted_message())
        return result

    def _exhausted_message(self) -> str:
        stats = self._stats
        found = (
            f"dynamic sampling found only {self._stored_groups}/{self.train_batch_size} prompt groups with "
            f"mixed accuracy after {stats['num_gen_batches']} generation batches "
            f"(algorithm.filter_groups.max_num_gen_batches={self.max_num_gen_batches}); of "
            f"{stats['num_groups_generated']} groups, {stats['num_groups_all_correct']} were all correct and "
            f"{stats['num_groups_all_wrong']} all wrong."
        )
        data = (
            "raise algorithm.filter_groups.max_num_gen_batches (0 = unlimited), raise trainer.gen_batch_size "
            "to generate more prompts per batch, or use a dataset of suitable difficulty."
        )
        failed, samples = stats["num_samples_reward_failed"], stats["num_groups_generated"] * self.n_samples_per_prompt
        if not failed:
            return f"{found} The data is too easy or too hard for the model: {data}"
        failures = (
            f"the reward function failed on {failed} of {samples} samples (first error: {self._first_reward_failure}); "
            "a failed sample gets reward.min_reward and counts as wrong"
        )
        if 2 * failed >= samples:  # at least half: the failures, not the data, emptied the batch
            return (
                f"{found} The cause is the reward function, not the data: {failures}. Fix the reward function "
                "(reward.custom_function.path), or raise reward.timeout_s if the failures are timeouts."
            )
        return f"{found} Also, {failures}. If the data is too easy or too hard for the model: {data}"

    def _check_batch(self, batch: Mapping[str, Field], num_samples: int) -> None:
        if not batch:
            raise ValueError("the generation batch has no fields")
        names = tuple(batch)
        if self._fields is not None and set(names) != set(self._fields):
            raise ValueError(f"batch fields changed between generation batches: {self._fields} vs {names}")
        for name, value in batch.items():
            if not isinstance(value, (torch.Tensor, list, tuple)):
                raise TypeError(f"batch field {name!r} must be a torch.Tensor or a list, got {type(value).__name__}")
            if isinstance(value, torch.Tensor) and value.dim() == 0:
                raise ValueError(f"batch field {name!r} is a 0-dim tensor; fields are indexed by sample along dim 0")
            length = len(value)
            if length != num_samples:
                raise ValueError(f"batch field {name!r} has {length} entries for {num_samples} samples")
        self._fields = self._fields or names

    def _check_group_sizes(self, result: GroupFilterResult) -> None:
        sizes = torch.zeros(result.num_groups, dtype=torch.long).index_add_(
            0, result.group_index, torch.ones_like(result.group_index)
        )
        wrong = (sizes != self.n_samples_per_prompt).nonzero().flatten().tolist()
        if wrong:
            examples = ", ".join(f"{result.group_ids[g]!r}: {int(sizes[g])}" for g in wrong[:5])
            raise ValueError(
                f"{len(wrong)} prompt groups do not have n_samples_per_prompt={self.n_samples_per_prompt} "
                f"responses (group: size) {examples}; every prompt must be sampled exactly n times"
            )

    def take(self) -> dict[str, Field]:
        """The train batch: exactly ``train_batch_size * n_samples_per_prompt`` samples.

        Whole groups only, groups in arrival order (first generation batch first, then order of
        first appearance within it), the samples of each group contiguous and in arrival order.
        Tensors from different generation batches are right-padded to a common shape.
        Resets the buffer for the next step (stats stay readable until the next `add`).

        Raises:
            RuntimeError: the buffer is not full yet.
        """
        if not self.is_full:
            raise RuntimeError(
                f"take() called with {self._stored_groups}/{self.train_batch_size} groups stored; "
                "add generation batches until is_full"
            )
        assert self._fields is not None
        out = {
            name: _concat([part[name] for part in self._parts], name, self.pad_values.get(name, 0))
            for name in self._fields
        }
        surplus = self._stored_groups - self.train_batch_size
        if surplus > 0:  # carry_over: the groups after the train batch wait for the next step
            cut = self.train_batch_size * self.n_samples_per_prompt
            total = cut + surplus * self.n_samples_per_prompt
            self._carried = {name: _select(value, torch.arange(cut, total), name) for name, value in out.items()}
            self._carried_groups = surplus
            out = {name: _select(value, torch.arange(cut), name) for name, value in out.items()}
        stats = self._stats
        self._parts, self._stored_groups = [], 0
        self._stats = stats
        self._taken = True
        return out

    def drop_stale(self, name: str, oldest: int) -> int:
        """Start the next step by dropping the stored groups whose samples' field `name` (their weight
        version) is below `oldest`; returns how many groups went (counted in ``num_groups_stale_dropped``).
        Every sample of a group has the same value (a group comes from one generation request)."""
        if self._taken:
            self._reset()
        dropped = 0
        kept_parts = []
        for part in self._parts:
            values = torch.as_tensor(list(part[name]) if not isinstance(part[name], torch.Tensor) else part[name])
            keep = (values >= oldest).nonzero().flatten()
            gone = values.numel() - keep.numel()
            if gone % self.n_samples_per_prompt:
                raise ValueError(f"a prompt group's samples differ in {name!r}: groups must come whole from one request")
            dropped += gone // self.n_samples_per_prompt
            if keep.numel():
                kept_parts.append({field: _select(value, keep, field) for field, value in part.items()})
        self._parts = kept_parts
        self._stored_groups -= dropped
        self._stats["num_groups_carried"] -= dropped
        self._stats["num_groups_stale_dropped"] += dropped
        return dropped
