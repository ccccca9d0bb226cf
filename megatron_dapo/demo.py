"""`megatron-dapo demo`: the DAPO algorithm core, end to end, on the synthetic arithmetic task.

What runs for real: the demo tokenizer (trained here), the DAPO prompt template, the rule-based
math reward and the overlong penalty in the reward manager's process pool, dynamic sampling over
successive generation batches, group-normalised advantages, the clip-higher policy loss with the
exact token-mean, and its gradient.

What is scripted: the responses. There is no model in this command yet: a seeded "policy" writes
each response as a correct worked solution, a wrong one, one without an `Answer:` line, or a
rambling one cut at the maximum length, with a per-prompt skill so that some groups are all
correct, some all wrong and some mixed - the situations dynamic sampling exists for. The
"log-probs" fed to the loss are likewise synthetic (current = old + noise). The demo says so in
its output. The trainer replaces all of this with generation by the rollout engine and log-probs
from the Megatron actor.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import time
from pathlib import Path

DEFAULT_CONFIG = Path(__file__).resolve().parents[1] / "configs" / "tiny_cpu.yaml"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", default=str(DEFAULT_CONFIG), help="YAML config (default: configs/tiny_cpu.yaml)")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. rollout.n=4")
    parser.add_argument("--steps", type=int, default=3, help="optimizer steps to walk through (default 3)")


def _scripted_response(problem, rng: random.Random, skill: float, max_chars: int) -> tuple[str, str]:
    """One response of the scripted policy and its kind."""
    from megatron_dapo.data.arithmetic import worked_solution

    roll = rng.random()
    if roll < skill:
        return worked_solution(problem), "correct"
    kind = rng.choice(["wrong", "wrong", "no-answer-line", "rambling"])
    if kind == "wrong":
        wrong = int(problem.answer) + rng.choice([-10, -1, 1, 2, 10])
        return f"{problem.a} {problem.op} {problem.b} = {wrong}\nAnswer: {wrong}", kind
    if kind == "no-answer-line":
        return f"{problem.a} {problem.op} {problem.b} is {problem.answer}", kind
    return ("Let me think. " * 200)[:max_chars], kind


def run(args: argparse.Namespace) -> int:
    import torch

    from megatron_dapo.algorithm.advantage import grpo_advantages, token_advantages
    from megatron_dapo.algorithm.loss import aggregate, count_tokens_and_seqs, policy_loss
    from megatron_dapo.algorithm.sampling import DynamicSamplingBuffer
    from megatron_dapo.config import load_config
    from megatron_dapo.data.arithmetic import build_tokenizer, make_problems
    from megatron_dapo.reward.manager import RewardManager

    cfg = load_config(args.config, args.overrides)
    r, a, t = cfg.rollout, cfg.algorithm, cfg.trainer
    print("megatron-dapo demo: the DAPO algorithm core on the synthetic arithmetic task.")
    print("NOTE: responses and log-probs are SCRIPTED (no model yet); reward, dynamic sampling,")
    print("advantages, loss and gradient are the real implementations the trainer uses.\n")

    tokenizer = build_tokenizer()
    rng = random.Random(t.seed)
    torch.manual_seed(t.seed)
    problems = make_problems(t.gen_batch_size * args.steps * max(1, a.filter_groups.max_num_gen_batches), seed=t.seed)
    next_problem = 0
    manager = RewardManager(
        tokenizer,
        score_fn=cfg.reward.custom_function.path,
        num_workers=cfg.reward.num_workers or min(8, os.cpu_count() or 1),  # 0 = automatic (config doc)
        timeout_s=cfg.reward.timeout_s,
        overlong_enable=a.overlong_buffer.enable,
        overlong_buffer_length=a.overlong_buffer.len,
        overlong_penalty_factor=a.overlong_buffer.penalty_factor,
        max_response_length=r.max_response_length,
        min_reward=cfg.reward.min_reward,
    )
    buffer = DynamicSamplingBuffer(
        t.train_batch_size, r.n, a.filter_groups.max_num_gen_batches, enabled=a.filter_groups.enable,
        pad_values={"response_ids": tokenizer.pad_token_id},
    )
    summary = []
    with manager:
        for step in range(1, args.steps + 1):
            started = time.perf_counter()
            while not buffer.is_full:
                batch_problems = problems[next_problem : next_problem + t.gen_batch_size]
                next_problem += t.gen_batch_size
                responses, truths, uids, kinds = [], [], [], []
                for index, problem in enumerate(batch_problems):
                    skill = rng.choice([0.0, 0.3, 0.7, 1.0])  # some groups all wrong / all right
                    for _ in range(r.n):
                        text, kind = _scripted_response(problem, rng, skill, max_chars=4 * r.max_response_length)
                        responses.append(text)
                        kinds.append(kind)
                        truths.append(problem.answer)
                        uids.append(f"s{step}-p{next_problem + index}")
                ids = [tokenizer(text)["input_ids"][: r.max_response_length] for text in responses]
                lengths = torch.tensor([len(x) for x in ids])
                padded = torch.full((len(ids), int(lengths.max())), tokenizer.pad_token_id)
                for row, x in enumerate(ids):
                    padded[row, : len(x)] = torch.tensor(x)
                rewards = manager.score(padded, truths, lengths)
                kept = buffer.add(
                    {"response_ids": padded, "lengths": lengths, "scores": rewards.scores, "acc": rewards.acc},
                    metric=rewards.acc, group_ids=uids,
                )
                print(
                    f"step {step} gen batch {buffer.num_gen_batches}: {kept.num_groups} groups, "
                    f"{kept.num_kept} informative, {kept.num_all_correct} all-correct, {kept.num_all_wrong} all-wrong; "
                    f"acc {rewards.acc.float().mean():.2f}, score {rewards.scores.mean():+.3f}, "
                    f"{int((rewards.overlong_penalty < 0).sum())} responses penalised for length"
                )
            train = buffer.take()
            group_ids = torch.arange(t.train_batch_size).repeat_interleave(r.n)
            advantages = grpo_advantages(train["scores"], group_ids, norm_by_std=a.norm_adv_by_std)
            mask = torch.arange(train["response_ids"].shape[1])[None, :] < train["lengths"][:, None]
            old_log_probs = -torch.rand(mask.shape) * 2
            log_probs = (old_log_probs + 0.2 * torch.randn(mask.shape)).requires_grad_(True)
            per_token, stats = policy_loss(
                log_probs, old_log_probs, token_advantages(advantages, mask), mask,
                clip_low=a.clip_low, clip_high=a.clip_high, clip_c=a.clip_c,
            )
            num_tokens, num_seqs = count_tokens_and_seqs(mask)
            loss = aggregate(per_token, mask, a.loss_agg_mode, num_tokens=num_tokens, num_seqs=num_seqs)
            loss.backward()
            record = {
                "step": step,
                **buffer.stats,
                "train/num_sequences": int(mask.shape[0]),
                "train/num_tokens": int(num_tokens),
                "critic/score/mean": float(train["scores"].mean()),
                "critic/advantages/max": float(advantages.max()),
                "critic/advantages/min": float(advantages.min()),
                "actor/pg_loss": float(loss.detach()),
                "actor/pg_clipfrac": float(stats.clipfrac),
                "actor/pg_clipfrac_higher": float(stats.clipfrac_high),
                "actor/ppo_kl": float(stats.approx_kl),
                "actor/grad_norm_wrt_logprobs": float(log_probs.grad.norm()),
                "timing_s/step": time.perf_counter() - started,
            }
            summary.append(record)
            print(json.dumps(record, indent=None))
    print(f"\ndone: {args.steps} steps. The trainer (coming) replaces the scripted policy with a model.")
    return 0
