"""vLLM's sampling parameters and outputs in the `RolloutEngine` terms (pure: no vLLM import).

Log-probs. `SamplingParams.logprobs` asks vLLM for the sampled token's log-prob only (`logprobs=0`);
the engine runs in `logprobs_mode="processed_logprobs"`: the log-prob under the temperature-scaled
distribution, which is what the actor recomputes (`log_softmax(logits / T)`), and identical to it
when no top-k / top-p filtering is active (DAPO's training setting). With top-k / top-p active, vLLM
renormalises over the kept tokens. Greedy decoding (T = 0) reports `log_softmax(logits)`. They come
back flat (`flat_logprobs=True`: vLLM's `FlatLogprobs`, one list of values for the whole response)
and are read without a Python step per token; the per-position {token_id: Logprob} mappings of
older vLLM releases are read too.

Routed experts (`SamplingParams.return_routed_experts`, rollout routing replay): an engine started
with `enable_return_routed_experts` puts `CompletionOutput.routed_experts`, a numpy array
``[tokens, MoE layers, top-k]`` of every token it forwarded (prompt from
`routed_experts_prompt_start`, default 0, then the response but its last token), on each finished
completion. vLLM computes it in its V2 model runner, which its CPU build does not run.
"""

from __future__ import annotations

import array
from typing import Any, Optional, Sequence

import torch

from megatron_dapo.rollout.base import GenerationOutput, SamplingParams

FINISH_LENGTH = "length"

def vllm_sampling_kwargs(params: SamplingParams, prompt_index: int) -> dict[str, Any]:
    """Keyword arguments of `vllm.SamplingParams` for one prompt.

    With `params.seed_per_prompt`, a seeded call gives prompt i the seed `seed + i * n`: vLLM gives
    the j-th of a request's n samples the seed `seed + j` (`v1/engine/parallel_sampling.py`), so
    every sample of the call has its own random stream and the whole call stays reproducible.
    Otherwise requests carry no seed: the engine seeds its sampler once for the call
    (`VLLMEngine.generate`).
    """
    per_prompt = params.seed is not None and params.seed_per_prompt
    return dict(
        n=params.n,
        temperature=params.temperature,
        top_p=params.top_p,
        top_k=0 if params.top_k == -1 else params.top_k,  # vLLM: 0 disables top-k
        max_tokens=params.max_new_tokens,
        stop_token_ids=list(params.stop_token_ids),
        stop=list(params.stop),
        include_stop_str_in_output=True,  # responses keep what stopped them, like EOS
        seed=params.seed + prompt_index * params.n if per_prompt else None,
        logprobs=0 if params.logprobs else None,  # 0: only the sampled token's log-prob
        flat_logprobs=True,  # one flat list per response instead of a dict per token
        detokenize=bool(params.stop),  # text is needed only to match stop strings
    )


def collect_outputs(
    request_outputs: Sequence[Any], prompt_ids: Sequence[Sequence[int]], params: SamplingParams
) -> GenerationOutput:
    """Turn vLLM's `RequestOutput`s (one per prompt, in prompt order) into a prompt-major output.

    `prompt_ids` are the token ids as sent (lists of int).
    """
    if len(request_outputs) != len(prompt_ids):
        raise RuntimeError(f"vLLM returned {len(request_outputs)} outputs for {len(prompt_ids)} prompts")
    prompt_index: list[int] = []
    response_ids: list[list[int]] = []
    finish_reasons: list[str] = []
    log_probs: list[torch.Tensor] = []
    routed: list[torch.Tensor] = []
    for index, (request, prompt) in enumerate(zip(request_outputs, prompt_ids)):
        if list(request.prompt_token_ids) != list(prompt):
            raise RuntimeError(f"vLLM output {index} belongs to another prompt (outputs out of order)")
        completions = sorted(request.outputs, key=lambda completion: completion.index)
        if len(completions) != params.n:
            raise RuntimeError(f"vLLM returned {len(completions)} samples for prompt {index}, asked {params.n}")
        for completion in completions:
            tokens = _as_list(completion.token_ids)  # Python ints already (vLLM builds them with tolist())
            prompt_index.append(index)
            response_ids.append(tokens)
            finish_reasons.append(str(completion.finish_reason))
            if params.logprobs:
                log_probs.append(sampled_token_log_probs(tokens, completion.logprobs))
            if params.return_routed_experts:
                routed.append(routed_experts_of(completion, len(prompt) + len(tokens) - 1))
    return GenerationOutput(
        prompt_index=prompt_index,
        response_ids=response_ids,
        truncated=torch.tensor([reason == FINISH_LENGTH for reason in finish_reasons], dtype=torch.bool),
        log_probs=log_probs if params.logprobs else None,
        finish_reasons=finish_reasons,
        routed_experts=routed if params.return_routed_experts else None,
    )


