"""Asynchronous training (issue 27): wall time of N steps, one-step-off vs synchronous, both in the
separate placement; and the same with an engine that takes a set time per generate call.

Each run is `megatron-dapo train` on the demo workspace (`make demo`'s tiny model and arithmetic
data), 2 processes: 1 trainer rank and 1 rollout rank holding the embedded engine
(`rollout.placement=separate rollout.num_gpus=1`), the same seeds and data in every run; the
rewards of tests/trainer/parity_reward.py give mixed groups to an untrained model, so every step
trains. Two arms, run alternately (the order flips every round), `--rounds` rounds:

* sync:  trainer.max_staleness=0: generation, then the update and the push, in turn;
* async: trainer.max_staleness=1 (+ algorithm.tis_cap=2): the engine generates step t+1's batch
  with the weights of step t-1... while step t trains.

The figure of a run is the wall time of its steps 2..N (`timing_s/step` summed: the first step has
no batch generated ahead, and start-up is not a step). Two set-ups:

* `real`: the engine generates on the CPU. This machine has 2 cores: the trainer and the engine
  each get one (OMP_NUM_THREADS=1), but they still share memory bandwidth and caches.
* `sleeping`: the engine's generate also sleeps `--sleep-s` seconds (no core used: the wait a GPU
  engine's decoding is to the trainer). Default: the update time measured in a first sync run, so
  that generation and the rest of the step take about as long, where overlap pays most. Its
  result is compared with the scheduling bound from the sync runs' own timers:
  (G + T + S) / (max(G, T) + S), G = the step's wait for samples (`timing_s/gen`), S = the push
  (`weight_sync/seconds`), T = the rest of the step. A bound for this loop, not a GPU projection.

Reported per set-up: median and min-max of each arm, the ratio sync / async of the medians, the
prediction, and each arm's mean reward (`critic/score/mean`) over its steps: the runs train on the
same data and seeds, so the curves should agree within their noise.

    python benchmarks/bench_async.py [--rounds 5 --steps 6 --setups real,sleeping --json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from megatron_dapo.distributed.launch import find_free_port  # noqa: E402
from tests.support.trainer_runs import FAST  # noqa: E402  (after the path)

SLEEP_ENV = "MEGATRON_DAPO_BENCH_GENERATE_SLEEP_S"
"""Read by this script's per-rank entry (`--rank`): seconds each engine generate call also sleeps."""

# The trainer tests' small steps (tests/support/trainer_runs.py FAST: 8 prompts x 4 samples of up to
# 16 tokens per generation batch, train batch 4, the parity reward), in the separate placement.
RUN = [*FAST, "trainer.loggers=[jsonl]", "rollout.placement=separate", "rollout.num_gpus=1"]
ARMS = {"sync": ["trainer.max_staleness=0"], "async": ["trainer.max_staleness=1", "algorithm.tis_cap=2.0"]}


# ---------------------------------------------------------------------------------------------
# One rank of a run (re-executed by torch.distributed.run)
# ---------------------------------------------------------------------------------------------


class SleepingEngine:
    """The engine, with a set wait after every generate call (the rest is the engine's own)."""

    def __init__(self, engine, sleep_s: float) -> None:
        self._engine, self._sleep_s = engine, sleep_s

    def generate(self, *args, **kwargs):
        out = self._engine.generate(*args, **kwargs)
        time.sleep(self._sleep_s)
        return out

    def __getattr__(self, name):
        return getattr(self._engine, name)


def rank_main(argv: list[str]) -> int:
    sleep_s = float(os.environ.get(SLEEP_ENV, "0") or 0)
    if sleep_s > 0:
        from megatron_dapo.trainer import rollout_worker

        real_make_engine = rollout_worker.make_engine
        rollout_worker.make_engine = lambda *a, **k: SleepingEngine(real_make_engine(*a, **k), sleep_s)
    from megatron_dapo.cli.main import main

    return main(argv)


# ---------------------------------------------------------------------------------------------
# The benchmark
# ---------------------------------------------------------------------------------------------


def run_training(workspace: dict, output: Path, arm: str, steps: int, sleep_s: float, timeout: float) -> list[dict]:
    """One run of `arm`; its metrics.jsonl records, one per step."""
    return run_arm(workspace, output, ARMS[arm], steps, {SLEEP_ENV: str(sleep_s)}, timeout, Path(__file__), arm)


