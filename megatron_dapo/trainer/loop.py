"""The DAPO driver loop: the same program on every rank (torchrun / srun).

One step, as in the paper (Yu et al., 2025, Algorithm 1):

    repeat: sample gen_batch_size prompts -> n responses each -> reward (math + overlong penalty)
            -> keep the groups whose accuracy is not all equal            (dynamic sampling)
    until train_batch_size groups are kept
    old log-probs (and reference log-probs with a KL loss) -> group-normalised advantages
    -> actor update in ppo_mini_batch_size mini-batches (clip-higher, token-mean over the mini-batch)
    -> weight sync to the rollout engine -> metrics, validation, checkpoint

The GPU changes hands twice per step (`_actor_takes_gpu`, `_engine_takes_gpu`): the engine sleeps
(`rollout.sleep_level`) and the actor's offloaded state comes back (`actor.offload_*`) before the
log-probs; after the update grads and optimizer state go to host memory, the engine's weights wake,
the new weights are pushed, the actor's params go to host memory and only then does the engine's KV
cache wake. So the KV cache never shares the GPU with the actor state that is offloaded.

Every data-dependent decision (is the batch full? stop on SIGTERM?) is taken from values gathered
from all ranks, so no rank diverges and no collective hangs. A resumed run continues with the same
data order and generation seeds, so its steps equal those of an uninterrupted run.

SIGTERM (SLURM preemption, a time limit) is checked by all ranks together after each generation
batch and before the update, where the ranks are in step (they have just met in the gather of the
generation results), and after the step. Before the update the actor has not changed: the checkpoint
is the state at the step's start (the previous step, the prompt sampler and RNG as they were then),
and the resumed run redoes the step with the same prompts and seeds. After the update the step is
finished (weight sync, metrics) and saved. Either way the exit code is 143.
"""

from __future__ import annotations

import signal
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch

from megatron_dapo.config import Config
from megatron_dapo.trainer.samples import Samples, build_policy_batch, filter_metric, gather_samples, generate_and_score
from megatron_dapo.rollout.base import SamplingParams

EXIT_PREEMPTED = 143  # 128 + SIGTERM: the job was asked to stop and left a checkpoint


class TrainingInterrupted(SystemExit):
    """Raised after the checkpoint written on SIGTERM (exit code 143)."""


@dataclass(frozen=True)
class StepStart:
    """What a stop before the update puts back: the prompt sampler's and the RNGs' state at the step's start."""

    sampler: dict
    rng: dict

    @classmethod
    def capture(cls, sampler) -> "StepStart":
        from megatron_dapo.checkpoint.rng import capture_rng_state

        return cls(sampler=sampler.state_dict(), rng=capture_rng_state())


