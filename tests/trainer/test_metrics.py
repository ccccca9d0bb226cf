"""The names and values of the trainer's metrics (`trainer.metrics`), computed on hand-made samples."""

from __future__ import annotations

import math

import pytest
import torch

from megatron_dapo.actor.offload import OffloadStats
from megatron_dapo.algorithm.mismatch import MismatchStats
from megatron_dapo.trainer import metrics
from megatron_dapo.trainer.samples import Samples

from tests.support.samples import make_samples


def test_batch_metrics_of_the_train_batch_and_of_everything_generated():
    train = make_samples(seed=1, num_prompts=2, n=3)
    other = make_samples(seed=2, num_prompts=1, n=3)
    advantages = torch.tensor([-1.0, 0.5, 0.5, 1.5, -0.5, -1.0])
    m = metrics.batch_metrics(train, advantages, [train, other], {"num_gen_batches": 2, "num_groups_kept": 2})
    assert m["critic/score/mean"] == pytest.approx(sum(train.task_score) / 6)
    assert m["critic/score/max"] == 1.0 and m["critic/score/min"] == 0.0
    assert m["critic/rewards/mean"] == pytest.approx(sum(train.score) / 6)
    assert m["critic/advantages/mean"] == pytest.approx(0.0) and m["critic/advantages/max"] == 1.5
    assert m["critic/acc/mean"] == 0.5
    everything = Samples.concat([train, other])
    assert m["train/acc_all_generated"] == pytest.approx(sum(everything.acc) / 9)
    assert m["train/overlong_penalised_frac"] == pytest.approx(sum(p < 0 for p in everything.overlong_penalty) / 9)
    assert m["response_length/max"] == max(len(r) for r in train.response_ids)
    assert m["response_length/clip_ratio"] == pytest.approx(sum(train.truncated) / 6)
    assert m["prompt_length/mean"] == pytest.approx(sum(len(p) for p in train.prompt_ids) / 6)
    assert "prompt_length/min" not in m
    assert m["train/num_gen_batches"] == 2.0 and m["train/num_groups_kept"] == 2.0
    assert all(isinstance(v, float) for v in m.values())


def test_actor_statistics_take_verl_names():
    update = {"loss": 0.5, "clipfrac": 0.1, "clipfrac_high": 0.07, "clipfrac_low": 0.03, "dual_clipfrac": 0.0, "approx_kl": 1e-3}
    assert metrics.actor_metrics(update) == {
        "actor/loss": 0.5, "actor/pg_clipfrac": 0.1, "actor/pg_clipfrac_higher": 0.07, "actor/pg_clipfrac_lower": 0.03,
        "actor/pg_clipfrac_dual": 0.0, "actor/ppo_kl": 1e-3,
    }  # fmt: skip


def test_mismatch_offload_and_throughput_names():
    stats = MismatchStats(sum_abs_diff=2.0, sum_k3=0.5, num_tokens=4, max_abs_diff=1.0)
    assert set(metrics.mismatch_metrics(stats)) == {f"rollout_mismatch/{k}" for k in ("mean_abs", "max_abs", "k3_kl", "tokens")}
    assert metrics.offload_metrics(None, None) == {}
    moved = metrics.offload_metrics(OffloadStats(bytes=3_000_000_000, seconds=2.0, dropped=1_000_000_000), OffloadStats(bytes=10, seconds=1.0))
    assert moved["actor_offload/gb"] == 3.0 and moved["actor_offload/dropped_grads_gb"] == 1.0
    assert moved["actor_offload/offload_gb_per_s"] == 1.5
    train = make_samples(seed=3, num_prompts=1, n=2)
    tokens = sum(len(p) + len(r) for p, r in zip(train.prompt_ids, train.response_ids))
    assert metrics.throughput_metrics(2.0, train, epoch=1) == {"timing_s/step": 2.0, "perf/tokens_per_s": tokens / 2.0, "train/epoch": 1.0}


def test_validation_metrics_at_k():
    # Two prompts, n=4: prompt a right twice, prompt b never.
    samples = make_samples(seed=5, num_prompts=2, n=4)
    samples.uid = ["a"] * 4 + ["b"] * 4
    samples.acc = [True, False, True, False] + [False] * 4
    samples.pred = ["2", "3", "2", "3"] + ["9"] * 4
    m = metrics.validation_metrics(samples, n=4, seconds=1.5)
    assert set(m) == {"val/acc/mean@4", "val/maj@4", "val/pass@1", "val/pass@2", "val/pass@4", "val/score/mean",
                      "val/response_length/mean", "val/response_length/clip_ratio", "val/num_prompts", "timing_s/validation"}  # fmt: skip
    assert m["val/acc/mean@4"] == m["val/pass@1"] == 0.25
    assert m["val/pass@4"] == 0.5
    assert m["val/pass@2"] == pytest.approx((1 - 1 / 6) / 2)  # prompt a: 1 - C(2,2)/C(4,2)
    assert m["val/num_prompts"] == 2.0 and m["timing_s/validation"] == 1.5


def test_wall_clock_names_are_the_ones_that_may_differ_between_equal_runs():
    for name in ("timing_s/gen", "perf/tokens_per_s", "weight_sync/seconds", "actor_offload/onload_gb_per_s"):
        assert metrics.is_wall_clock(name)
    for name in ("critic/score/mean", "actor/grad_norm", "actor_offload/gb", "rollout_mismatch/mean_abs", "val/pass@1"):
        assert not metrics.is_wall_clock(name)
    timer = metrics.step_timer()
    with timer.phase(metrics.Phase.GEN):
        pass
    assert list(timer.metrics()) == ["timing_s/gen"]


def test_sft_metrics_names_and_perplexity():
    record = metrics.sft_metrics({"loss": 2.0, "grad_norm": 0.5, "lr": 1e-5, "tokens": 96.0, "clipfrac": 0.0})
    assert sorted(record) == ["sft/grad_norm", "sft/loss", "sft/lr", "sft/perplexity", "sft/tokens"]
    assert record["sft/perplexity"] == pytest.approx(7.389056, rel=1e-6) and record["sft/tokens"] == 96.0
    assert math.isfinite(metrics.sft_metrics({"loss": 1e4, "grad_norm": 0.0, "lr": 0.0, "tokens": 1.0})["sft/perplexity"])
