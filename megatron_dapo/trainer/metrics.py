"""Every metric name a DAPO run logs, and the functions that compute the values under them.

Names follow verl's where verl has one, so that dashboards and the paper's curves read the same:

    critic/score/{mean,max,min}        the reward function's score of the train batch
    critic/rewards/{mean,max,min}      score + overlong penalty (what the advantages see)
    critic/advantages/{mean,max,min}, critic/acc/mean
    actor/*                            the update (`MegatronActor.update`): loss, grad_norm, lr, tokens,
                                       ..., clip fractions and KL under verl's names (pg_clipfrac, ppo_kl);
                                       MoE models: moe_aux_loss, moe_z_loss, moe_load_ratio_{mean,max}
                                       (`actor.moe`)
    response_length/{mean,max,min,clip_ratio}, prompt_length/{mean,max}    of the train batch
    train/{acc,score}_all_generated, train/overlong_penalty_mean, train/overlong_penalised_frac
                                       every sample generated in the step
    train/num_gen_batches, train/num_groups_*, train/num_samples_reward_failed
                                       dynamic sampling (`DynamicSamplingBuffer.stats`); train/epoch
    rollout_mismatch/{mean_abs,max_abs,k3_kl,tokens}   |rollout - trainer| log-probs (`algorithm.mismatch`)
    rollout_mismatch/routing_{token,layer}_frac        MoE models whose engine returns its routing, unless
                                       replayed from it (r3): tokens routed to other experts by the actor in
                                       at least one layer, and (token, layer) pairs (`actor.routing`)
    weight_sync/{seconds,gb_per_s}     the push of the new weights into the engine
    async/staleness_{mean,max}, async/staleness_frac_<s>   rollout.placement=separate: how many weight
                                       versions older than the update's the train batch's samples are
                                       (fraction of its samples at each staleness 0..trainer.max_staleness);
                                       train/num_groups_{carried,stale_dropped} with trainer.max_staleness > 0
    async/{token_staleness_mean,partial_frac}   rollout.partial_rollouts: staleness per response token (the
                                       version each token was sampled with), the share of responses a push
                                       landed in (tokens of two or more versions)
    async/{batches_in_flight,batches_submitted_ahead}   generation handed to the engines ahead of the update
    async/{engine_busy_s,engine_wait_s,trainer_wait_s,overlap_frac}   the separate placement's timeline:
                                       seconds the engines generated and waited for work in the step, the
                                       trainer waited for samples, and the share of the step in which
                                       generation and the trainer's work overlapped
    actor_offload/{gb,dropped_grads_gb,offload_gb_per_s,onload_gb_per_s}
    timing_s/<phase>                   seconds per `Phase` of the step; timing_s/step, timing_s/validation
    perf/tokens_per_s                  prompt + response tokens of the train batch per second of the step
    val/acc/mean@n, val/pass@k, val/maj@n, val/score/mean, val/response_length/{mean,clip_ratio},
    val/num_prompts                    validation
    sft/{loss,grad_norm,lr,tokens,perplexity}   the warm start (`megatron-dapo sft`)

`tracking` (console table, progress bar, plot) groups and picks metrics by these names.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, Optional

import torch

from megatron_dapo.algorithm.metrics import aggregate_at_k
from megatron_dapo.tracking import PhaseTimer
from megatron_dapo.trainer.samples import Samples

TIMING = "timing_s/"
ROLLOUT_MISMATCH = "rollout_mismatch/"

WALL_CLOCK = (
    TIMING, "perf/", "weight_sync/", "actor_offload/offload_gb_per_s", "actor_offload/onload_gb_per_s", "async/engine_",
    "async/trainer_wait_s", "async/overlap_frac",
)
"""Name prefixes of the values that differ between two runs of the same steps (durations, speeds);
every other value repeats exactly, also across a resume."""


class Phase:
    """The phases of a step, timed as ``timing_s/<phase>``."""

    GEN = "gen"
    """Generation and scoring, all generation batches of the step (dynamic sampling)."""
    ONLOAD = "onload"
    OLD_LOG_PROB = "old_log_prob"
    REF = "ref"
    UPDATE = "update"
    OFFLOAD = "offload"
    SYNC = "sync"
    STEP = "step"
    """The whole step (without validation)."""
    VALIDATION = "validation"


# verl's names of the actor's statistics; the others keep the actor's own (loss, grad_norm, lr, ...).
_ACTOR_NAMES = {
    "clipfrac": "pg_clipfrac",
    "clipfrac_high": "pg_clipfrac_higher",
    "clipfrac_low": "pg_clipfrac_lower",
    "dual_clipfrac": "pg_clipfrac_dual",
    "approx_kl": "ppo_kl",
}
# verl logs pass@k for these k below n (and n itself).
_PASS_AT_K = (1, 2, 4, 8, 16, 32, 64, 128)


def sft_metrics(update: dict[str, float]) -> dict[str, float]:
    """The warm start's metrics of one step, from the actor's update statistics."""
    record = {f"sft/{key}": update[key] for key in ("loss", "grad_norm", "lr", "tokens")}
    record["sft/perplexity"] = math.exp(min(update["loss"], 700.0))  # exp overflows a float above ~709
    return record


def is_wall_clock(name: str) -> bool:
    return name.startswith(WALL_CLOCK)


def step_timer() -> PhaseTimer:
    """The phase timer of one step. On a GPU each phase ends with a synchronize, so kernels are
    charged to the phase that queued them."""
    return PhaseTimer(TIMING, synchronize=torch.cuda.synchronize if torch.cuda.is_available() else None)


def batch_metrics(train: Samples, advantages: torch.Tensor, generated: Sequence[Samples], sampling: dict) -> dict[str, float]:
    """critic/, response_length/, prompt_length/ of the train batch; train/ of everything generated
    in the step and of dynamic sampling (`sampling`: `DynamicSamplingBuffer.stats`)."""
    everything = Samples.concat(generated)
    penalty = _f64(everything.overlong_penalty)
    return {
        **_summary("critic/score", _f64(train.task_score)),
        **_summary("critic/rewards", _f64(train.score)),
        **_summary("critic/advantages", advantages.double()),
        "critic/acc/mean": float(_f64(train.acc).mean()),
        "train/acc_all_generated": float(_f64(everything.acc).mean()),
        "train/score_all_generated": float(_f64(everything.task_score).mean()),
        "train/overlong_penalty_mean": float(penalty.mean()),
        "train/overlong_penalised_frac": float((penalty < 0).double().mean()),
        **_summary("response_length", _f64([len(x) for x in train.response_ids])),
        "response_length/clip_ratio": float(_f64(train.truncated).mean()),
        **_summary("prompt_length", _f64([len(x) for x in train.prompt_ids]), ("mean", "max")),
        **{f"train/{k}": float(v) for k, v in sampling.items()},
    }


def actor_metrics(update: dict[str, float]) -> dict[str, float]:
    """The actor's update statistics under verl's names (`actor/pg_clipfrac`, `actor/ppo_kl`, ...)."""
    return {f"actor/{_ACTOR_NAMES.get(k, k)}": float(v) for k, v in update.items()}


def mismatch_metrics(stats: Any) -> dict[str, float]:
    """`algorithm.mismatch.MismatchStats` pooled over the replicas, as `rollout_mismatch/*`."""
    return stats.as_metrics(prefix=ROLLOUT_MISMATCH)


def routing_mismatch_metrics(mismatch: Any) -> dict[str, float]:
    """`actor.routing.RoutingMismatch` of the train batch, as `rollout_mismatch/routing_*`."""
    return {
        f"{ROLLOUT_MISMATCH}routing_{name.removeprefix('routing_mismatch_')}": value
        for name, value in mismatch.metrics().items()
    }


def staleness_metrics(stalenesses: Sequence[int], max_staleness: int) -> dict[str, float]:
    """How stale the train batch is (`trainer.staleness.staleness` of each sample): mean, max and the
    fraction of samples at each staleness 0..max_staleness."""
    staleness = torch.tensor(list(stalenesses), dtype=torch.float64)
    if (staleness < 0).any():
        raise ValueError("samples generated with weights newer than the trainer's")
    out = {"async/staleness_mean": float(staleness.mean()), "async/staleness_max": float(staleness.max())}
    for s in range(max_staleness + 1):
        out[f"async/staleness_frac_{s}"] = float((staleness == s).double().mean())
    return out


def token_staleness_metrics(step: int, spans: Sequence[Sequence[tuple[int, int]]], lengths: Sequence[int]) -> dict[str, float]:
    """Partial rollouts: staleness per response token (each run of `spans`, `rollout.base.VersionSpans`,
    at step `step`'s staleness of its version; `lengths` the responses' token counts), and the share
    of responses whose tokens come from more than one version."""
    weighted, tokens = 0, 0
    for runs, length in zip(spans, lengths):
        ends = [first for first, _ in runs[1:]] + [length]
        for (first, version), end in zip(runs, ends):
            weighted += (step - 1 - version) * (end - first)
            tokens += end - first
    crossed = sum(len(runs) > 1 for runs in spans)
    return {
        "async/token_staleness_mean": weighted / tokens if tokens else 0.0,
        "async/partial_frac": crossed / len(spans) if len(spans) else 0.0,
    }


def timeline_metrics(
    window: tuple[float, float], engine_busy: Sequence[tuple[float, float]], trainer_busy: Sequence[tuple[float, float]],
    engine_wait_s: float, trainer_wait_s: float,
) -> dict[str, float]:
    """The separate placement's step timeline (wall-clock intervals within the step's `window`): how
    long the engines generated (union), waited for work or weights, the trainer waited for samples,
    and the share of the step in which generation and the trainer's own work ran at once."""
    start, end = window
    clip = [(max(a, start), min(b, end)) for a, b in engine_busy if min(b, end) > max(a, start)]
    length = max(end - start, 1e-9)
    return {
        "async/engine_busy_s": busy_union_seconds(clip),
        "async/engine_wait_s": engine_wait_s,
        "async/trainer_wait_s": trainer_wait_s,
        "async/overlap_frac": overlap_seconds(clip, trainer_busy) / length,
    }