class DAPOTrainer:
    """Holds the parts of a run; `fit` is the loop."""

    def __init__(self, cfg: Config, runtime: Any, *, resume: bool = False, say=print) -> None:
        from megatron_dapo.actor import build_actor, build_reference
        from megatron_dapo.actor.offload import ActorOffload
        from megatron_dapo.algorithm.sampling import DynamicSamplingBuffer
        from megatron_dapo.data.dataset import datasets_from_config
        from megatron_dapo.data.sampler import PromptSampler
        from megatron_dapo.distributed.objects import data_parallel_rank_and_size, is_logging_rank
        from megatron_dapo.reward.loader import load_reward_function
        from megatron_dapo.reward.manager import RewardManager
        from megatron_dapo.rollout.group import RolloutGroup
        from megatron_dapo.trainer.startup import load_models

        self.cfg, self.runtime, self.say = cfg, runtime, say
        self.rank0 = is_logging_rank()
        self.dp_rank, self.dp_size = data_parallel_rank_and_size()
        self.tokenizer = runtime.tokenizer
        vocab = runtime.hf_config.vocab_size
        if cfg.algorithm.kl.use_kl_loss:  # the frozen reference: a second copy of the initial weights
            self.reference = build_reference(cfg, load_models(cfg, runtime.hf_config, runtime.ctx.layout), vocab)
        else:
            self.reference = None
        self.actor = build_actor(cfg, runtime.models, vocab)
        self.offload = ActorOffload.from_config(self.actor, cfg.actor)
        self.train_data, self.val_data = datasets_from_config(cfg, self.tokenizer)
        self._log_dataset(self.train_data)
        if self.val_data is not None:
            self._log_dataset(self.val_data)
        self.sampler = PromptSampler(len(self.train_data), cfg.trainer.gen_batch_size, shuffle=cfg.data.shuffle, seed=cfg.data.seed)
        a, r = cfg.algorithm, cfg.rollout
        self.reward = RewardManager(
            self.tokenizer,
            score_fn=load_reward_function(cfg.reward.custom_function.path, cfg.reward.custom_function.name),
            num_workers=cfg.reward.num_workers or _auto_reward_workers(),
            timeout_s=cfg.reward.timeout_s,
            overlong_enable=a.overlong_buffer.enable,
            overlong_buffer_length=a.overlong_buffer.len,
            overlong_penalty_factor=a.overlong_buffer.penalty_factor,
            max_response_length=r.max_response_length,
            min_reward=cfg.reward.min_reward,
        )
        self.buffer = DynamicSamplingBuffer(
            cfg.trainer.train_batch_size, r.n, a.filter_groups.max_num_gen_batches, enabled=a.filter_groups.enable
        )
        self.step = 0
        self._stop_requested = False
        self._last_saved_step: Optional[int] = None
        self.checkpoint_root = runtime.output_dir / "checkpoints"
        resumed = self._maybe_resume() if resume else False
        self.logger = self._make_logger(resumed)
        # With offload the engine starts on a GPU without the actor's state (vLLM sizes its pool from
        # the free memory), then the first push follows the order of every step.
        self.offload.offload()
        self.rollout = RolloutGroup.create(cfg, cfg.model.hf_dir, runtime.ctx.device)
        if self.offload.enabled:
            self.rollout.sleep()
            self.offload.onload("params")
        # The engine starts from the HF weights; after a resume (or a Megatron checkpoint) the actor's differ.
        first_sync, _ = self._engine_takes_gpu()
        self.say_rank0(
            f"weight sync: {self.rollout.sync_mode} (rollout.weight_sync_mode={cfg.rollout.weight_sync_mode}), "
            f"{first_sync['seconds']:.2f} s for the first push"
        )

    # ------------------------------------------------------------------ the loop

    def fit(self) -> dict[str, float]:
        from megatron_dapo.distributed.objects import any_rank
        from megatron_dapo.tracking import ProgressBar

        t = self.cfg.trainer
        previous = signal.signal(signal.SIGTERM, self._on_sigterm)
        last: dict[str, float] = {}
        try:
            with ProgressBar(t.total_steps, initial=self.step, enabled=self.rank0, desc="dapo") as progress:
                if self.step == 0 and t.val_before_train and self.val_data is not None:
                    self.logger.log(self.validate(), step=0)
                    if any_rank(self._stop_requested):  # in step: validation ends with a gather
                        self._exit_preempted(f"SIGTERM before step 1: checkpoint of step {self.step} written")
                while self.step < t.total_steps:
                    self.step += 1
                    metrics = self.train_step()
                    if self.val_data is not None and t.eval_every and (self.step % t.eval_every == 0 or self.step == t.total_steps):
                        metrics.update(self.validate())
                    self.logger.log(metrics, step=self.step)
                    progress.update(self.step, metrics)
                    last = metrics
                    if self.step == t.total_steps or (t.save_every and self.step % t.save_every == 0):
                        self.save()
                    if any_rank(self._stop_requested):
                        self._exit_preempted(f"SIGTERM: checkpoint of step {self.step} written")
        finally:
            signal.signal(signal.SIGTERM, previous)
            self.plot()
        return last

    def train_step(self) -> dict[str, float]:
        from megatron_dapo.actor import split_mini_batches
        from megatron_dapo.algorithm.advantage import grpo_advantages
        from megatron_dapo.data.sampler import shard_for_rank
        from megatron_dapo.tracking import PhaseTimer

        # On a GPU each phase ends with a synchronize, so kernels are charged to the phase that queued them.
        cfg, timer = self.cfg, PhaseTimer(synchronize=torch.cuda.synchronize if torch.cuda.is_available() else None)
        started = time.perf_counter()
        start = StepStart.capture(self.sampler)
        generated: list[Samples] = []
        # 1. Generate and score until train_batch_size prompt groups with mixed accuracy are kept.
        with timer.phase("gen"):
            while not self.buffer.is_full:  # `take` empties the buffer: every step generates at least once
                samples = self._generate_batch(len(generated))
                self._stop_before_update_if_asked(start)  # after the gather: every rank is here
                generated.append(samples)
                metric = filter_metric(samples, cfg.algorithm.filter_groups.metric)
                self.buffer.add(samples.as_fields(), metric=metric, group_ids=samples.uid, failures=samples.reward_error)
        sampling_stats = self.buffer.stats
        train = Samples.from_fields(self.buffer.take())
        # 2. Group-normalised advantages over the whole train batch (identical on every rank).
        advantages = grpo_advantages(torch.tensor(train.score), train.uid, norm_by_std=cfg.algorithm.norm_adv_by_std)
        rows = shard_for_rank(list(range(len(train))), self.dp_rank, self.dp_size)
        mine = Samples.from_fields({k: [v[i] for i in rows] for k, v in train.as_fields().items()})
        width = max(1, max(len(r) for r in mine.response_ids))
        batch = build_policy_batch(mine, advantages[rows], self.tokenizer.pad_token_id, width, cfg.algorithm.overlong_filter)
        onloaded = self._actor_takes_gpu(timer)
        # 3. Old-policy (and reference) log-probs of the responses.
        with timer.phase("old_log_prob"):
            batch.old_log_probs = self.actor.compute_log_probs(batch).cpu()  # the batch lives on the CPU
        if self.reference is not None:
            with timer.phase("ref"):
                batch.ref_log_probs = self.reference.compute_log_probs(batch).cpu()
        mismatch = self._mismatch(batch)
        self._stop_before_update_if_asked(start)
        # 4. The update: ppo_mini_batch_size prompts per optimizer step, exact global token-mean.
        num_mini_batches = cfg.trainer.train_batch_size // cfg.trainer.ppo_mini_batch_size
        with timer.phase("update"):
            actor_metrics = self.actor.update(split_mini_batches(batch, num_mini_batches))
        # 5. The rollout engine generates with the new weights from the next step on.
        sync_stats, offloaded = self._engine_takes_gpu(timer)
        step_seconds = time.perf_counter() - started
        if not self.offload.enabled:
            offload_metrics = {}
        else:
            offload_metrics = {
                "actor_offload/gb": offloaded.bytes / 1e9,
                "actor_offload/dropped_grads_gb": offloaded.dropped / 1e9,
                "actor_offload/offload_gb_per_s": offloaded.gb_per_s,
                "actor_offload/onload_gb_per_s": onloaded.gb_per_s,
            }
        return {
            **self._batch_metrics(train, advantages, generated, sampling_stats),
            **_actor_metric_names(actor_metrics),
            **mismatch,
            **{f"weight_sync/{k}": v for k, v in sync_stats.items()},
            **offload_metrics,
            **timer.metrics(),
            "timing_s/step": step_seconds,
            "perf/tokens_per_s": self._tokens(train) / step_seconds,
            "train/epoch": float(self.sampler.epoch),
        }

    def validate(self) -> dict[str, float]:
        """avg@n, unbiased pass@k (k = 1, 2, 4, ..., n) and maj@n over the validation set."""
        from megatron_dapo.algorithm.metrics import aggregate_at_k

        r = self.cfg.rollout
        started = time.perf_counter()
        share, shares = self.rollout.data_rank, self.rollout.data_size  # this rank's engine's share of the prompts
        bounds = torch.linspace(0, len(self.val_data), shares + 1).round().long().tolist()
        examples = [self.val_data[i] for i in range(bounds[share], bounds[share + 1])]
        params = SamplingParams(
            n=r.val_n, temperature=r.val_temperature, top_p=r.val_top_p, top_k=r.top_k,
            max_new_tokens=r.max_response_length, stop=tuple(r.stop), seed=_mix_seed(r.seed, -1, 0, share),
            seed_per_prompt=True,  # validation scores must not depend on how the engine batches
        )  # fmt: skip
        local = generate_and_score(
            self.rollout, self.reward, examples, params, uid_prefix=f"val{share}:", validating=True,
            apply_overlong=self.cfg.algorithm.overlong_buffer.apply_in_validation,
        )  # fmt: skip
        samples = gather_samples(local, order_key=share)
        results: dict[str, list] = {}
        for uid, pred, acc in zip(samples.uid, samples.pred, samples.acc):
            results.setdefault(uid, []).append((pred, acc))
        ks = sorted({k for k in (1, 2, 4, 8, 16, 32, 64, 128) if k < r.val_n} | {r.val_n})
        at_k = aggregate_at_k(results, ks)
        metrics = {f"val/acc/mean@{r.val_n}": at_k[f"avg@{r.val_n}"], f"val/maj@{r.val_n}": at_k[f"maj@{r.val_n}"]}
        metrics.update({f"val/pass@{k}": at_k[f"pass@{k}"] for k in ks})
        lengths = torch.tensor([len(x) for x in samples.response_ids], dtype=torch.float64)
        metrics.update({
            "val/score/mean": float(torch.tensor(samples.score, dtype=torch.float64).mean()),
            "val/response_length/mean": float(lengths.mean()),
            "val/response_length/clip_ratio": float(torch.tensor(samples.truncated, dtype=torch.float64).mean()),
            "val/num_prompts": float(len(results)),
            "timing_s/validation": time.perf_counter() - started,
        })  # fmt: skip
        return metrics

    # ------------------------------------------------------------------ pieces of a step

    def _generate_batch(self, gen_index: int) -> Samples:
        """One generation batch: gen_batch_size prompts (this replica's share generated here), all ranks' samples."""
        from megatron_dapo.data.sampler import shard_for_rank

        r = self.cfg.rollout
        share, shares = self.rollout.data_rank, self.rollout.data_size  # this rank's engine's share of the prompts
        indices = shard_for_rank(self.sampler.next_batch(), share, shares)
        params = SamplingParams(
            n=r.n, temperature=r.temperature, top_p=r.top_p, top_k=r.top_k, max_new_tokens=r.max_response_length,
            stop=tuple(r.stop), seed=_mix_seed(r.seed, self.step, gen_index, share), seed_per_prompt=r.seed_per_prompt,
        )  # fmt: skip
        local = generate_and_score(
            self.rollout, self.reward, [self.train_data[i] for i in indices], params,
            uid_prefix=f"s{self.step}g{gen_index}r{share}p",
        )  # fmt: skip
        return gather_samples(local, order_key=share)

    def _mismatch(self, batch) -> dict[str, float]:
        """|rollout - trainer| log-prob statistics of the train batch, all replicas pooled (`rollout_mismatch/*`)."""
        from functools import reduce

        from megatron_dapo.distributed.objects import gather_from_leaders
        from megatron_dapo.algorithm.mismatch import log_prob_mismatch

        stats = log_prob_mismatch(batch.rollout_log_probs, batch.old_log_probs, batch.response_valid_mask())
        return reduce(lambda a, b: a.merge(b), gather_from_leaders(stats)).as_metrics()

    def _stop_before_update_if_asked(self, start: StepStart) -> None:
        """On SIGTERM (seen by any rank), save the state at the start of this step and exit with 143.

        The actor has not changed yet, so the checkpoint is the previous step's, with the prompt
        sampler and the RNGs put back to where this step began: `--resume` redoes the step with the
        same prompts and seeds. A collective (`any_rank`) on the default group: call it only where
        the ranks are in step, i.e. after the gather of a generation batch, never while an engine
        may still be generating (that wait belongs to the gather group, `rollout.gather_timeout_s`).
        """
        from megatron_dapo.checkpoint.rng import restore_rng_state
        from megatron_dapo.distributed.objects import any_rank

        if not any_rank(self._stop_requested):
            return
        interrupted = self.step
        self.step -= 1
        self.sampler.load_state_dict(start.sampler)
        restore_rng_state(start.rng)
        self._exit_preempted(f"SIGTERM during step {interrupted}, before its update: checkpoint of step {self.step} written")

    def _exit_preempted(self, what: str) -> None:
        """Save the current state (unless saved already), say so, exit with 143 (every rank)."""
        self.save()
        self.say_rank0(f"{what}; continue with --resume")
        raise TrainingInterrupted(EXIT_PREEMPTED)

    def _actor_takes_gpu(self, timer=None):
        """The engine sleeps, then the actor's offloaded state comes back. Returns the onload's `OffloadStats`."""
        self.rollout.sleep()
        with self._phase(timer, "onload", self.offload.enabled):
            return self.offload.onload()

    def _engine_takes_gpu(self, timer=None, push: bool = True):
        """After an update: grads + optimizer to host -> engine weights wake -> weight sync -> params to
        host -> engine KV cache wakes. Returns the sync's figures and the offloads' `OffloadStats`.
        `push=False` (the engine still holds the actor's current weights) skips the sync."""
        with self._phase(timer, "offload", self.offload.enabled):
            moved = self.offload.offload("grads", "optimizer")
        self.rollout.wake_up(["weights"])
        sync_stats = {}
        if push:
            with self._phase(timer, "sync"):
                sync_stats = self._sync_weights()
        with self._phase(timer, "offload", self.offload.enabled):
            moved += self.offload.offload("params")
        self.rollout.wake_up(["kv_cache"])
        return sync_stats, moved

    @staticmethod
    def _phase(timer, name: str, timed: bool = True):
        """`timer.phase(name)`, or nothing when there is no timer (start-up, checkpoints) or nothing to time."""
        from contextlib import nullcontext

        return timer.phase(name) if timer is not None and timed else nullcontext()

    def _sync_weights(self) -> dict[str, float]:
        stats = self.rollout.sync_weights(self.actor.models, self.runtime.hf_config, self.cfg.rollout.weight_sync_bucket_mb)
        return {"seconds": stats.seconds, "gb_per_s": stats.gb_per_s}

    def _batch_metrics(self, train: Samples, advantages, generated: list[Samples], sampling: dict) -> dict[str, float]:
        f64 = torch.float64
        scores = torch.tensor(train.task_score, dtype=f64)
        rewards = torch.tensor(train.score, dtype=f64)
        lengths = torch.tensor([len(x) for x in train.response_ids], dtype=f64)
        prompt_lengths = torch.tensor([len(x) for x in train.prompt_ids], dtype=f64)
        everything = Samples.concat(generated)
        penalty = torch.tensor(everything.overlong_penalty, dtype=f64)
        return {
            "critic/score/mean": float(scores.mean()),
            "critic/score/max": float(scores.max()),
            "critic/score/min": float(scores.min()),
            "critic/rewards/mean": float(rewards.mean()),
            "critic/rewards/max": float(rewards.max()),
            "critic/rewards/min": float(rewards.min()),
            "critic/advantages/mean": float(advantages.double().mean()),
            "critic/advantages/max": float(advantages.max()),
            "critic/advantages/min": float(advantages.min()),
            "critic/acc/mean": float(torch.tensor(train.acc, dtype=f64).mean()),
            "train/acc_all_generated": float(torch.tensor(everything.acc, dtype=f64).mean()),
            "train/score_all_generated": float(torch.tensor(everything.task_score, dtype=f64).mean()),
            "train/overlong_penalty_mean": float(penalty.mean()),
            "train/overlong_penalised_frac": float((penalty < 0).double().mean()),
            "response_length/mean": float(lengths.mean()),
            "response_length/max": float(lengths.max()),
            "response_length/min": float(lengths.min()),
            "response_length/clip_ratio": float(torch.tensor(train.truncated, dtype=f64).mean()),
            "prompt_length/mean": float(prompt_lengths.mean()),
            "prompt_length/max": float(prompt_lengths.max()),
            **{f"train/{k}": float(v) for k, v in sampling.items()},
        }

    @staticmethod
    def _tokens(samples: Samples) -> float:
        return float(sum(len(p) + len(r) for p, r in zip(samples.prompt_ids, samples.response_ids)))

    # ------------------------------------------------------------------ checkpoints, logging

    def save(self) -> Optional[Path]:
        from megatron_dapo.checkpoint import save_checkpoint

        if self._last_saved_step == self.step:
            return None
        away = bool(self.offload.offloaded)
        if away:  # the checkpoint reads the actor's state: the GPU changes hands once more
            self._actor_takes_gpu()
        t = self.cfg.trainer
        # Periodic (and SIGTERM) saves in checkpoint_format; the one after the last step can be fully
        # reshardable, so a finished run continues at any layout.
        final = self.step >= t.total_steps and t.final_checkpoint_reshardable
        path = save_checkpoint(
            self.checkpoint_root, self.step, self.actor.models, self.actor.optimizer, self.actor.scheduler,
            trainer_state={"step": self.step, "sampler": self.sampler.state_dict()},
            config=self.cfg, hf_dir=self.cfg.model.hf_dir, keep_last=t.keep_last,
            optimizer_format="fully_reshardable" if final else t.checkpoint_format,
            write_threads=t.checkpoint_write_threads,
        )  # fmt: skip
        if away:  # the engine already has these weights, unless a deep sleep discarded them
            self._engine_takes_gpu(push=self.rollout.sleep_discards_weights)
        self._last_saved_step = self.step
        self.plot()  # a run killed later still has its curves up to here
        return path

    def _maybe_resume(self) -> bool:
        from megatron_dapo.checkpoint import load_latest_checkpoint

        # The newest intact checkpoint: damaged ones (checksums, missing or cut files, a bad
        # trainer_state.json) are passed over and named; none intact at all is a named error.
        loaded = load_latest_checkpoint(
            self.checkpoint_root, self.actor.models, self.actor.optimizer, self.actor.scheduler,
            required_state=("step", "sampler"),
        )  # fmt: skip
        if loaded is None:
            self.say_rank0(f"--resume: no checkpoint under {self.checkpoint_root}; starting from step 0")
            return False
        state = loaded.trainer_state
        self.step = int(state["step"])
        self.sampler.load_state_dict(state["sampler"])
        self._last_saved_step = self.step
        self.say_rank0(f"resumed from {loaded.path} at step {self.step}" + "".join(f"\n  note: {n}" for n in loaded.notes))
        return True

    def _make_logger(self, resumed: bool):
        from megatron_dapo.config import config_to_dict
        from megatron_dapo.tracking import MetricsLogger

        from megatron_dapo.trainer.startup import remove_run_logs

        t = self.cfg.trainer
        if self.rank0 and not resumed:  # `--resume` without a checkpoint: the logs of an attempt that left none
            remove_run_logs(self.runtime.output_dir)
        return MetricsLogger(
            self.runtime.output_dir, t.loggers, experiment_name=t.experiment_name, config=config_to_dict(self.cfg),
            enabled=self.rank0, resume_step=self.step if resumed else None,
        )  # fmt: skip

    def plot(self) -> Optional[Path]:
        from megatron_dapo.tracking import plot_metrics

        metrics_file = self.runtime.output_dir / "metrics.jsonl"
        if not self.rank0 or not metrics_file.exists():
            return None
        try:
            return plot_metrics(metrics_file, self.runtime.output_dir / "plot.png", title=self.cfg.trainer.experiment_name)
        except ImportError as error:  # matplotlib is an optional extra
            self.say(f"plot skipped: {error}")
            return None

    def _log_dataset(self, dataset) -> None:
        self.say_rank0(f"{dataset.name} data: {dataset.stats.describe()}")

    def _on_sigterm(self, signum, frame) -> None:
        self._stop_requested = True  # acted on by every rank together: after this generation batch, before the update or after the step

    def say_rank0(self, text: str) -> None:
        if self.rank0:
            self.say(text)

    def close(self) -> None:
        self.logger.close()
        self.reward.close()
        self.rollout.shutdown()


