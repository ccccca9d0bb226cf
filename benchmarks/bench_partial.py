"""Partial rollouts (issue 27, `rollout.partial_rollouts`): one step off with weight pushes landing
between decode steps vs after the engine's requests, both in the separate placement.

Each run is bench_async.py's async arm: `megatron-dapo train` on the demo workspace in 2 processes
(1 trainer rank, 1 rollout rank holding the embedded engine), `trainer.max_staleness=1` with
`algorithm.tis_cap=2`, the same seeds and data in every run. Two arms, alternated (the order flips
every round), after one untimed run:

* after:   `rollout.partial_rollouts=false`: the engine finishes the batch it generates ahead
  before it takes the step's push, so the push waits for the rest of that batch;
* partial: `rollout.partial_rollouts=true`: the push lands at the next decode step and the batch's
  rows carry on with the new weights (their KV recomputed).

Two set-ups: `real` (the engine decodes on the CPU) and `slow-decode` (each decode step also sleeps
`--decode-sleep-s`, using no core: generation takes longer than the update, as DAPO's does on GPUs,
so the push arrives while the next batch is being generated). Per arm: the wall time of steps 2..N
(`timing_s/step` summed), the push on the trainer's critical path (`weight_sync/seconds`, the mean
of steps 2..N), the samples' staleness (their oldest token) and the tokens' staleness.

What the loop predicts: the same wall time (the next step waits for the batch in flight either
way: max(G, T) + S), a push shorter by what is left of that batch, and tokens fresher than samples.

    python benchmarks/bench_partial.py [--rounds 5 --steps 6 --setups real,slow-decode --json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Optional

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

import bench_async  # noqa: E402  (after the path: the same runs and figures)

DECODE_SLEEP_ENV = "MEGATRON_DAPO_BENCH_DECODE_SLEEP_S"
"""Read by this script's per-rank entry (`--rank`): seconds each embedded decode step also sleeps."""
ARMS = {
    "after": [*bench_async.ARMS["async"], "rollout.partial_rollouts=false"],
    "partial": [*bench_async.ARMS["async"], "rollout.partial_rollouts=true"],
}


def rank_main(argv: list[str]) -> int:
    pause = float(os.environ.get(DECODE_SLEEP_ENV, "0") or 0)
    if pause > 0:
        import time

        from megatron_dapo.rollout.engines import embedded

        sample = embedded.sample_next_tokens  # the decode loop samples once a step through this global

        def slow_sample(*args, **kwargs):
            time.sleep(pause)
            return sample(*args, **kwargs)

        embedded.sample_next_tokens = slow_sample
    from megatron_dapo.cli.main import main

    return main(argv)


def run_training(workspace: dict, output: Path, arm: str, steps: int, decode_sleep_s: float, timeout: float) -> list[dict]:
    """One run of `arm`; its metrics.jsonl records of steps 1..N."""
    return bench_async.run_arm(workspace, output, ARMS[arm], steps, {DECODE_SLEEP_ENV: str(decode_sleep_s)}, timeout, Path(__file__), arm)


def later_mean(records: list[dict], key: str, default: Optional[str] = None) -> float:
    """The mean of `key` over steps 2..N; where the run logs none, of `default` (the per-sample
    staleness stands for the per-token one when every sample has one version)."""
    later = [r for r in records if r["step"] >= 2]
    if not any(key in r for r in later) and default is not None:
        key = default
    return statistics.fmean(r.get(key, 0.0) for r in later)


FIGURES = {  # figure -> (metric, what stands for it in a run that logs none)
    "push_s": ("weight_sync/seconds", None),
    "staleness": ("async/staleness_mean", None),
    "token_staleness": ("async/token_staleness_mean", "async/staleness_mean"),
    "partial_frac": ("async/partial_frac", None),
}


