"""The rollout engine interface: what the trainer needs from any generator, and nothing more.

Every engine (embedded HF, vLLM, SGLang) implements `RolloutEngine`. Outputs are ordered
prompt-major: the n responses of prompt 0, then the n responses of prompt 1, and so on, so the
trainer can form groups without bookkeeping. Truncation comes from the engine's own finish reason
(or the token count reaching `max_new_tokens`), never from decoded text.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass, field
from typing import Iterable, Optional, Sequence

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

    @property
    def response_lengths(self) -> torch.Tensor:
        return torch.tensor([len(ids) for ids in self.response_ids], dtype=torch.long)

    def __len__(self) -> int:
        return len(self.response_ids)


class RolloutEngine(abc.ABC):
    """A generator that the actor's weights are pushed into after every update."""

    @abc.abstractmethod
    def generate(self, prompt_ids: Sequence[Sequence[int]], params: SamplingParams) -> GenerationOutput:
        """Sample `params.n` responses for each prompt (token ids, no padding)."""

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
