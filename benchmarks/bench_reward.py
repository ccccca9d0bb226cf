"""Reward scoring throughput: the RewardManager (batched decode + worker pool) versus a plain loop.

Generates `--num` synthetic but realistic responses (math-style reasoning of a few hundred to a few
thousand characters ending in `Answer:` lines, some boxed, some without any answer, mixed
correctness, a few truncated at the length limit; fixed seed), tokenises them with a byte-level
BPE tokenizer trained here on the synthetic text (no download) and wrapped in
`transformers.PreTrainedTokenizerFast`, then times on the same inputs:

* serial: for each response, `tokenizer.decode` of its valid ids + `math_dapo.compute_score` + the
  overlong penalty of DAPO eq. 13 in plain Python (the loop of verl's DAPO reward manager);
* manager: `RewardManager.score` with `--workers` processes (default: os.cpu_count()), pool
  already started (it lives across training steps; its start-up is reported separately);
* manager-inline: `RewardManager.score` with num_workers=0 (batched decode, scoring in-process);

and a breakdown of the manager's time (batched decode alone, scoring alone, what remains is
inter-process traffic and bookkeeping). It checks that all paths give identical rewards.

    python benchmarks/bench_reward.py --num 20000 --repeat 3
"""

from __future__ import annotations

import argparse
import os
import platform
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron_dapo.reward.manager import RewardManager  # noqa: E402
from megatron_dapo.reward.scoring import batch_decode  # noqa: E402
from megatron_dapo.reward.math_dapo import compute_score  # noqa: E402

EOS = "<|endoftext|>"
MAX_RESPONSE_LENGTH = 1024
OVERLONG_BUFFER = 256
PENALTY_FACTOR = 1.0

_STEPS = (
    "First, note that {a} + {b} = {s}, so the sum of the two terms is {s}.",
    "Multiplying both sides by {a}, we get {a}x = {p}.",
    "Let $x$ be the number of apples. Then $x^2 - {a}x + {b} = 0$, and by Vieta the roots sum to {a}.",
    "We compute $\\frac{{{a}}}{{{b}}} + \\frac{{{b}}}{{{a}}} = \\frac{{{q}}}{{{p}}}$.",
    "Since ${a}^2 = {sq}$, we have $\\sqrt{{{sq}}} = {a}$.",
    "The area of the triangle is $\\frac{{1}}{{2}} \\cdot {a} \\cdot {b} = {h}$ square units.",
    "Hmm, wait. Let me double-check this step: {a} \\times {b} = {p}. Yes, that is right.",
    "Consider the modulus: ${p} \\equiv {r} \\pmod{{{b}}}$.",
    "By the triangle inequality, $|{a} - {b}| \\le c \\le {s}$.",
    "So the probability is $\\frac{{{a}}}{{{s}}}$, which is already in lowest terms if $\\gcd({a}, {s}) = 1$.",
    "Substituting back, $f({a}) = {a}^2 + {b} = {t}$.",
    "Therefore the number of ways is $\\binom{{{s}}}{{2}} = {c2}$.",
    "Alternatively, think of it geometrically: the point $({a}, {b})$ lies on the circle of radius $\\sqrt{{{r2}}}$.",
    "Let me reconsider. If $n = {a}$, then $n(n+1)/2 = {tri}$.",
    "The angle measures {a}^\\circ, so the supplementary angle is {sup}^\\circ.",
)


def _step(rng: random.Random) -> str:
    a, b = rng.randint(2, 99), rng.randint(2, 99)
    return rng.choice(_STEPS).format(
        a=a, b=b, s=a + b, p=a * b, q=a * a + b * b, sq=a * a, h=a * b / 2, r=(a * b) % b, t=a * a + b,
        c2=(a + b) * (a + b - 1) // 2, r2=a * a + b * b, tri=a * (a + 1) // 2, sup=180 - a,
    )


def _ground_truth(rng: random.Random) -> str:
    kind = rng.random()
    if kind < 0.7:
        return str(rng.randint(0, 2000))  # DAPO-Math-17k answers are integers
    if kind < 0.85:
        return f"\\frac{{{rng.randint(1, 20)}}}{{{rng.randint(21, 40)}}}"
    return f"{rng.randint(1, 9)}\\sqrt{{{rng.choice([2, 3, 5, 7])}}}"


