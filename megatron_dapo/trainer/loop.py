"""The DAPO driver loop: the same program on every rank (torchrun / srun).

One step, as in the paper (Yu et al., 2025, Algorithm 1):

    repeat: sample gen_batch_size prompts -> n responses each -> reward (math + overlong penalty)
            -> keep the groups whose accuracy is not all equal            (dynamic sampling)
    until train_batch_size groups are kept
    old log-probs (and reference log-probs with a KL loss) -> group-normalised advantages
    -> actor update in ppo_mini_batch_size mini-batches (clip-higher, token-mean over the mini-batch)
    -> weight sync to the rollout engine -> metrics, validation, checkpoint

Every data-dependent decision (is the batch full? stop on SIGTERM?) is taken from values gathered
from all ranks, so no rank diverges and no collective hangs. A resumed run continues with the same
data order and generation seeds, so its steps equal those of an uninterrupted run.

The rest of a run lives beside this file: `parts` (what is built from the config), `handover` (the
GPU between engine and actor), `preemption` (SIGTERM), `checkpointing`, `validation`, `metrics`
(every metric name), `seeds`, `samples` (generate, score, the actor's batch), `output_dir`.
"""

from __future__ import annotations

import dataclasses
import math
import time
from contextlib import nullcontext
from functools import reduce
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist

from megatron_dapo.actor import split_mini_batches
from megatron_dapo.actor.offload import ActorOffload
from megatron_dapo.actor.routing import routing_dtype
from megatron_dapo.algorithm.advantage import grpo_advantages
from megatron_dapo.algorithm.mismatch import log_prob_mismatch
from megatron_dapo.config import Config, engine_returns_routing
from megatron_dapo.data.sampler import shard_for_rank
from megatron_dapo.distributed import liveness
from megatron_dapo.distributed.objects import data_parallel_rank_and_size, gather_from_leaders, is_logging_rank, meeting_group
from megatron_dapo.distributed.layout import ParallelLayout
from megatron_dapo.distributed.setup import teardown
from megatron_dapo.rollout.base import SamplingParams
from megatron_dapo.tracking import ProgressBar
from megatron_dapo.trainer import async_state, metrics, validation
from megatron_dapo.trainer.checkpointing import resume_run, save_run_checkpoint
from megatron_dapo.trainer.handover import start_engine
from megatron_dapo.trainer.metrics import Phase
from megatron_dapo.trainer.output_dir import checkpoints_dir, metrics_file_state, open_metrics_logger, plot_run, write_resolved_config
from megatron_dapo.trainer.parts import build_policies, build_prompt_sampler, build_reward_manager, build_sampling_buffer, load_datasets
from megatron_dapo.trainer.preemption import EXIT_PREEMPTED, SigtermFlag, StepStart, TrainingInterrupted
from megatron_dapo.trainer.remote_rollout import GenerateShare
from megatron_dapo.trainer.rollout_worker import serve_rollout
from megatron_dapo.trainer.routing_exchange import RoutingStore, fetch_routing
from megatron_dapo.trainer.samples import Samples, build_policy_batch, filter_metric, gather_samples, generate_and_score
from megatron_dapo.trainer.seeds import generation_seed
from megatron_dapo.trainer.staleness import batches_ahead, oldest_version, staleness
from megatron_dapo.trainer.startup import Runtime, start

__all__ = ["EXIT_PREEMPTED", "DAPOTrainer", "TrainingInterrupted", "train"]


