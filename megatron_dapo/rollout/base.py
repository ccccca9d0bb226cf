"""The rollout engine interface: what the trainer needs from any generator, and nothing more.

Every engine (embedded HF, vLLM, SGLang) implements `RolloutEngine`. Outputs are ordered
prompt-major: the n responses of prompt 0, then the n responses of prompt 1, and so on, so the
trainer can form groups without bookkeeping. Truncation comes from the engine's own finish reason
(or the token count reaching `max_new_tokens`), never from decoded text.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass, field
from typing import Callable, Iterable, Optional, Sequence

import torch


ENGINE_MEMORY_TAGS = ("weights", "kv_cache")
"""What `RolloutEngine.wake_up(tags)` can bring back separately."""


def check_memory_tags(tags: Optional[Sequence[str]]) -> tuple[str, ...]:
    """The tags `wake_up(tags)` names (None = all), checked against `ENGINE_MEMORY_TAGS`."""
    if tags is None:
        return ENGINE_MEMORY_TAGS
    if isinstance(tags, str):
        raise TypeError(f"wake_up takes a sequence of tags, e.g. [{tags!r}], not a string")
    unknown = [tag for tag in tags if tag not in ENGINE_MEMORY_TAGS]
    if unknown:
        raise ValueError(f"unknown memory tags {unknown}; use {list(ENGINE_MEMORY_TAGS)} or None (all)")
    return tuple(dict.fromkeys(tags))


class GenerationCalledOff(RuntimeError):
    """A `generate` left before its batch was done because its `call_off` predicate turned true
    (`VLLMEngine.generate` in the spmd placement: the engine's TP group agreed to stop, every rank
    of it raises this). The engine aborted the batch's requests and is ready for the next call; the
    batch's results are lost."""