def _ending(rng: random.Random, truth: str) -> str:
    wrong = str(rng.randint(0, 2000))
    roll = rng.random()
    if roll < 0.40:
        return f"\n\nAnswer: {truth}"
    if roll < 0.50:
        return f"\n\nTherefore the final answer is $\\boxed{{{truth}}}$.\n\nAnswer: $\\boxed{{{truth}}}$"
    if roll < 0.55:
        return f"\n\nanswer: {truth} units"
    if roll < 0.75:
        return f"\n\nAnswer: {wrong}"
    if roll < 0.80:
        return f"\n\nAnswer: {wrong}\n\nWait, that is wrong. Correcting the last step:\n\nAnswer: {truth}"
    if roll < 0.88:
        return f"\n\nSo the answer is $\\boxed{{{truth if rng.random() < 0.6 else wrong}}}$."  # boxed only
    return "\n\nLet me try yet another approach" + "." * rng.randint(0, 3)  # no answer at all


def make_dataset(num: int, seed: int) -> tuple[list[str], list[str]]:
    """`num` (response, ground truth) pairs; lengths from a few hundred to a few thousand characters."""
    rng = random.Random(seed)
    responses, truths = [], []
    for _ in range(num):
        truth = _ground_truth(rng)
        target_chars = int(rng.lognormvariate(7.2, 0.6))  # median ~1300 chars, long tail
        target_chars = max(200, min(target_chars, 9000))
        parts, size = [], 0
        while size < target_chars:
            sentence = _step(rng)
            if rng.random() < 0.02:
                sentence += " (π ≈ 3.14159, ∑ ≥ 0 — résumé)"  # some non-ASCII text
            parts.append(sentence)
            size += len(sentence) + 1
        responses.append(" ".join(parts) + _ending(rng, truth))
        truths.append(truth)
    return responses, truths


def build_tokenizer(texts: list[str]):
    """A byte-level BPE tokenizer trained on the synthetic text, wrapped as a HF fast tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=4096, special_tokens=[EOS], initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    tokenizer.train_from_iterator(texts[:2000], trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token=EOS, clean_up_tokenization_spaces=False)


def tokenize(tokenizer, responses: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded [B, T] ids cut at MAX_RESPONSE_LENGTH (EOS appended when it fits) and lengths."""
    encoded = tokenizer(responses, add_special_tokens=False)["input_ids"]
    eos_id = tokenizer.convert_tokens_to_ids(EOS)
    rows = [(ids + [eos_id])[:MAX_RESPONSE_LENGTH] for ids in encoded]
    lengths = torch.tensor([len(r) for r in rows], dtype=torch.int64)
    padded = torch.full((len(rows), int(lengths.max())), eos_id, dtype=torch.int64)
    for i, row in enumerate(rows):
        padded[i, : len(row)] = torch.tensor(row)
    return padded, lengths


def serial_scores(tokenizer, ids: torch.Tensor, lengths: torch.Tensor, truths: list[str]) -> torch.Tensor:
    """The plain loop, shaped like verl's DAPO reward manager: slice each row's valid ids, decode
    it, score it, add the penalty in python floats."""
    out = []
    expected = MAX_RESPONSE_LENGTH - OVERLONG_BUFFER
    for i, truth in enumerate(truths):
        length = int(lengths[i])
        text = tokenizer.decode(ids[i, :length], skip_special_tokens=True)
        reward = compute_score(text, truth)["score"]
        reward += min((expected - length) / OVERLONG_BUFFER * PENALTY_FACTOR, 0.0)
        out.append(reward)
    return torch.tensor(out, dtype=torch.float32)