def busy_union_seconds(intervals: Sequence[tuple[float, float]]) -> float:
    """Seconds covered by the union of (start, end) intervals."""
    total, end = 0.0, -math.inf
    for a, b in sorted(intervals):
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total


def overlap_seconds(first: Sequence[tuple[float, float]], second: Sequence[tuple[float, float]]) -> float:
    """Seconds in which both sets of intervals are busy (each set taken as its union)."""
    a, b = _merged(first), _merged(second)
    total, i, j = 0.0, 0, 0
    while i < len(a) and j < len(b):
        lo, hi = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        total += max(0.0, hi - lo)
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total


def _merged(intervals: Sequence[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[list[float]] = []
    for a, b in sorted(intervals):
        if merged and a <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], b)
        else:
            merged.append([a, b])
    return [(a, b) for a, b in merged]


def weight_sync_metrics(synced: Any) -> dict[str, float]:
    """`rollout.sync.dispatch.SyncStats` of the push after the update."""
    return {"weight_sync/seconds": synced.seconds, "weight_sync/gb_per_s": synced.gb_per_s}


def offload_metrics(offloaded: Optional[Any], onloaded: Optional[Any]) -> dict[str, float]:
    """`actor.offload.OffloadStats` of the step's offloads and onload; nothing without offload (None)."""
    if offloaded is None or onloaded is None:
        return {}
    return {
        "actor_offload/gb": offloaded.bytes / 1e9,
        "actor_offload/dropped_grads_gb": offloaded.dropped / 1e9,
        "actor_offload/offload_gb_per_s": offloaded.gb_per_s,
        "actor_offload/onload_gb_per_s": onloaded.gb_per_s,
    }


