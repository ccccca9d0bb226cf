"""vLLM's sampling parameters and outputs in the `RolloutEngine` terms (pure: no vLLM import).

Log-probs. `SamplingParams.logprobs` asks vLLM for the sampled token's log-prob only (`logprobs=0`);
the engine runs in `logprobs_mode="processed_logprobs"`: the log-prob under the temperature-scaled
distribution, which is what the actor recomputes (`log_softmax(logits / T)`), and identical to it
when no top-k / top-p filtering is active (DAPO's training setting). With top-k / top-p active, vLLM
renormalises over the kept tokens. Greedy decoding (T = 0) reports `log_softmax(logits)`.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import torch

from megatron_dapo.rollout.base import GenerationOutput, SamplingParams

FINISH_LENGTH = "length"

def vllm_sampling_kwargs(params: SamplingParams, prompt_index: int) -> dict[str, Any]:
    """Keyword arguments of `vllm.SamplingParams` for one prompt.

    A seeded call gives prompt i the seed `seed + i`, so that prompts do not share one random
    stream while the whole call stays reproducible; the n samples of a prompt draw one after the
    other from that prompt's generator.
    """
    return dict(
        n=params.n,
        temperature=params.temperature,
        top_p=params.top_p,
        top_k=0 if params.top_k == -1 else params.top_k,  # vLLM: 0 disables top-k
        max_tokens=params.max_new_tokens,
        stop_token_ids=list(params.stop_token_ids),
        stop=list(params.stop),
        include_stop_str_in_output=True,  # responses keep what stopped them, like EOS
        seed=None if params.seed is None else params.seed + prompt_index,
        logprobs=0 if params.logprobs else None,  # 0: only the sampled token's log-prob
        detokenize=bool(params.stop),  # text is needed only to match stop strings
    )


def collect_outputs(
    request_outputs: Sequence[Any], prompt_ids: Sequence[Sequence[int]], params: SamplingParams
) -> GenerationOutput:
    """Turn vLLM's `RequestOutput`s (one per prompt, in prompt order) into a prompt-major output."""
    if len(request_outputs) != len(prompt_ids):
        raise RuntimeError(f"vLLM returned {len(request_outputs)} outputs for {len(prompt_ids)} prompts")
    prompt_index: list[int] = []
    response_ids: list[list[int]] = []
    finish_reasons: list[str] = []
    log_probs: list[torch.Tensor] = []
    for index, (request, prompt) in enumerate(zip(request_outputs, prompt_ids)):
        if list(request.prompt_token_ids) != [int(token) for token in prompt]:
            raise RuntimeError(f"vLLM output {index} belongs to another prompt (outputs out of order)")
        completions = sorted(request.outputs, key=lambda completion: completion.index)
        if len(completions) != params.n:
            raise RuntimeError(f"vLLM returned {len(completions)} samples for prompt {index}, asked {params.n}")
        for completion in completions:
            tokens = [int(token) for token in completion.token_ids]
            prompt_index.append(index)
            response_ids.append(tokens)
            finish_reasons.append(str(completion.finish_reason))
            if params.logprobs:
                log_probs.append(sampled_token_log_probs(tokens, completion.logprobs))
    return GenerationOutput(
        prompt_index=prompt_index,
        response_ids=response_ids,
        truncated=torch.tensor([reason == FINISH_LENGTH for reason in finish_reasons], dtype=torch.bool),
        log_probs=log_probs if params.logprobs else None,
        finish_reasons=finish_reasons,
    )


def sampled_token_log_probs(tokens: Sequence[int], position_log_probs: Optional[Sequence[Any]]) -> torch.Tensor:
    """The log-prob of each sampled token, from vLLM's per-position {token_id: Logprob} mappings."""
    if position_log_probs is None or len(position_log_probs) != len(tokens):
        got = None if position_log_probs is None else len(position_log_probs)
        raise RuntimeError(f"vLLM returned log-probs for {got} positions of a {len(tokens)}-token response")
    values = []
    for position, token in enumerate(tokens):
        entry = position_log_probs[position]
        if entry is None or token not in entry:
            raise RuntimeError(f"vLLM returned no log-prob for the sampled token {token} at position {position}")
        values.append(float(entry[token].logprob))
    return torch.tensor(values, dtype=torch.float32)