def routed_experts_of(completion: Any, read: int) -> torch.Tensor:
    """int32 ``[read, layers, top-k]``: a completion's routed experts for the ``read`` tokens the
    model read (prompt + response - 1)."""
    values = getattr(completion, "routed_experts", None)
    if values is None:
        raise RuntimeError(
            "vLLM returned no routed experts: start the engine with enable_return_routed_experts "
            "(rollout routing replay needs vLLM's V2 model runner, on GPUs)"
        )
    routing = torch.as_tensor(values).to(torch.int32)
    if routing.dim() != 3 or routing.shape[0] < read:
        raise RuntimeError(f"vLLM returned routed experts of shape {tuple(routing.shape)} for a sequence of {read} read tokens")
    return routing[:read]


def sampled_token_log_probs(tokens: Sequence[int], position_log_probs: Optional[Sequence[Any]]) -> torch.Tensor:
    """The log-prob of each sampled token, from vLLM's `FlatLogprobs` or per-position {token_id: Logprob}."""
    if position_log_probs is None or len(position_log_probs) != len(tokens):
        got = None if position_log_probs is None else len(position_log_probs)
        raise RuntimeError(f"vLLM returned log-probs for {got} positions of a {len(tokens)}-token response")
    if hasattr(position_log_probs, "start_indices"):
        return _flat_sampled_token_log_probs(tokens, position_log_probs)
    values = []
    for position, token in enumerate(tokens):
        entry = position_log_probs[position]
        if entry is None or token not in entry:
            raise RuntimeError(f"vLLM returned no log-prob for the sampled token {token} at position {position}")
        values.append(float(entry[token].logprob))
    return torch.tensor(values, dtype=torch.float32)


def _flat_sampled_token_log_probs(tokens: Sequence[int], flat: Any) -> torch.Tensor:
    """`sampled_token_log_probs` for vLLM's FlatLogprobs: each position's entries start with the
    sampled token's (vLLM's sampler puts it first), so the values at `start_indices` are the answer."""
    if len(flat.logprobs) == len(tokens):  # logprobs=0: exactly the sampled token at every position
        if _as_list(flat.token_ids) != _as_list(tokens):
            raise RuntimeError(f"vLLM returned log-probs of other tokens than the {len(tokens)} sampled ones")
        return _float32_tensor(flat.logprobs)
    starts = torch.tensor(flat.start_indices, dtype=torch.long)
    ends = torch.tensor(flat.end_indices, dtype=torch.long)
    if bool((ends <= starts).any()):
        raise RuntimeError("vLLM returned no log-prob for a sampled token (an empty position)")
    first_tokens = torch.tensor(flat.token_ids, dtype=torch.long)[starts]
    if not torch.equal(first_tokens, torch.tensor(list(tokens), dtype=torch.long)):
        raise RuntimeError(f"vLLM returned log-probs of other tokens than the {len(tokens)} sampled ones")
    return _float32_tensor(flat.logprobs)[starts]


def _as_list(values: Sequence[int]) -> list[int]:
    return values if isinstance(values, list) else list(values)


def _float32_tensor(values: Sequence[float]) -> torch.Tensor:
    """float32 tensor of Python floats, through an array (about 3x faster than torch.tensor(list))."""
    if not values:
        return torch.empty(0, dtype=torch.float32)
    return torch.frombuffer(array.array("f", values), dtype=torch.float32)