def bench_setup(name: str, workspace: dict, tmp: Path, args, decode_sleep_s: float) -> dict:
    walls: dict[str, list[float]] = {arm: [] for arm in ARMS}
    figures: dict[str, dict[str, list[float]]] = {arm: {f: [] for f in FIGURES} for arm in ARMS}
    for round_index in range(args.rounds):
        order = list(ARMS) if round_index % 2 == 0 else list(reversed(ARMS))
        for arm in order:
            records = run_training(workspace, tmp / f"{name}-{arm}-{round_index}", arm, args.steps, decode_sleep_s, args.timeout)
            walls[arm].append(bench_async.steps_wall(records))
            for figure, (key, default) in FIGURES.items():
                figures[arm][figure].append(later_mean(records, key, default))
            print(f"  [{name}] round {round_index + 1}/{args.rounds} {arm:7}: steps 2..{args.steps} {walls[arm][-1]:.2f} s, "
                  f"push {figures[arm]['push_s'][-1]:.3f} s/step", flush=True)  # fmt: skip
    result = {
        "setup": name,
        "decode_sleep_s": decode_sleep_s,
        "walls": walls,
        "median": {arm: statistics.median(v) for arm, v in walls.items()},
        "ratio_of_medians": statistics.median(walls["after"]) / statistics.median(walls["partial"]),
        "ratio_per_round": [a / p for a, p in zip(walls["after"], walls["partial"])],
        "figures": {arm: {f: statistics.median(v) for f, v in per.items()} for arm, per in figures.items()},
        "figure_spread": {arm: {f: (min(v), max(v)) for f, v in per.items()} for arm, per in figures.items()},
    }
    print(f"\n{name}: {args.steps - 1} steps (2..{args.steps}), {args.rounds} rounds, decode sleep {decode_sleep_s:.3f} s a step")
    for arm in ARMS:
        f, spread = result["figures"][arm], result["figure_spread"][arm]
        print(f"  {arm:7}  {bench_async.summary(walls[arm])}   push {f['push_s']:.3f} s/step "
              f"({spread['push_s'][0]:.3f}-{spread['push_s'][1]:.3f}); staleness {f['staleness']:.2f} per sample, "
              f"{f['token_staleness']:.2f} per token; partial_frac {f['partial_frac']:.2f}")  # fmt: skip
    ratios = result["ratio_per_round"]
    print(f"  after / partial: {result['ratio_of_medians']:.2f}x (per round {min(ratios):.2f}-{max(ratios):.2f})\n", flush=True)
    return result


def main(argv: Optional[list[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "--rank":
        return rank_main(argv[1:])
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5, help="rounds of both arms (default 5)")
    parser.add_argument("--steps", type=int, default=6, help="steps per run; steps 2..N are timed (default 6)")
    parser.add_argument("--setups", default="real,slow-decode", help="real, slow-decode or both (default)")
    parser.add_argument("--decode-sleep-s", type=float, default=0.05, help="slow-decode: seconds each decode step sleeps (default 0.05)")
    parser.add_argument("--timeout", type=float, default=900, help="seconds per run (default 900)")
    parser.add_argument("--json", default=None, help="also write the results here")
    args = parser.parse_args(argv)
    if args.steps < 3 or args.rounds < 1:
        parser.error("--steps must be >= 3 and --rounds >= 1")
    setups = [s.strip() for s in args.setups.split(",") if s.strip()]
    if not setups or any(s not in ("real", "slow-decode") for s in setups):
        parser.error(f"--setups takes real and/or slow-decode, got {args.setups!r}")

    import torch

    from megatron_dapo.cli.demo import prepare_workspace

    print(f"machine: {platform.node()}, {os.cpu_count()} CPUs, Python {platform.python_version()}, torch {torch.__version__}")
    results = []
    with tempfile.TemporaryDirectory(prefix="bench_partial_") as tmp_name:
        tmp = Path(tmp_name)
        workspace = prepare_workspace(tmp / "workspace", seed=7, num_train=200, num_val=8)
        print("warm-up: one partial run (untimed)", flush=True)
        run_training(workspace, tmp / "warmup", "partial", args.steps, 0.0, args.timeout)
        for setup in setups:
            results.append(bench_setup(setup, workspace, tmp, args, 0.0 if setup == "real" else args.decode_sleep_s))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