class DAPOTrainer:
    """Holds the parts of a run; `fit` is the loop, `train_step` one step."""

    def __init__(self, cfg: Config, runtime: Runtime, *, resume: bool = False, say=print) -> None:
        self.cfg, self.runtime, self.say = cfg, runtime, say
        self.rank0 = is_logging_rank()
        self.dp_rank, self.dp_size = data_parallel_rank_and_size()
        self.tokenizer = runtime.tokenizer
        self.actor, self.reference = build_policies(cfg, runtime)
        self.offload = ActorOffload.from_config(self.actor, cfg.actor)
        self.train_data, self.val_data = load_datasets(cfg, self.tokenizer, say=self.say_rank0)
        self.sampler = build_prompt_sampler(cfg, len(self.train_data))
        layout = runtime.ctx.layout
        # The separate placement scores beside its engines, on the rollout ranks.
        self.reward = build_reward_manager(cfg, self.tokenizer) if not layout.separate else None
        self.buffer = build_sampling_buffer(cfg)
        self.max_staleness = cfg.trainer.max_staleness
        self._gen_indices: dict[int, int] = {}  # step -> generation batches handed out for it so far
        self._kept_per_batch: Optional[float] = None  # informative groups per generation batch, so far
        self._async_restore: Optional[dict] = None  # a resumed asynchronous run's saved state, until the engines start
        # Asynchronous training keeps no routing of the groups it carries over (the config check refuses
        # r3 there): the embedded engine's, asked for by default for the mismatch metrics, is not asked.
        self.engine_routing = engine_returns_routing(cfg, runtime.hf_config.is_moe)
        # The engine's routing stays in host memory in its compact type (1 byte an entry up to 128 experts).
        self.routing_dtype = routing_dtype(runtime.hf_config.num_experts) if self.engine_routing else torch.int32
        # ... kept by the rank that generated it until the train batch is chosen, then sent to the one
        # replica that trains on it (`routing_exchange`): no rank holds the whole batch's routing.
        self.routing_store = RoutingStore() if self.engine_routing else None
        self.step = 0
        self.sigterm = SigtermFlag()
        self._last_saved_step: Optional[int] = None
        self._plotted_from: Optional[tuple[int, int]] = None  # the metrics file the plot was last drawn from
        self.checkpoint_root = checkpoints_dir(runtime.output_dir)
        resumed = self._resume() if resume else False
        self.logger = open_metrics_logger(cfg, runtime.output_dir, enabled=self.rank0, resume_step=self.step if resumed else None)
        liveness.configure(window_s=cfg.rollout.liveness_window_s, limit_s=cfg.rollout.gather_timeout_s)
        self.handover, first_push = start_engine(
            cfg, layout, self.actor, self.offload, runtime.hf_config, runtime.ctx.device, bridge=runtime.ctx.bridge,
            weight_version=self.step,
        )  # fmt: skip
        self.rollout = self.handover.rollout
        self._restore_async()
        self.say_rank0(
            f"weight sync: {self.rollout.sync_mode} (rollout.weight_sync_mode={cfg.rollout.weight_sync_mode}), "
            f"{first_push.seconds:.2f} s for the first push"
        )

    # ------------------------------------------------------------------ the loop

    def fit(self) -> dict[str, float]:
        t = self.cfg.trainer
        last: dict[str, float] = {}
        try:
            with self.sigterm, ProgressBar(t.total_steps, initial=self.step, enabled=self.rank0, desc="dapo") as progress:
                if self.step == 0 and t.val_before_train and self.val_data is not None:
                    self.logger.log(self.validate(), step=0)
                    if self.sigterm.asked():  # in step: validation ends with a gather
                        self._exit_preempted(f"SIGTERM before step 1: checkpoint of step {self.step} written")
                while self.step < t.total_steps:
                    self.step += 1
                    step_metrics = self.train_step()
                    if self.val_data is not None and t.eval_every and (self.step % t.eval_every == 0 or self.step == t.total_steps):
                        step_metrics.update(self.validate())
                    self.logger.log(step_metrics, step=self.step)
                    progress.update(self.step, step_metrics)
                    last = step_metrics
                    if self.step == t.total_steps or (t.save_every and self.step % t.save_every == 0):
                        self.save()
                    if self.sigterm.asked():
                        self._exit_preempted(f"SIGTERM: checkpoint of step {self.step} written")
        finally:
            self.plot()
        return last

    def train_step(self) -> dict[str, float]:
        cfg, timer = self.cfg, metrics.step_timer()
        started, started_wall = time.perf_counter(), time.time()
        start = StepStart.capture(self.sampler)
        generated: list[Samples] = []
        # 1. Generate and score until train_batch_size prompt groups with mixed accuracy are kept
        #    (asynchronous: first what the engines generated ahead, dropping groups grown too old).
        with timer.phase(Phase.GEN):
            if self.max_staleness:
                self.buffer.drop_stale("weight_version", oldest=oldest_version(self.step, self.max_staleness))
            while not self.buffer.is_full:  # `take` empties the buffer: every step generates at least once
                try:
                    with self._call_off_on_sigterm():
                        samples = self._generate_batch(len(generated))
                except liveness.MeetingCalledOff:
                    self._exit_called_off(start)
                self._stop_before_update_if_asked(start)  # after the gather: every rank is here
                if self._too_old(samples):  # aged in flight while carried groups filled the steps before
                    self.buffer.note_stale(len(samples) // cfg.rollout.n)
                    continue
                generated.append(samples)
                metric = filter_metric(samples, cfg.algorithm.filter_groups.metric)
                self.buffer.add(samples.as_fields(), metric=metric, group_ids=samples.uid, failures=samples.reward_error)
        sampling_stats = self.buffer.stats
        train = Samples.from_fields(self.buffer.take())
        # Asynchronous: the engines generate the next step's prompts (with the weights this step
        # starts from) while this step trains.
        ahead = self._generate_ahead(sampling_stats) if self.max_staleness else {}
        trainer_started = time.time()
        # 2. Group-normalised advantages over the whole train batch (identical on every rank).
        advantages = grpo_advantages(torch.tensor(train.score), train.uid, norm_by_std=cfg.algorithm.norm_adv_by_std)
        batch = self._policy_batch(train, advantages)
        onloaded = self.handover.to_actor(timer)
        # 3. Old-policy (and reference) log-probs of the responses; MoE: the routing the update replays.
        with timer.phase(Phase.OLD_LOG_PROB):
            routing_mismatch = self._old_log_probs(batch)
        if self.reference is not None:
            with timer.phase(Phase.REF):  # the reference routes as it likes: the KL is to that policy
                batch.ref_log_probs = self.reference.compute_log_probs(dataclasses.replace(batch, routed_experts=None)).cpu()
        mismatch = {**self._mismatch(batch), **routing_mismatch}
        self._stop_before_update_if_asked(start)
        # 4. The update: ppo_mini_batch_size prompts per optimizer step, exact global token-mean.
        num_mini_batches = cfg.trainer.train_batch_size // cfg.trainer.ppo_mini_batch_size
        with timer.phase(Phase.UPDATE):
            update = self.actor.update(split_mini_batches(batch, num_mini_batches))
        # 5. The rollout engine generates with the new weights from the next step on.
        synced, offloaded = self.handover.to_engine(timer)
        step_seconds = time.perf_counter() - started
        timeline = self._timeline(started_wall, trainer_started, timer)
        return {
            **metrics.batch_metrics(train, advantages, generated, sampling_stats),
            **(metrics.staleness_metrics([staleness(self.step, v) for v in train.weight_version], self.max_staleness) if train.weight_version else {}),
            **(metrics.token_staleness_metrics(self.step, train.version_spans, [len(r) for r in train.response_ids]) if train.version_spans else {}),
            **ahead,
            **timeline,
            **metrics.actor_metrics(update),
            **mismatch,
            **metrics.weight_sync_metrics(synced),
            **(metrics.offload_metrics(offloaded, onloaded) if self.offload.enabled else {}),
            **timer.metrics(),
            **metrics.throughput_metrics(step_seconds, train, self.sampler.epoch),
        }

    def validate(self) -> dict[str, float]:
        """avg@n, unbiased pass@k (k = 1, 2, 4, ..., n) and maj@n over the validation set."""
        return validation.validate(self.cfg, self.rollout, self.reward, self.val_data)

    # ------------------------------------------------------------------ pieces of a step

    def _generate_batch(self, gen_index: int) -> Samples:
        """One generation batch: gen_batch_size prompts (this replica's share generated here), all ranks' samples."""
        if self.rollout.placement == "separate":
            return self._generate_batch_remote(gen_index)
        r = self.cfg.rollout
        share, shares = self.rollout.data_rank, self.rollout.data_size  # this rank's engine's share of the prompts
        indices = shard_for_rank(self.sampler.next_batch(), share, shares)
        params = SamplingParams(
            n=r.n, temperature=r.temperature, top_p=r.top_p, top_k=r.top_k, max_new_tokens=r.max_response_length,
            stop=tuple(r.stop), seed=generation_seed(r.seed, self.step, gen_index, share), seed_per_prompt=r.seed_per_prompt,
            return_routed_experts=self.engine_routing,
        )  # fmt: skip
        during, call_off = self._generation_call_off()
        local = generate_and_score(
            self.rollout, self.reward, [self.train_data[i] for i in indices], params,
            uid_prefix=f"s{self.step}g{gen_index}r{share}p", routing_dtype=self.routing_dtype,
            during_generate=during, call_off=call_off,
        )  # fmt: skip
        return gather_samples(local, order_key=share, routing_store=self.routing_store)

    def _generate_batch_remote(self, gen_index: int) -> Samples:
        """The separate placement's generation batch: the oldest one the engines generate ahead, or
        else a new one for this step; all samples on every trainer rank."""
        if not self.rollout.inflight:
            self._submit_generation(self.step)
        return self.rollout.collect(routing_store=self.routing_store)

    def _submit_generation(self, step: int) -> None:
        """Hand the engines one generation batch of the next gen_batch_size prompts, labelled for
        `step` (its uids and seeds: every engine its share, the shares and seeds of a colocated run
        with as many engines)."""
        r, batch = self.cfg.rollout, self.sampler.next_batch()
        gen_index = self._gen_indices.get(step, 0)
        self._gen_indices = {s: n for s, n in self._gen_indices.items() if s >= self.step} | {step: gen_index + 1}
        shares = self.rollout.data_size
        requests = []
        for share in range(shares):
            params = SamplingParams(
                n=r.n, temperature=r.temperature, top_p=r.top_p, top_k=r.top_k, max_new_tokens=r.max_response_length,
                stop=tuple(r.stop), seed=generation_seed(r.seed, step, gen_index, share), seed_per_prompt=r.seed_per_prompt,
                return_routed_experts=self.engine_routing,
            )  # fmt: skip
            examples = [self.train_data[i] for i in shard_for_rank(batch, share, shares)]
            requests.append(GenerateShare(examples, params, f"s{step}g{gen_index}r{share}p", routing_dtype=self.routing_dtype))
        self.rollout.submit(requests)

    def _timeline(self, started: float, trainer_started: float, timer) -> dict[str, float]:
        """The separate placement's `async/*` timeline of this step (the head knows the engines'; the
        other ranks report none): engines busy / waiting, trainer waiting, overlap."""
        if self.rollout.placement != "separate" or self.rollout.bridge is None:
            return {}
        now = time.time()
        busy, engine_wait = self.rollout.engine_timeline()
        trainer_wait = timer.seconds(Phase.GEN)
        return metrics.timeline_metrics((started, now), busy, [(trainer_started, now)], engine_wait, trainer_wait)

    def _too_old(self, samples: Samples) -> bool:
        """Asynchronous training: a generation batch whose weights are more than max_staleness versions
        older than this step's (one version per batch: the batch is kept or dropped whole)."""
        versions = samples.weight_version
        return bool(self.max_staleness and versions and min(versions) < oldest_version(self.step, self.max_staleness))

    def _generate_ahead(self, sampling_stats: dict) -> dict[str, float]:
        """Asynchronous training, once this step's batch is chosen: hand the engines what the next
        max_staleness steps will need beyond the groups carried over, all generated with the weights
        this step starts from, so that it is fresh enough where it is used. How much a batch yields
        is estimated from the steps so far (kept groups per generation batch); the same decision on
        every rank (counts only)."""
        batches, kept = sampling_stats["num_gen_batches"], sampling_stats["num_groups_kept"]
        if batches and kept:
            self._kept_per_batch = kept / batches
        per_batch = self._kept_per_batch or float(self.cfg.trainer.gen_batch_size)
        train_batch = self.cfg.trainer.train_batch_size
        fresh = self.buffer.num_carried_groups("weight_version", oldest_version(self.step + 1, self.max_staleness))
        submitted = batches_ahead(self.max_staleness, train_batch, fresh, per_batch, self.rollout.inflight)
        per_step = max(1, math.ceil(train_batch / per_batch))  # which step each batch is labelled for (uids, seeds)
        for _ in range(submitted):
            self._submit_generation(self.step + 1 + (self.rollout.inflight // per_step))
        return {"async/batches_in_flight": float(self.rollout.inflight), "async/batches_submitted_ahead": float(submitted)}

    def _policy_batch(self, train: Samples, advantages: torch.Tensor):
        """This data-parallel rank's rows of the train batch as the actor's `PolicyBatch` (MoE: with
        the engine's routing of those rows, fetched from the ranks that generated them)."""
        rows = shard_for_rank(list(range(len(train))), self.dp_rank, self.dp_size)
        mine = Samples.from_fields({k: [v[i] for i in rows] for k, v in train.as_fields().items() if k != "routing_ref"})
        if train.routing_ref is not None:
            routing = self._fetch_routing(train)
            mine.routed_experts = [routing[i] for i in rows]
        width = max(1, max(len(r) for r in mine.response_ids))
        return build_policy_batch(mine, advantages[rows], self.tokenizer.pad_token_id, width, self.cfg.algorithm.overlong_filter)

    def _fetch_routing(self, train: Samples) -> dict[int, torch.Tensor]:
        """The engine's routing of the train rows this rank's replica trains on (a world collective
        over the gather group); the generating ranks' stores are emptied after it, but for the groups
        carried over to the next step (asynchronous training)."""
        layout = self.runtime.ctx.layout
        replica_of_row = [0] * len(train)
        for dp_rank in range(self.dp_size):
            for row in shard_for_rank(list(range(len(train))), dp_rank, self.dp_size):
                replica_of_row[row] = dp_rank
        replica_ranks = [[r for r in range(layout.world_size) if layout.coordinates(r)["dp"] == d] for d in range(self.dp_size)]
        hf = self.runtime.hf_config
        read = [p.numel() + r.numel() - 1 for p, r in zip(train.prompt_ids, train.response_ids)]
        try:
            return fetch_routing(
                train.routing_ref, [replica_ranks[d] for d in replica_of_row], read, (hf.num_layers, hf.num_experts_per_tok),
                self.routing_dtype, self.routing_store, group=meeting_group(),
            )  # fmt: skip
        finally:
            # Asynchronous training: the groups carried over to the next step keep theirs.
            self.routing_store.retain(dist.get_rank() if dist.is_initialized() else 0, self.buffer.carried_values("routing_ref"))

    def _old_log_probs(self, batch) -> dict[str, float]:
        """Set ``batch.old_log_probs`` and, with `actor.router_replay`, the ``routed_experts`` the update
        replays (r3: the engine's, also in this pass; r2: the actor's own choice here). Returns the
        routing-mismatch metrics where the engine's routing is there and not replayed."""
        replay = self.cfg.actor.router_replay
        engine_routing = batch.rollout_routed_experts
        if replay == "r3":
            if engine_routing is None:
                raise RuntimeError("actor.router_replay=r3 but the rollout engine returned no routed experts")
            batch.routed_experts = engine_routing
        if replay == "r3" or (replay == "off" and engine_routing is None):
            batch.old_log_probs = self.actor.compute_log_probs(batch).cpu()  # the batch lives on the CPU
            return {}
        log_probs, chosen = self.actor.compute_log_probs_and_routing(batch)
        batch.old_log_probs = log_probs.cpu()
        if replay == "r2":
            batch.routed_experts = chosen.cpu()
        if engine_routing is None:
            return {}
        return metrics.routing_mismatch_metrics(self.actor.routing_mismatch(batch, chosen))

    def _mismatch(self, batch) -> dict[str, float]:
        """|rollout - trainer| log-prob statistics of the train batch, all replicas pooled."""
        stats = log_prob_mismatch(batch.rollout_log_probs, batch.old_log_probs, batch.response_valid_mask())
        return metrics.mismatch_metrics(reduce(lambda a, b: a.merge(b), gather_from_leaders(stats)))

    def _stop_before_update_if_asked(self, start: StepStart) -> None:
        """On SIGTERM (seen by any rank), save the state at the start of this step and exit with 143.

        The actor has not changed yet, so the checkpoint is the previous step's, with the prompt
        sampler and the RNGs put back to where this step began: `--resume` redoes the step with the
        same prompts and seeds. Call it only where the ranks are in step (`SigtermFlag.asked`).

        Asynchronous training finishes the step instead (and stops after its save, in `fit`): the
        batches handed out ahead and the groups carried over belong to the step's end, where the
        checkpoint keeps them (`async_state`); the step's start is not on disk with them."""
        if self.max_staleness or not self.sigterm.asked():
            return
        interrupted = self.step
        self.step -= 1
        start.restore(self.sampler)
        self._exit_preempted(f"SIGTERM during step {interrupted}, before its update: checkpoint of step {self.step} written")

    def _may_call_off(self) -> bool:
        """Whether a SIGTERM may call off this step's generation: only when the step's start is on
        disk already (the previous step was saved), so that leaving at once loses nothing. The same on
        every rank."""
        return self._last_saved_step is not None and self._last_saved_step == self.step - 1

    def _generation_call_off(self):
        """(context around the engine's generate, the spmd engine's `call_off` vote or None): how a
        SIGTERM leaves this generation batch when it may (`_may_call_off`). In the leader placement an
        engine's generate holds no collective with other ranks: the signal handler abandons it at
        once. An spmd engine's ranks step together: each votes every `CALL_OFF_CHECK_STEPS` engine
        steps (its SIGTERM, or the gather meeting called off by another rank) and the group stops at
        the same step (SIGTERM to exit: those steps, one store read and the exit)."""
        if not self._may_call_off():
            return nullcontext, None
        if self.rollout.placement == "leader":
            return self.sigterm.interruptible, None
        if self.rollout.placement == "spmd":
            return self.sigterm.calling_off_generation, self.sigterm.votes_to_call_off
        return nullcontext, None

    def _call_off_on_sigterm(self):
        """Around a generation batch: the meetings after it are called off on SIGTERM (`_may_call_off`)."""
        return liveness.calling_off_when(lambda: self.sigterm.received) if self._may_call_off() else nullcontext()

    def _exit_called_off(self, start: StepStart) -> None:
        """The generation batch was called off on SIGTERM (every rank is here): the checkpoint of the
        previous step, written before this step began, is the resume point; put the prompt sampler
        and the RNGs back to the step's start (as saved) and exit with 143 without another save."""
        interrupted = self.step
        self.step -= 1
        start.restore(self.sampler)
        since = self.sigterm.seconds_since()
        self.say_rank0(
            f"SIGTERM during step {interrupted}'s generation: called off at once; the checkpoint of step {self.step} "
            f"(written before it) is where --resume continues" + ("" if since is None else f" ({since:.1f} s after the SIGTERM)")
        )
        raise TrainingInterrupted(EXIT_PREEMPTED)

    def _exit_preempted(self, what: str) -> None:
        """Save the current state (unless saved already) without the engine, say so, exit with 143 (every rank)."""
        self.save(exiting=True)
        since = self.sigterm.seconds_since()
        self.say_rank0(f"{what}; continue with --resume" + ("" if since is None else f" ({since:.1f} s after the SIGTERM)"))
        raise TrainingInterrupted(EXIT_PREEMPTED)

    # ------------------------------------------------------------------ checkpoints, logging

    def save(self, exiting: bool = False) -> Optional[Path]:
        """Checkpoint the current step (once). `exiting` (SIGTERM): the GPU does not go back to the engine."""
        if self._last_saved_step == self.step:
            return None
        moves = self.handover.actor_for_exit() if exiting else self.handover.actor_on_gpu()
        with moves:  # the checkpoint reads the actor's state
            files = None
            if self.max_staleness:  # the samples generated ahead go with it (`async_state`)
                state = async_state.capture(self.rollout, self.buffer, self._kept_per_batch, self._gen_indices, self.routing_store)
                files = {async_state.ASYNC_STATE_FILE: lambda path: async_state.save(state, path)}
            path = save_run_checkpoint(self.checkpoint_root, self.step, self.actor, self.sampler, self.cfg, rank0_files=files)
        self._last_saved_step = self.step
        self.plot()  # a run killed later still has its curves up to here
        return path

    def _resume(self) -> bool:
        resumed = resume_run(self.checkpoint_root, self.actor, self.sampler)
        if resumed is None:
            self.say_rank0(f"--resume: no checkpoint under {self.checkpoint_root}; starting from step 0")
            return False
        self.step, message, path = resumed
        self._last_saved_step = self.step
        if self.max_staleness:  # put back after the engines start (`_restore_async`)
            self._async_restore = async_state.load(path)
        self.say_rank0(message)
        return True

    def _restore_async(self) -> None:
        """A resumed asynchronous run: the batches in flight and the carried groups of its checkpoint."""
        state = self._async_restore
        if state is None:
            return
        kept_per_batch, self._gen_indices = async_state.restore(
            state, self.rollout, self.buffer, head=self.rollout.bridge is not None, routing_store=self.routing_store
        )
        if kept_per_batch is not None:
            self._kept_per_batch = kept_per_batch
        self._async_restore = None

    def plot(self) -> Optional[Path]:
        """Redraw the run's curves on the logging rank, unless nothing was logged since the last
        drawing (the last step's save draws them, then the run's end would again: ~2 s each)."""
        if not self.rank0:
            return None
        drawn_from = metrics_file_state(self.runtime.output_dir)
        if drawn_from is not None and drawn_from == self._plotted_from:
            return None
        self._plotted_from = drawn_from
        return plot_run(self.cfg, self.runtime.output_dir, say=self.say)

    def say_rank0(self, text: str) -> None:
        if self.rank0:
            self.say(text)

    def close(self) -> None:
        self.logger.close()
        if self.reward is not None:
            self.reward.close()
        self.rollout.shutdown()


def train(
    cfg: Config, *, resume: bool = False, overwrite: bool = False, say=print, layout: Optional[ParallelLayout] = None
) -> dict[str, float]:
    """Run DAPO training as configured (every rank calls it); returns the last step's metrics.

    A non-empty `trainer.output_dir` needs `resume` (continue the run there) or `overwrite` (delete
    that run's checkpoints and logs first); see `output_dir.check_output_dir`. `layout`: the
    caller ran `startup.preflight` already and passes the run's layout it returned (see `startup.start`)."""
    runtime = start(
        cfg, say=say, resume=resume, overwrite=overwrite, reference=cfg.algorithm.kl.use_kl_loss, layout=layout
    )
    # A run every rank ends the same way (done, or the preemption's exit 143) ends with the ranks
    # leaving together: the engine owners of the separate placement use the job's store after the
    # trainer is done (distributed.setup.leave_together).
    orderly = False
    if runtime.ctx.role == "rollout":  # the separate placement's engine ranks serve the trainer's head
        try:
            serve_rollout(cfg, runtime, say=say)
            orderly = True
        finally:
            teardown(together=orderly)
        return {}
    if is_logging_rank():
        write_resolved_config(cfg, runtime.output_dir)
    trainer = DAPOTrainer(cfg, runtime, resume=resume, say=say)
    try:
        metrics = trainer.fit()
        orderly = True
        return metrics
    except TrainingInterrupted:
        orderly = True
        raise
    finally:
        trainer.close()
        teardown(together=orderly)
