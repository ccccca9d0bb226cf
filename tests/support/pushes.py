"""A scripted `WeightPushes` for engine tests of partial rollouts (pushes landing between decode steps).

    pushes = ScriptedPushes([(3, new_weights)])      # due once `pending()` was asked 3 times
    out = engine.generate(prompts, params, pushes=pushes)
    pushes.landed        # [(polls when it landed, version it brought)]
    BrokenPushes(weights, after_polls=3, raises=True)   # a push that fails halfway (or never commits)
    out.weight_versions  # per response: ((0, 0), (k, 1)): tokens from k on sampled with version 1

Each push is due once `pending()` has been asked `after_polls` times in all (counted over the
whole object); `receive` hands the weights to `load` in two buckets (a push of several buckets, as
the bridge sends them), calls `commit()` once and counts the version up by one.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch

from megatron_dapo.rollout.base import WeightPushes


class ScriptedPushes(WeightPushes):
    def __init__(self, pushes: Sequence[tuple[int, Sequence[tuple[str, torch.Tensor]]]], start_version: int = 0) -> None:
        self._due = [(int(after), list(weights)) for after, weights in pushes]
        self._version = int(start_version)
        self.polls = 0
        self.landed: list[tuple[int, int]] = []
        """(polls asked when the push was received, the version it brought), in order."""
        self.loaded_buckets = 0

    @property
    def version(self) -> int:
        return self._version

    def pending(self) -> bool:
        self.polls += 1
        return bool(self._due) and self.polls >= self._due[0][0]

    def receive(self, load: Callable[[list[tuple[str, torch.Tensor]]], None], commit: Callable[[], None]) -> int:
        if not self._due:
            raise AssertionError("receive() without a pending push")
        _, weights = self._due.pop(0)
        half = max(1, len(weights) // 2)
        for bucket in (weights[:half], weights[half:]):
            if bucket:
                load(list(bucket))
                self.loaded_buckets += 1
        commit()
        self._version += 1
        self.landed.append((self.polls, self._version))
        return self._version

    @property
    def exhausted(self) -> bool:
        """Every scripted push landed."""
        return not self._due


class BrokenPushes(WeightPushes):
    """A push that breaks (due once `pending()` was asked `after_polls` times): with `raises` it
    loads half of the tensors and raises ConnectionError, else it loads every tensor and never
    commits."""

    def __init__(self, weights, after_polls: int, raises: bool) -> None:
        self._weights, self._after, self._raises, self.polls = list(weights), after_polls, raises, 0

    @property
    def version(self) -> int:
        return 0

    def pending(self) -> bool:
        self.polls += 1
        return self.polls >= self._after

    def receive(self, load, commit) -> int:
        if not self._raises:
            load(self._weights)
            return 1
        load(self._weights[: len(self._weights) // 2])
        raise ConnectionError("the trainer went away in the middle of a push")


class TwoCheckpoints:
    """An engine under test, two checkpoints A and B of one architecture (their tensors and HF
    references) and which one the engine holds: a push brings it the other's weights."""

    def __init__(self, engine, weights: dict, reference: dict) -> None:
        self.engine, self.weights, self.reference = engine, weights, reference
        self.holds = "A"

    def other(self) -> str:
        return "B" if self.holds == "A" else "A"

    def push_of(self, name: str) -> list[tuple[str, torch.Tensor]]:
        return sorted(self.weights[name].items())


def errors_around_the_push(out, prompts, log_probs_of, old: str, new: str) -> tuple[float, float, list[float]]:
    """(largest |engine - reference| of the tokens before each response's push, of those after it,
    and per response a push landed in how far the two references lie apart after it): the reference
    is `log_probs_of(checkpoint, prompt, response)`, `old`'s before the push and `new`'s after."""
    before = after = 0.0
    apart = []
    for index, response, log_probs, spans in zip(out.prompt_index, out.response_ids, out.log_probs, out.weight_versions):
        cut = spans[1][0] if len(spans) == 2 else len(response)
        with_old = log_probs_of(old, prompts[index], response)
        before = max(before, (log_probs[:cut] - with_old[:cut]).abs().max().item())
        if cut < len(response):
            with_new = log_probs_of(new, prompts[index], response)
            after = max(after, (log_probs[cut:] - with_new[cut:]).abs().max().item())
            apart.append((with_new[cut:] - with_old[cut:]).abs().max().item())
    return before, after, apart
