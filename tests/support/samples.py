"""Random rollout `Samples` (every field filled, empty responses included) and their
JSON-comparable form: the samples tests and the gather workers compare them exactly."""

from __future__ import annotations

import torch


def make_samples(seed: int, num_prompts: int, n: int):
    from megatron_dapo.trainer.samples import Samples

    gen = torch.Generator().manual_seed(seed)
    uids, prompts, responses, log_probs = [], [], [], []
    for p in range(num_prompts):
        prompt = torch.randint(0, 50_000, (int(torch.randint(1, 9, (1,), generator=gen)),), generator=gen)
        for _ in range(n):
            length = int(torch.randint(0, 12, (1,), generator=gen))  # empty responses too
            uids.append(f"r{seed}p{p}")
            prompts.append(prompt)
            responses.append(torch.randint(0, 150_000, (length,), generator=gen))
            log_probs.append(-torch.rand(length, generator=gen, dtype=torch.float32) * 7)
    count = len(uids)
    return Samples(
        uid=uids, prompt_ids=prompts, response_ids=responses, rollout_log_probs=log_probs,
        truncated=[i % 3 == 0 for i in range(count)], score=[float(i % 2) - 0.25 for i in range(count)],
        task_score=[float(i % 2) for i in range(count)],
        acc=[i % 2 == 1 for i in range(count)], pred=[None if i % 4 else f"{i}/7" for i in range(count)],
        overlong_penalty=[-0.25 * (i % 3 == 0) for i in range(count)], data_source=["math"] * count,
        reward_error=[None if i % 5 else "ValueError: boom" for i in range(count)],
    )  # fmt: skip


def as_plain(samples) -> dict:
    """JSON-comparable fields; floats of the log-probs as their exact float32 bit patterns."""
    plain = {}
    for name, values in samples.as_fields().items():
        if name == "rollout_log_probs":
            plain[name] = [v.contiguous().view(torch.int32).tolist() for v in values]
        elif name in ("prompt_ids", "response_ids"):
            plain[name] = [[int(x) for x in v] for v in values]
        else:
            plain[name] = list(values)
    return plain
