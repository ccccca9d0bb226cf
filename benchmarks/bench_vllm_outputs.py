"""Reading vLLM's generation outputs: per-token Python loop (before) vs flat log-probs (now).

`VLLMEngine.generate` turns vLLM's `RequestOutput`s into a `GenerationOutput` (token ids, the sampled
tokens' log-probs, finish reasons). Before, every rank of an SPMD engine did so, reading each token's
log-prob from a per-position {token_id: Logprob} dict (`int()` per token id, one dict lookup and one
`float()` per token). Now only the rank whose results are kept converts, and vLLM hands the log-probs
flat (`flat_logprobs=True`: one list per response), read without a per-token Python step.

Both sides get the same synthetic outputs, built with vLLM's own `Logprob` / `FlatLogprobs` classes:
`--prompts` prompts x `--n` responses, lengths uniform in [len/2, len]. Timed: the conversion alone
(median over `--repeats` rounds, the two sides alternating after a warm-up), and the check that both
give the same tokens and log-probs.

    python benchmarks/bench_vllm_outputs.py [--prompts 32 --n 16 --length 1024 --repeats 5]
"""

from __future__ import annotations

import argparse
import platform
import random
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron_dapo.rollout.base import GenerationOutput, SamplingParams  # noqa: E402
from megatron_dapo.rollout.engines.vllm.io import collect_outputs  # noqa: E402


def before(request_outputs, prompt_ids, params: SamplingParams) -> GenerationOutput:
    """The conversion as it was (per-token loop over per-position dicts)."""
    prompt_index, response_ids, finish_reasons, log_probs = [], [], [], []
    for index, (request, prompt) in enumerate(zip(request_outputs, prompt_ids)):
        if list(request.prompt_token_ids) != [int(token) for token in prompt]:
            raise RuntimeError("out of order")
        for completion in sorted(request.outputs, key=lambda c: c.index):
            tokens = [int(token) for token in completion.token_ids]
            prompt_index.append(index)
            response_ids.append(tokens)
            finish_reasons.append(str(completion.finish_reason))
            values = []
            for position, token in enumerate(tokens):
                entry = completion.logprobs[position]
                if entry is None or token not in entry:
                    raise RuntimeError("missing")
                values.append(float(entry[token].logprob))
            log_probs.append(torch.tensor(values, dtype=torch.float32))
    return GenerationOutput(
        prompt_index=prompt_index,
        response_ids=response_ids,
        truncated=torch.tensor([r == "length" for r in finish_reasons], dtype=torch.bool),
        log_probs=log_probs,
        finish_reasons=finish_reasons,
    )


def synthetic(prompts: int, n: int, length: int, flat: bool, seed: int = 0):
    from vllm.logprobs import FlatLogprobs, Logprob

    rng = random.Random(seed)
    outputs, prompt_ids = [], []
    for p in range(prompts):
        prompt = [rng.randrange(1000) for _ in range(64)]
        completions = []
        for j in range(n):
            size = rng.randint(length // 2, length)
            tokens = [rng.randrange(150_000) for _ in range(size)]
            values = [-rng.random() * 5 for _ in range(size)]
            if flat:
                logprobs = FlatLogprobs(
                    start_indices=list(range(size)), end_indices=list(range(1, size + 1)), token_ids=list(tokens),
                    logprobs=values, ranks=[1] * size, decoded_tokens=[None] * size,
                )  # fmt: skip
            else:
                logprobs = [{t: Logprob(v, 1, None)} for t, v in zip(tokens, values)]
            completions.append(SimpleNamespace(index=j, token_ids=tokens, logprobs=logprobs, finish_reason="stop"))
        outputs.append(SimpleNamespace(prompt_token_ids=prompt, outputs=completions))
        prompt_ids.append(prompt)
    return outputs, prompt_ids


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--n", type=int, default=16)
    parser.add_argument("--length", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    params = SamplingParams(n=args.n)
    per_position, prompt_ids = synthetic(args.prompts, args.n, args.length, flat=False)
    flat, _ = synthetic(args.prompts, args.n, args.length, flat=True)
    a, b = before(per_position, prompt_ids, params), collect_outputs(flat, prompt_ids, params)
    assert a.response_ids == b.response_ids and all(torch.equal(x, y) for x, y in zip(a.log_probs, b.log_probs))
    tokens = sum(len(r) for r in a.response_ids)
    times: dict[str, list[float]] = {"before": [], "now": []}
    for _ in range(args.repeats):
        sides = (("before", lambda: before(per_position, prompt_ids, params)), ("now", lambda: collect_outputs(flat, prompt_ids, params)))
        for name, run in sides:
            started = time.perf_counter()
            run()
            times[name].append(time.perf_counter() - started)
    machine = platform.processor() or platform.machine()
    print(f"{args.prompts} prompts x {args.n} responses, {tokens:,} response tokens; {machine}, torch {torch.__version__}")
    for name, values in times.items():
        median = statistics.median(values)
        print(f"{name:>6}: median {median:.4f} s (min {min(values):.4f}, max {max(values):.4f}), {tokens / median / 1e6:.2f} M tokens/s")
    print(f"speed-up: {statistics.median(times['before']) / statistics.median(times['now']):.1f}x")


if __name__ == "__main__":
    main()