@dataclass(frozen=True)
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    """-1 disables top-k."""
    max_new_tokens: int = 256
    stop_token_ids: tuple[int, ...] = ()
    """Tokens that end a response besides the tokenizer's EOS (the stop token is kept in the response)."""
    stop: tuple[str, ...] = ()
    """Stop strings (engines that support them; the embedded engine checks decoded text only to stop, not to truncate)."""
    seed: Optional[int] = None
    """Same seed, same prompts, same weights -> same responses (per engine)."""
    seed_per_prompt: bool = True
    """How a seed reaches the engine's sampler. True: each prompt gets its own random streams
    (derived from the seed and the prompt's index), so its responses do not depend on what else is
    in the batch or how the engine schedules it - reproducible anywhere, at a price in vLLM (a
    per-request generator path at every decode step). False: the seed reseeds the engine's sampler
    once per call and all requests draw from it in one batched step - reproducible where the
    engine schedules deterministically (vLLM's spmd placement). The trainer uses False for training
    (`rollout.seed_per_prompt`) and True for validation. The embedded engine always seeds once per
    call and SGLang per sample (its seeded sampling is batched): both ignore this."""
    logprobs: bool = True
    """Return the engine's log-prob of each sampled token (under the sampling temperature)."""
    return_routed_experts: bool = False
    """Mixture-of-experts models: return the experts each MoE layer routed every token to
    (`GenerationOutput.routed_experts`), for rollout routing replay (`actor.router_replay: r3`)."""

    def __post_init__(self) -> None:
        if self.n < 1:
            raise ValueError(f"n must be >= 1, got {self.n}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k != -1 and self.top_k < 1:
            raise ValueError(f"top_k must be -1 (off) or >= 1, got {self.top_k}")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")


@dataclass
class GenerationOutput:
    """Responses of one `generate` call, prompt-major (len = num_prompts * n)."""

    prompt_index: list[int]
    """Index of each response's prompt in the `prompt_ids` given to `generate`."""
    response_ids: list[list[int]]
    """Token ids of each response, EOS / stop token included when it ended that way."""
    truncated: torch.Tensor
    """bool [num_responses]: stopped by `max_new_tokens` (finish reason "length")."""
    log_probs: Optional[list[torch.Tensor]] = None
    """float32 per response, one value per response token: the engine's log-prob of the sampled token."""
    finish_reasons: list[str] = field(default_factory=list)
    routed_experts: Optional[list[torch.Tensor]] = None
    """int32 ``[prompt + response - 1, MoE layers, top-k]`` per response when asked
    (`SamplingParams.return_routed_experts`): the experts of every token the model read, prompt
    first; the last response token is never read. Expert order within a token is the engine's."""

    weight_versions: Optional[list["VersionSpans"]] = None
    """Where the weights changed during the call (`generate(..., pushes=)`): per response, the
    weight version of each run of its tokens (`VersionSpans`). None where no push could land."""

    @property
    def response_lengths(self) -> torch.Tensor:
        return torch.tensor([len(ids) for ids in self.response_ids], dtype=torch.long)

    def __len__(self) -> int:
        return len(self.response_ids)


VersionSpans = tuple[tuple[int, int], ...]
"""One response's weight versions: ((first token, version), ...), the first token of each run of
tokens sampled with one version, ascending, the first run starting at token 0."""


def version_spans(start_version: int, pushes: Sequence[tuple[int, int]], length: int) -> VersionSpans:
    """A response's `VersionSpans` from the version it started with and the pushes that landed while
    the engine generated it: (tokens the response had when the push landed, the version it brought),
    in the order they landed. A push that landed once the response was done (at `length` tokens or
    more) changed none of its tokens; of pushes that landed at the same count the last one counts. Pure."""
    spans = [(0, int(start_version))]
    for count, version in pushes:
        if count < 0:
            raise ValueError(f"a push landed at {count} tokens")
        if count >= length:
            continue
        if count < spans[-1][0]:
            raise ValueError(f"pushes out of order: one at {count} tokens after one at {spans[-1][0]}")
        if count == spans[-1][0]:
            spans[-1] = (count, int(version))
        else:
            spans.append((count, int(version)))
    return tuple(spans)


def oldest_version(spans: VersionSpans) -> int:
    """The oldest weight version any token of a response was sampled with."""
    return min(version for _, version in spans)


class WeightPushes(abc.ABC):
    """Weight pushes that may arrive while an engine generates (partial rollouts,
    `rollout.partial_rollouts`): an engine that `takes_pushes_while_generating` asks `pending()`
    between decode steps; when it answers True the engine stops decoding (no forward pass runs, the
    tokens of every sequence so far are fixed), lets `receive` load the push, and carries on, the
    sequences in flight continuing with the new weights. Each response's tokens are attributed to
    the version they were sampled with (`GenerationOutput.weight_versions`)."""

    @property
    @abc.abstractmethod
    def version(self) -> int:
        """The weight version the engine holds now."""

    @abc.abstractmethod
    def pending(self) -> bool:
        """Whether a push waits to be received; cheap (asked every few decode steps), never blocks."""

    @abc.abstractmethod
    def receive(self, load: Callable[[list[tuple[str, torch.Tensor]]], None], commit: Callable[[], None]) -> int:
        """Receive the waiting push: `load` every bucket of (HF name, full tensor) in turn, then
        `commit()` once (the engine's post-load step; it also drops every cached prefix computed
        with older weights), then tell the sender the engine is ready. Returns the new version."""


class RolloutEngine(abc.ABC):
    """A generator that the actor's weights are pushed into after every update."""

    takes_pushes_while_generating: bool = False
    """Whether `generate` accepts `pushes=` (a `WeightPushes`) and loads them between decode steps."""

    @abc.abstractmethod
    def generate(self, prompt_ids: Sequence[Sequence[int]], params: SamplingParams) -> GenerationOutput:
        """Sample `params.n` responses for each prompt (token ids, no padding). An engine that
        `takes_pushes_while_generating` also takes `pushes: Optional[WeightPushes] = None`."""

    @abc.abstractmethod
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Replace the engine's weights in place with HF-named full tensors (streamed, any order)."""

    def sleep(self, level: int = 1) -> None:
        """Free accelerator memory while the actor trains; no-op where unsupported.

        Level 1 frees the KV cache and keeps the weights' values (in host memory); level 2 also
        discards the weights, so the next weight push must be complete (the trainer's always is).
        """

    def wake_up(self, tags: Optional[Sequence[str]] = None) -> None:
        """Restore what `sleep` freed: the memory of `tags` (`ENGINE_MEMORY_TAGS`), None = all of it.

        The trainer wakes "weights" first, pushes the new weights, then wakes "kv_cache", so the
        KV cache is not allocated while the weight buckets travel.
        """

    def shutdown(self) -> None:
        """Release processes and memory; the engine is unusable afterwards."""

    def named_weights(self) -> Iterable[tuple[str, torch.Tensor]]:
        """The engine's current weights as HF-named full tensors (for sync checks); optional."""
        raise NotImplementedError(f"{type(self).__name__} cannot list its weights")

    def __enter__(self) -> "RolloutEngine":
        return self

    def __exit__(self, *exc_info) -> None:
        self.shutdown()