def throughput_metrics(step_seconds: float, train: Samples, epoch: int) -> dict[str, float]:
    """The step's duration, its tokens (prompts + responses of the train batch) per second, the epoch."""
    tokens = float(sum(len(p) + len(r) for p, r in zip(train.prompt_ids, train.response_ids)))
    return {
        f"{TIMING}{Phase.STEP}": step_seconds,
        "perf/tokens_per_s": tokens / step_seconds,
        "train/epoch": float(epoch),
    }


def validation_metrics(samples: Samples, n: int, seconds: float) -> dict[str, float]:
    """avg@n (`val/acc/mean@n`), unbiased pass@k (k = 1, 2, 4, ... below n, and n), maj@n, and the
    score and response lengths of `samples`, the n responses of every validation prompt."""
    results: dict[str, list] = {}
    for uid, pred, acc in zip(samples.uid, samples.pred, samples.acc):
        results.setdefault(uid, []).append((pred, acc))
    ks = sorted({k for k in _PASS_AT_K if k < n} | {n})
    at_k = aggregate_at_k(results, ks)
    lengths = _f64([len(x) for x in samples.response_ids])
    return {
        f"val/acc/mean@{n}": at_k[f"avg@{n}"],
        f"val/maj@{n}": at_k[f"maj@{n}"],
        **{f"val/pass@{k}": at_k[f"pass@{k}"] for k in ks},
        "val/score/mean": float(_f64(samples.score).mean()),
        "val/response_length/mean": float(lengths.mean()),
        "val/response_length/clip_ratio": float(_f64(samples.truncated).mean()),
        "val/num_prompts": float(len(results)),
        f"{TIMING}{Phase.VALIDATION}": seconds,
    }


def _f64(values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float64)


def _summary(name: str, values: torch.Tensor, which: Sequence[str] = ("mean", "max", "min")) -> dict[str, float]:
    return {f"{name}/{stat}": float(getattr(values, stat)()) for stat in which}