# ------------------------------------------------------------------ helpers


_ACTOR_NAMES = {
    "clipfrac": "pg_clipfrac",
    "clipfrac_high": "pg_clipfrac_higher",
    "clipfrac_low": "pg_clipfrac_lower",
    "dual_clipfrac": "pg_clipfrac_dual",
    "approx_kl": "ppo_kl",
}


def _actor_metric_names(metrics: dict[str, float]) -> dict[str, float]:
    """The actor's update statistics under verl's names (`actor/pg_clipfrac`, `actor/ppo_kl`, ...)."""
    return {f"actor/{_ACTOR_NAMES.get(k, k)}": float(v) for k, v in metrics.items()}


def _mix_seed(base: int, step: int, gen_index: int, replica: int) -> int:
    """A generation seed that depends only on (run seed, step, generation batch, replica): resumable."""
    return (base * 1_000_003 + (step + 1) * 10_007 + gen_index * 101 + replica) % (2**31 - 1)


def _auto_reward_workers() -> int:
    import os

    return max(1, min(8, (os.cpu_count() or 1)))


def train(cfg: Config, *, resume: bool = False, overwrite: bool = False, say=print) -> dict[str, float]:
    """Run DAPO training as configured (every rank calls it); returns the last step's metrics.

    A non-empty `trainer.output_dir` needs `resume` (continue the run there) or `overwrite` (delete
    that run's checkpoints and logs first); see `runtime.check_output_dir`."""
    from megatron_dapo.distributed.setup import teardown
    from megatron_dapo.trainer.startup import start, write_resolved_config

    runtime = start(cfg, say=say, resume=resume, overwrite=overwrite)
    write_resolved_config(cfg, runtime.output_dir)
    trainer = DAPOTrainer(cfg, runtime, resume=resume, say=say)
    try:
        return trainer.fit()
    finally:
        trainer.close()
        teardown()