def _interleaved(paths: dict, repeat: int) -> tuple[dict, dict]:
    """Run every path once per round, `repeat` rounds, so that load from other processes on a
    shared machine hits all paths alike. Returns ({name: [seconds]}, {name: last result})."""
    times: dict = {name: [] for name in paths}
    results: dict = {}
    for _ in range(repeat):
        for name, fn in paths.items():
            start = time.perf_counter()
            results[name] = fn()
            times[name].append(time.perf_counter() - start)
    return times, results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num", type=int, default=20000, help="number of responses")
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1, help="manager worker processes")
    parser.add_argument("--repeat", type=int, default=3, help="timed rounds (median and best reported)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    t0 = time.perf_counter()
    responses, truths = make_dataset(args.num, args.seed)
    tokenizer = build_tokenizer(responses)
    ids, lengths = tokenize(tokenizer, responses)
    print(
        f"{args.num} responses, {sum(map(len, responses)) / args.num:.0f} chars and "
        f"{float(lengths.double().mean()):.0f} tokens on average, "
        f"{int((lengths == MAX_RESPONSE_LENGTH).sum())} truncated at {MAX_RESPONSE_LENGTH}; "
        f"set-up {time.perf_counter() - t0:.1f} s"
    )
    print(
        f"machine: {os.cpu_count()} CPUs, Python {platform.python_version()}, torch {torch.__version__}; "
        f"load average before timing {os.getloadavg()[0]:.2f}"
    )

    settings = dict(
        overlong_enable=True, overlong_buffer_length=OVERLONG_BUFFER, overlong_penalty_factor=PENALTY_FACTOR,
        max_response_length=MAX_RESPONSE_LENGTH,
    )
    inline = RewardManager(tokenizer, num_workers=0, **settings)
    pooled = RewardManager(tokenizer, num_workers=args.workers, **settings)
    pooled_text = RewardManager(tokenizer, num_workers=args.workers, decode_in_workers=False, **settings)
    start = time.perf_counter()
    pooled.score(ids[:1], truths[:1], lengths[:1])  # starts the pool, as the first training step would
    startup_s = time.perf_counter() - start
    pooled_text.score(ids[:1], truths[:1], lengths[:1])

    # Where the time goes, timed in the same rounds: decode in one batched call (as the manager feeds
    # a Hugging Face tokenizer: 1-D arrays; and with python lists of ints), then scoring the text.
    arrays = [ids[i, :n].numpy() for i, n in enumerate(lengths.tolist())]
    lists = [a.tolist() for a in arrays]
    decoded = batch_decode(tokenizer, arrays)
    paths = {
        "serial loop (decode+score+penalty)": lambda: serial_scores(tokenizer, ids, lengths, truths),
        "manager, in-process (num_workers=0)": lambda: inline.score(ids, truths, lengths),
        f"manager, {args.workers} workers score, parent decodes": lambda: pooled_text.score(ids, truths, lengths),
        f"manager, {args.workers} workers decode+score": lambda: pooled.score(ids, truths, lengths),
        "part: batched decode": lambda: batch_decode(tokenizer, arrays),
        "part: batched decode, lists of ints": lambda: tokenizer.batch_decode(lists, skip_special_tokens=True),
        "part: compute_score": lambda: [compute_score(r, t) for r, t in zip(decoded, truths)],
    }
    times, results = _interleaved(paths, args.repeat)

    # Small batches (a validation set, a tiny step): the pool's fixed cost per call.
    small = 64
    small_times, _ = _interleaved(
        {
            "serial": lambda: serial_scores(tokenizer, ids[:small], lengths[:small], truths[:small]),
            "pool": lambda: pooled.score(ids[:small], truths[:small], lengths[:small]),
        },
        max(args.repeat, 5),
    )
    pooled.close()
    pooled_text.close()

    serial = results["serial loop (decode+score+penalty)"]
    for name, result in results.items():
        if name.startswith(("serial", "part")):
            continue
        if not torch.equal(result.scores, serial):
            mismatches = int((result.scores != serial).sum())
            raise SystemExit(f"MISMATCH: '{name}' differs from the serial loop on {mismatches} responses")
        assert result.responses == decoded and not bool(result.failed.any())

    last = results[f"manager, {args.workers} workers decode+score"]
    acc = float(last.acc.double().mean())
    penalised = int((last.overlong_penalty < 0).sum())
    print(
        f"identical rewards on all {args.num} responses from every path "
        f"(accuracy {acc:.3f}, {penalised} penalised for length)"
    )
    serial_s = statistics.median(times["serial loop (decode+score+penalty)"])
    print(f"{'path':<44}{'median s':>9}{'best s':>8}{'responses/s':>13}{'speed-up':>10}")
    for name, seconds in times.items():
        median = statistics.median(seconds)
        if name.startswith("part"):
            print(f"{name:<44}{median:>9.3f}{min(seconds):>8.3f}{args.num / median:>13.0f}")
        else:
            print(f"{name:<44}{median:>9.3f}{min(seconds):>8.3f}{args.num / median:>13.0f}{serial_s / median:>9.2f}x")
    print(f"pool start-up (once per run, before the first batch): {startup_s:.2f} s")
    print(
        f"load average after timing {os.getloadavg()[0]:.2f} "
        "(above ~0.5, other processes shared the cores: the parallel paths lose most)"
    )
    print(
        f"batch of {small}: serial {1e3 * statistics.median(small_times['serial']):.1f} ms, "
        f"pool {1e3 * statistics.median(small_times['pool']):.1f} ms"
    )


if __name__ == "__main__":
    main()