def run_arm(
    workspace: dict, output: Path, overrides: list[str], steps: int, env: dict, timeout: float, entry: Path, name: str
) -> list[dict]:
    """One 2-process run (`RUN` + `overrides`) with `entry --rank` as each rank's program and `env`
    beside the usual; its metrics.jsonl records of steps 1..N (bench_partial.py runs its arms here too)."""
    port = find_free_port()
    overrides = [
        *RUN, *overrides, f"trainer.total_steps={steps}", f"model.hf_dir={workspace['model']}",
        f"data.train_files=[{workspace['train']}]", f"data.val_files=[{workspace['val']}]", f"trainer.output_dir={output}",
    ]  # fmt: skip
    command = [
        sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
        "--master_port", str(port), str(entry.resolve()), "--rank", "train", "--config", str(REPO / "configs" / "tiny_cpu.yaml"),
        *overrides,
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO), **env}
    done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    if done.returncode != 0:
        raise RuntimeError(f"{name} run failed ({done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    records = [json.loads(line) for line in (output / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return sorted((r for r in records if r.get("step", 0) >= 1), key=lambda r: r["step"])


def steps_wall(records: list[dict]) -> float:
    """Seconds of steps 2..N (the first has nothing generated ahead)."""
    return sum(r["timing_s/step"] for r in records if r["step"] >= 2)


def timers(records: list[dict]) -> dict[str, float]:
    """A sync run's mean G (waiting for samples), S (push) and T (the rest) per step, steps 2..N."""
    later = [r for r in records if r["step"] >= 2]
    g = statistics.fmean(r["timing_s/gen"] for r in later)
    s = statistics.fmean(r.get("weight_sync/seconds", 0.0) for r in later)
    step = statistics.fmean(r["timing_s/step"] for r in later)
    return {"G": g, "S": s, "T": step - g - s, "step": step}


def predicted_ratio(t: dict[str, float]) -> float:
    """(G + T + S) / (max(G, T) + S): the step's phases in turn vs generation beside the rest."""
    return (t["G"] + t["T"] + t["S"]) / (max(t["G"], t["T"]) + t["S"])


def mean_reward(records: list[dict]) -> float:
    return statistics.fmean(r["critic/score/mean"] for r in records)


def summary(values: list[float]) -> str:
    return f"{statistics.median(values):7.2f} s  (min {min(values):.2f}, max {max(values):.2f}, n={len(values)})"


def bench_setup(name: str, workspace: dict, tmp: Path, args, sleep_s: float) -> dict:
    walls: dict[str, list[float]] = {arm: [] for arm in ARMS}
    rewards: dict[str, list[float]] = {arm: [] for arm in ARMS}
    staleness: list[float] = []
    sync_timers: list[dict] = []
    curves: dict[str, list[float]] = {}
    for round_index in range(args.rounds):
        order = list(ARMS) if round_index % 2 == 0 else list(reversed(ARMS))
        for arm in order:
            records = run_training(workspace, tmp / f"{name}-{arm}-{round_index}", arm, args.steps, sleep_s, args.timeout)
            walls[arm].append(steps_wall(records))
            rewards[arm].append(mean_reward(records))
            curves[arm] = [r["critic/score/mean"] for r in records]  # the same every round: same seeds
            if arm == "sync":
                sync_timers.append(timers(records))
            else:
                staleness.append(statistics.fmean(r["async/staleness_mean"] for r in records if r["step"] >= 2))
            print(f"  [{name}] round {round_index + 1}/{args.rounds} {arm:5}: steps 2..{args.steps} {walls[arm][-1]:.2f} s, "
                  f"mean reward {rewards[arm][-1]:+.3f}", flush=True)  # fmt: skip
    mean_timers = {k: statistics.median(t[k] for t in sync_timers) for k in ("G", "T", "S", "step")}
    ratios = [s / a for s, a in zip(walls["sync"], walls["async"])]
    result = {
        "setup": name,
        "sleep_s": sleep_s,
        "walls": walls,
        "median": {arm: statistics.median(v) for arm, v in walls.items()},
        "ratio_of_medians": statistics.median(walls["sync"]) / statistics.median(walls["async"]),
        "ratio_per_round": ratios,
        "sync_timers": mean_timers,
        "predicted_ratio": predicted_ratio(mean_timers),
        "mean_reward": {arm: statistics.fmean(v) for arm, v in rewards.items()},
        "reward_spread": {arm: (min(v), max(v)) for arm, v in rewards.items()},
        "async_staleness_mean": statistics.fmean(staleness) if staleness else None,
        "reward_curves": curves,
        # The noise of a curve's mean: the steps' spread of the mean reward over sqrt(steps).
        "reward_noise": {arm: statistics.stdev(c) / len(c) ** 0.5 for arm, c in curves.items()},
    }
    print(f"\n{name}: {args.steps - 1} steps (2..{args.steps}), {args.rounds} rounds, engine sleep {sleep_s:.2f} s per generate call")
    for arm in ARMS:
        print(f"  {arm:5}  {summary(walls[arm])}   mean reward {result['mean_reward'][arm]:+.3f} "
              f"(rounds {result['reward_spread'][arm][0]:+.3f} .. {result['reward_spread'][arm][1]:+.3f})")  # fmt: skip
    noise = max(result["reward_noise"].values())
    difference = abs(result["mean_reward"]["sync"] - result["mean_reward"]["async"])
    print(f"  reward curves: mean differs by {difference:.3f}; noise of a curve's mean {noise:.3f} "
          f"(steps' spread / sqrt({args.steps})): {'within' if difference <= 2 * noise else 'BEYOND'} 2x the noise")
    t = mean_timers
    print(f"  sync / async: {result['ratio_of_medians']:.2f}x (per round {min(ratios):.2f}-{max(ratios):.2f}); "
          f"predicted (G + T + S) / (max(G, T) + S) = ({t['G']:.2f} + {t['T']:.2f} + {t['S']:.2f}) / "
          f"(max({t['G']:.2f}, {t['T']:.2f}) + {t['S']:.2f}) = {result['predicted_ratio']:.2f}x "
          f"(measured / predicted {result['ratio_of_medians'] / result['predicted_ratio']:.2f}); "
          f"async staleness mean {result['async_staleness_mean']:.2f}\n", flush=True)  # fmt: skip
    return result


def main(argv: Optional[list[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "--rank":
        return rank_main(argv[1:])
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5, help="rounds of both arms (default 5)")
    parser.add_argument("--steps", type=int, default=6, help="steps per run; steps 2..N are timed (default 6)")
    parser.add_argument("--setups", default="real,sleeping", help="real, sleeping or both (default)")
    parser.add_argument("--sleep-s", type=float, default=None,
                        help="sleeping set-up: seconds per generate call (default: the update time of a first sync run)")  # fmt: skip
    parser.add_argument("--timeout", type=float, default=900, help="seconds per run (default 900)")
    parser.add_argument("--json", default=None, help="also write the results here")
    args = parser.parse_args(argv)
    if args.steps < 3 or args.rounds < 1:
        parser.error("--steps must be >= 3 and --rounds >= 1")
    setups = [s.strip() for s in args.setups.split(",") if s.strip()]
    if not setups or any(s not in ("real", "sleeping") for s in setups):
        parser.error(f"--setups takes real and/or sleeping, got {args.setups!r}")

    import torch

    from megatron_dapo.cli.demo import prepare_workspace

    print(f"machine: {platform.node()}, {os.cpu_count()} CPUs, Python {platform.python_version()}, torch {torch.__version__}")
    results = []
    with tempfile.TemporaryDirectory(prefix="bench_async_") as tmp_name:
        tmp = Path(tmp_name)
        workspace = prepare_workspace(tmp / "workspace", seed=7, num_train=200, num_val=8)
        print("warm-up: one sync run (untimed; it also measures the update time for the sleeping set-up)", flush=True)
        warm = timers(run_training(workspace, tmp / "warmup", "sync", args.steps, 0.0, args.timeout))
        print(f"  sync timers per step: G {warm['G']:.2f} s (waiting for samples), T {warm['T']:.2f} s (the rest), "
              f"S {warm['S']:.2f} s (push)\n", flush=True)  # fmt: skip
        for setup in setups:
            sleep_s = 0.0 if setup == "real" else (args.sleep_s if args.sleep_s is not None else round(warm["T"], 2))
            results.append(bench_setup(setup, workspace, tmp, args, sleep_s))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
