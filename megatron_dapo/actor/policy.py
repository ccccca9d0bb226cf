"""The Megatron actor (forward-only log-probs and the update step) and the reference model.

    actor = build_actor(cfg, models, vocab_size=hf_cfg.vocab_size)       # DDP + optimizer + LR schedule
    batch.old_log_probs = actor.compute_log_probs(batch)                 # [n, R] on every rank
    metrics = actor.update(split_mini_batches(batch, num_mini_batches))  # one rollout step

    reference = build_reference(cfg, ref_models, vocab_size=hf_cfg.vocab_size)
    batch.ref_log_probs = reference.compute_log_probs(batch)

Every rank of a model replica (its TP and PP ranks) must pass the same `PolicyBatch`; data-parallel
ranks pass their own share, of any size (an empty one included). Collectives inside:

* ``compute_log_probs``: the pipeline schedule, then a broadcast from the last stage, so every rank
  returns the result. No data-parallel communication, except with expert parallelism: expert-parallel
  peers exchange tokens in every forward, so the data-parallel ranks agree on a micro-batch count.
* ``update``: per mini-batch, one all-reduce of the loss token / sequence counts and one of the
  micro-batch count over DP (every DP rank runs the same number of micro-batches, the missing ones
  as zero-token micro-batches), the schedule with Megatron's DDP gradient reduction, the optimizer
  step, and one all-reduce + broadcast of the statistics.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps

from megatron_dapo.actor.batch import (
    MicroBatch,
    PolicyBatch,
    build_micro_batch,
    plan_micro_batches,
    split_for_context_parallel,
)
from megatron_dapo.actor.forward import (
    broadcast_from_last_stage,
    is_last_stage,
    model_forward,
    response_log_probs,
    run_schedule,
)
from megatron_dapo.actor.moe import MoEStepStats, auxiliary_loss_scale, find_routers, prepare_routers
from megatron_dapo.actor.routing import (
    RoutingMismatch,
    RoutingPass,
    local_token_order,
    pooled_routing_mismatch,
    reduce_recorded,
    routing_dtype,
    scatter_recorded,
)
from megatron_dapo.actor.objective import (
    STAT_NAMES,
    GlobalCounts,
    ObjectiveSettings,
    loss_mask,
    micro_batch_objective,
    summarise,
)
from megatron_dapo.actor.optim import (
    announce_gradient_options,
    build_optimizer,
    build_scheduler,
    prepare_for_training,
    prepare_transformer_config,
)
from megatron_dapo.algorithm.loss import count_tokens_and_seqs
from megatron_dapo.distributed.context_parallel import cp_pad_multiple
from megatron_dapo.model.builder import causal_attention_mask, layer_spec_of
from megatron_dapo.model.mapping import TE_SPEC

__all__ = ["ForwardSettings", "MegatronActor", "ReferenceModel", "build_actor", "build_reference"]

_EXTRA_STATS = ("real_tokens", "computed_tokens")


@dataclass(frozen=True)
class ForwardSettings:
    """How batches become micro-batches and logits become log-probs."""

    vocab_size: int
    """The model's real (unpadded) vocabulary: Megatron's padding columns are excluded from the softmax."""
    micro_batch_size: int = 1
    """Sequences per micro-batch when there is no token budget."""
    max_tokens_per_micro_batch: int = 0
    """Token budget of a training micro-batch (0: use ``micro_batch_size``)."""
    forward_max_tokens_per_micro_batch: Optional[int] = None
    """Token budget of a forward-only micro-batch (no activations are kept); None: the training one."""
    temperature: float = 1.0
    """Sampling temperature of the rollout: log-probs are of ``softmax(logits / temperature)``."""
    pad_token_id: int = 0
    logprob_chunk_size: int = 4096
    """Tokens per float32 chunk in the vocab-parallel log-prob kernel (bounds its memory)."""
    compute_entropy: bool = True
    """Compute the entropy during the update for logging even when ``entropy_coeff`` is 0."""

    @classmethod
    def from_config(cls, cfg: Any, vocab_size: int) -> "ForwardSettings":
        """From a `config.Config`."""
        return cls(
            vocab_size=vocab_size,
            micro_batch_size=cfg.trainer.micro_batch_size,
            max_tokens_per_micro_batch=cfg.trainer.max_tokens_per_micro_batch,
            temperature=cfg.rollout.temperature,
        )


class ReferenceModel:
    """Forward-only per-token log-probs of response tokens through Megatron's pipeline schedule.

    ``models`` are this rank's model chunks (plain ``GPTModel`` or DDP-wrapped), in virtual-stage order.
    """

    def __init__(self, models: Sequence[torch.nn.Module], settings: ForwardSettings) -> None:
        if not models:
            raise ValueError("no model chunks")
        self.models = list(models)
        self.settings = settings
        self.config = self.models[0].config
        self.pipeline_size = ps.get_pipeline_model_parallel_world_size()
        prepare_transformer_config(self.config, self.pipeline_size, len(self.models))
        self.device = next(self.models[0].parameters()).device
        # Context parallelism: each rank of the CP group holds 2 of the 2*CP chunks of every sequence.
        self.cp_size = ps.get_context_parallel_world_size()
        self.cp_rank = ps.get_context_parallel_rank()
        # Padding-free THD packing needs Transformer Engine's attention; the local spec takes padded rows,
        # and so does CP (TE's CP attention takes the same right-padded 2*CP layout as the SDPA path).
        self.packed = layer_spec_of(self.models[0]) == TE_SPEC and self.cp_size == 1
        tp = ps.get_tensor_model_parallel_world_size()
        self.pad_to_multiple_of = cp_pad_multiple(self.cp_size, tp, self.config.sequence_parallel)
        # Where a router sees its tokens (`actor.routing.local_token_order`): this rank's CP chunks and,
        # with sequence parallelism, its TP slice of them.
        self._token_order = dict(cp_size=self.cp_size, cp_rank=self.cp_rank)
        if self.config.sequence_parallel and tp > 1:
            self._token_order.update(sp_size=tp, sp_rank=ps.get_tensor_model_parallel_rank())
        self._chunk_routers = {id(model): find_routers([model]) for model in self.models}

    def _routing_pass(self, replay: bool) -> RoutingPass:
        if not any(self._chunk_routers.values()):
            raise ValueError("routing replay and recording need a mixture-of-experts model: this one has no MoE router")
        recompute = getattr(self.config, "recompute_granularity", None) == "full"
        return RoutingPass(self._chunk_routers, replay=replay, recompute=recompute)

    def _replay_routing(self, routing, model, mb: MicroBatch) -> None:
        """Before a chunk's forward: its routers take the micro-batch's routing, in their token order."""
        if routing is not None and mb.routed_experts is not None:
            routing.before_forward(model, local_token_order(mb.routed_experts, **self._token_order))

    @property
    def gpt_models(self) -> list[torch.nn.Module]:
        """The ``GPTModel`` chunks without the DDP wrapper (for weight export and resharding)."""
        return [getattr(model, "module", model) for model in self.models]

    # ------------------------------------------------------------------ micro-batches

    def _micro_batch_count_multiple(self) -> int:
        # The interleaved schedule needs a multiple of the pipeline size (Megatron raises otherwise).
        return self.pipeline_size if len(self.models) > 1 else 1

    def plan(self, batch: PolicyBatch, max_tokens: int, min_count: int = 1) -> list[list[int]]:
        """Sequence indices of each micro-batch (at least ``min_count``, rounded for interleaving).

        ``max_tokens`` is per rank: under context parallelism a rank computes 1/CP of each sequence, so
        a micro-batch may hold CP times as many tokens.
        """
        multiple = self._micro_batch_count_multiple()
        lengths = batch.model_lengths()
        max_tokens = max_tokens * self.cp_size
        options = dict(max_tokens=max_tokens, micro_batch_size=self.settings.micro_batch_size, packed=self.packed)
        plan = plan_micro_batches(lengths, min_count=min_count, **options)
        wanted = -(-len(plan) // multiple) * multiple
        if wanted != len(plan):
            plan = plan_micro_batches(lengths, min_count=wanted, **options)
        return plan

    def synchronised_plan(self, batch: PolicyBatch, max_tokens: Optional[int] = None) -> list[list[int]]:
        """This rank's micro-batches, as many as the data-parallel rank that needs the most.

        ``max_tokens``: the token budget (default: the training one)."""
        budget = self.settings.max_tokens_per_micro_batch if max_tokens is None else max_tokens
        local = self.plan(batch, budget)
        count = torch.tensor([len(local)], dtype=torch.long, device=self.device)
        dist.all_reduce(count, op=dist.ReduceOp.MAX, group=ps.get_data_parallel_group())
        if int(count) == len(local):
            return local
        return self.plan(batch, budget, min_count=int(count))

    def build_micro_batches(self, batch: PolicyBatch, plan: Sequence[Sequence[int]]) -> list[MicroBatch]:
        """Model inputs for each planned micro-batch, on the models' device."""
        micro_batches = [
            build_micro_batch(
                batch,
                indices,
                packed=self.packed,
                pad_token_id=self.settings.pad_token_id,
                pad_to_multiple_of=self.pad_to_multiple_of,
                device=self.device,
            )
            for indices in plan
        ]
        if self.cp_size > 1:
            # The attention applies the causal mask per local chunk itself (no explicit mask under CP).
            return [split_for_context_parallel(mb, self.cp_size, self.cp_rank) for mb in micro_batches]
        if not self.packed and micro_batches:
            # The local attention takes an explicit causal mask. One mask for the longest micro-batch,
            # sliced (a view) for the others: its memory is seq_len^2 bytes, once per batch.
            full = causal_attention_mask(max(mb.seq_length for mb in micro_batches), self.device)
            for mb in micro_batches:
                mb.attention_mask = full[..., : mb.seq_length, : mb.seq_length]
        return micro_batches

    # ------------------------------------------------------------------ forward only

    def compute_log_probs(
        self, batch: PolicyBatch, with_entropy: bool = False
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Log-probs ``[n, R]`` float32 of the response tokens (0 past each response), on every rank.

        With ``with_entropy`` also the entropy of the policy at those positions, same shape. A batch
        with ``routed_experts`` is computed with that routing replayed (`actor.routing`).
        """
        result, _ = self._forward_only(batch, with_entropy, record_routing=False)
        return (result[0], result[1]) if with_entropy else result[0]

    def compute_log_probs_and_routing(self, batch: PolicyBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """Log-probs as `compute_log_probs`, and the routing the model chose: ``[n, T, L, k]`` of
        `routing_dtype` in host memory (`PolicyBatch.routed_experts`' layout), complete for the MoE
        layers of this rank's pipeline stage, -1 at the other stages' layers and at positions the
        model does not read."""
        result, routing = self._forward_only(batch, False, record_routing=True)
        return result[0], routing

    def routing_mismatch(self, batch: PolicyBatch, recorded: torch.Tensor) -> RoutingMismatch:
        """Tokens the engine (``batch.rollout_routed_experts``) and the actor (``recorded``, from
        `compute_log_probs_and_routing`) routed differently, over all stages and replicas (a collective)."""
        return pooled_routing_mismatch(
            batch.rollout_routed_experts, recorded, batch.read_mask(),
            ps.get_pipeline_model_parallel_group(), ps.get_data_parallel_group(),
        )  # fmt: skip

    @torch.no_grad()
    def _forward_only(self, batch: PolicyBatch, with_entropy: bool, record_routing: bool):
        s = self.settings
        budget = s.max_tokens_per_micro_batch if s.forward_max_tokens_per_micro_batch is None else s.forward_max_tokens_per_micro_batch
        if ps.get_expert_model_parallel_world_size() > 1:
            plan = self.synchronised_plan(batch, budget)
        else:
            plan = self.plan(batch, budget)
        micro_batches = self.build_micro_batches(batch, plan)
        for model in self.models:
            model.eval()
        replay = batch.routed_experts is not None
        routing = self._routing_pass(replay=True) if replay else None
        if record_routing:
            if replay:
                raise ValueError("a batch with routed_experts is replayed, not recorded")
            routing = self._routing_pass(replay=False)
            layers, topk = self.config.num_layers, self.config.moe_router_topk
            # One byte an entry up to 128 experts (`routing_dtype`): the recording of a whole share is
            # [n, T, L, k], 4x smaller than int32, and goes to host memory once the ranks combined it.
            entry = routing_dtype(self.config.num_moe_experts)
            recorded = torch.full((batch.num_sequences, batch.sequence_width, layers, topk), -1, dtype=entry, device=self.device)

        def forward_step(data_iterator, model):
            mb = next(data_iterator)
            self._replay_routing(routing, model, mb)
            output = model_forward(model, mb)
            if record_routing:
                positions = local_token_order(mb.token_source, **self._token_order)
                for layer, chosen in routing.recorded(model):
                    scatter_recorded(recorded, chosen, positions, layer)

            def collect(output_tensor, non_loss_data=False):
                log_probs, entropy = response_log_probs(
                    output_tensor, mb, s.vocab_size, s.temperature, with_entropy, s.logprob_chunk_size
                )
                return mb.sequence_index, log_probs.float(), None if entropy is None else entropy.float()

            return output, collect

        with routing if routing is not None else contextlib.nullcontext():
            store = run_schedule(self.models, micro_batches, forward_step, forward_only=True, collect_non_loss_data=True)
        n, width = batch.num_sequences, batch.response_width
        rows = 2 if with_entropy else 1
        result = torch.zeros((rows, n, width), dtype=torch.float32, device=self.device)
        if is_last_stage():
            for sequence_index, log_probs, entropy in store:
                columns = log_probs.shape[1]
                result[0, sequence_index, :columns] = log_probs
                if with_entropy:
                    result[1, sequence_index, :columns] = entropy
        result = broadcast_from_last_stage(result)
        if not record_routing:
            return result, None
        # Each TP (with SP) and CP rank recorded its own tokens; every rank of the stage gets all of them.
        return result, reduce_recorded(recorded, ps.get_tensor_and_context_parallel_group()).cpu()


class MegatronActor(ReferenceModel):
    """The policy: forward-only log-probs plus the update step (DDP, optimizer, LR schedule).

    Build it with `build_actor`, which wraps the chunks in Megatron DDP and creates the optimizer and
    scheduler with the settings that keep the token-mean exact (see `actor.optim`).
    """

    def __init__(
        self,
        models: Sequence[torch.nn.Module],
        optimizer: Any,
        scheduler: Any,
        settings: ForwardSettings,
        objective: ObjectiveSettings,
        epochs: int = 1,
    ) -> None:
        super().__init__(models, settings)
        if not getattr(self.config, "calculate_per_token_loss", False):
            raise ValueError("the models were not prepared with actor.optim.prepare_for_training (use build_actor)")
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.objective = objective
        self.epochs = int(epochs)
        self._routers = prepare_routers(self.models)
        self._micro_batches_run = 0
        self._moe_stats = (
            MoEStepStats(self._routers, self.config.num_layers, self.config.num_moe_experts, self.device)
            if getattr(self.config, "num_moe_experts", None) else None
        )  # fmt: skip

    # ------------------------------------------------------------------ collectives

    @staticmethod
    def _dp_group():
        return ps.get_data_parallel_group()

    def _check_same_count_across_dp(self, count: int) -> None:
        values = torch.tensor([count, -count], dtype=torch.long, device=self.device)
        dist.all_reduce(values, op=dist.ReduceOp.MAX, group=self._dp_group())
        if int(values[0]) != -int(values[1]):
            raise ValueError(
                f"data-parallel ranks passed different numbers of mini-batches (between {-int(values[1])} and "
                f"{int(values[0])}): every rank must run the same number of optimizer steps"
            )

    def global_counts(self, batch: PolicyBatch) -> GlobalCounts:
        """Loss tokens and sequences of the mini-batch summed over the data-parallel ranks (without the
        sequences the masked IS rejects: they leave the token-mean's denominator, `objective.loss_mask`)."""
        tokens, seqs = count_tokens_and_seqs(loss_mask(batch, self.objective))
        counts = torch.tensor([float(tokens), float(seqs)], dtype=torch.float64, device=self.device)
        dist.all_reduce(counts, group=self._dp_group())
        width = batch.response_width
        if self.objective.loss_agg_mode == "seq-mean-token-sum-norm" and self.objective.horizon is None:
            # The default horizon is the response width, which must be the same on every rank.
            widest = torch.tensor([width], dtype=torch.long, device=self.device)
            dist.all_reduce(widest, op=dist.ReduceOp.MAX, group=self._dp_group())
            width = int(widest)
        return GlobalCounts(num_tokens=float(counts[0]), num_seqs=float(counts[1]), response_width=width)

    # ------------------------------------------------------------------ one mini-batch

    def compute_gradients(self, batch: PolicyBatch) -> torch.Tensor:
        """Forward and backward over one mini-batch; gradients end up reduced in the DDP buffers.

        Returns the statistics vector (`objective.STAT_NAMES` + real / computed tokens) summed over
        micro-batches and data-parallel ranks, identical on every rank.
        """
        counts = self.global_counts(batch)
        micro_batches = self.build_micro_batches(batch, self.synchronised_plan(batch))
        s = self.settings
        entropy_needed = s.compute_entropy or self.objective.entropy_coeff != 0

        routing = self._routing_pass(replay=True) if batch.routed_experts is not None else None

        def forward_step(data_iterator, model):
            mb = next(data_iterator)
            self._replay_routing(routing, model, mb)
            output = model_forward(model, mb)

            def loss_func(output_tensor):
                log_probs, entropy = response_log_probs(
                    output_tensor, mb, s.vocab_size, s.temperature, entropy_needed, s.logprob_chunk_size
                )
                loss, sums = micro_batch_objective(log_probs, entropy, mb, self.objective, counts)
                # 3-tuple + config.calculate_per_token_loss: Megatron leaves the loss as it is (see actor.optim).
                return loss, mb.loss_mask.sum().to(torch.int), sums

            return output, loss_func

        for model in self.models:
            model.train()
            model.zero_grad_buffer()
        self.optimizer.zero_grad()
        with auxiliary_loss_scale(self._routers, len(micro_batches), ps.get_data_parallel_world_size()):
            with routing if routing is not None else contextlib.nullcontext():
                store = run_schedule(self.models, micro_batches, forward_step, forward_only=False)
        self._micro_batches_run += len(micro_batches)

        sums = torch.zeros(len(STAT_NAMES) + len(_EXTRA_STATS), dtype=torch.float64, device=self.device)
        if is_last_stage() and store:
            sums[: len(STAT_NAMES)] = torch.stack([t.to(self.device) for t in store]).sum(0)
        sums[len(STAT_NAMES)] = sum(mb.real_tokens for mb in micro_batches)
        sums[len(STAT_NAMES) + 1] = sum(mb.computed_tokens for mb in micro_batches)
        dist.all_reduce(sums, group=self._dp_group())
        return broadcast_from_last_stage(sums)

    def apply_gradients(self) -> dict[str, float]:
        """Clip, step the optimizer; returns ``grad_norm`` (before clipping), ``lr`` and ``update_successful``."""
        success, grad_norm, _ = self.optimizer.step()
        if success and not grad_norm:
            # Without clipping (grad_clip = 0) a plain Megatron optimizer reports no norm: compute it.
            grad_norm = self.optimizer.get_grad_norm()
        return {
            "grad_norm": float(grad_norm) if success and grad_norm is not None else math.nan,
            "lr": float(self.optimizer.param_groups[0]["lr"]),
            "update_successful": float(bool(success)),
        }

    # ------------------------------------------------------------------ one rollout step

    def update(self, mini_batches: Sequence[PolicyBatch]) -> dict[str, float]:
        """One rollout step: advance the LR schedule, then one optimizer step per mini-batch (x epochs).

        Returns the mean over optimizer steps of each step's exact (all micro-batches, all ranks)
        statistics, with ``tokens`` and ``pad_fraction`` pooled over all steps and
        ``num_optimizer_steps`` / ``skipped_steps`` counted. Same dict on every rank.
        """
        mini_batches = list(mini_batches)
        if not mini_batches:
            raise ValueError("update needs at least one mini-batch")
        self._check_same_count_across_dp(len(mini_batches))
        self.scheduler.step(1)  # before the updates: rollout step k trains at lr * k / warmup
        self._micro_batches_run = 0
        if self._moe_stats is not None:
            self._moe_stats.start()
        steps: list[dict[str, float]] = []
        real = computed = tokens = 0.0
        for _ in range(self.epochs):
            for batch in mini_batches:
                sums = self.compute_gradients(batch)
                step = summarise(sums[: len(STAT_NAMES)])
                step.update(self.apply_gradients())
                steps.append(step)
                tokens += step["tokens"]
                real += float(sums[len(STAT_NAMES)])
                computed += float(sums[len(STAT_NAMES) + 1])
        metrics = {key: sum(step[key] for step in steps) / len(steps) for key in steps[0]}
        if self.objective.tis_cap is None:
            metrics.pop("tis_weight_mean"), metrics.pop("tis_capped_frac")
        if self.objective.mis is None:
            metrics.pop("mis_masked_frac"), metrics.pop("mis_masked_token_frac"), metrics.pop("mis_ratio_mean")
        if not self.objective.use_kl_loss:
            metrics.pop("kl"), metrics.pop("kl_loss")
        metrics.update(
            tokens=tokens,
            pad_fraction=0.0 if computed == 0 else 1.0 - real / computed,
            num_optimizer_steps=float(len(steps)),
            skipped_steps=float(sum(1 for step in steps if not step["update_successful"])),
        )
        metrics.pop("update_successful")
        if self._moe_stats is not None:
            metrics.update(self._moe_stats.finish(self._micro_batches_run))
        return metrics


def build_actor(
    cfg: Any,
    models: Sequence[torch.nn.Module],
    vocab_size: int,
    sft: bool = False,
    overlap_grad_reduce: Optional[bool] = None,
) -> MegatronActor:
    """Wrap this rank's model chunks in Megatron DDP and build the optimizer and LR schedule.

    ``cfg`` is a `config.Config`; ``vocab_size`` the HF model's vocabulary (before Megatron's padding).
    ``sft``: train with the cross-entropy of the response tokens (supervised warm start) instead of
    the policy loss; log-probs are then of the plain softmax (temperature 1).
    ``overlap_grad_reduce``: None decides from the device (`gpu_kernels.gradient_options`: on with CUDA).
    """
    use_distributed_optimizer = cfg.parallel.use_distributed_optimizer
    wrapped = prepare_for_training(models, use_distributed_optimizer, overlap_grad_reduce)
    announce_gradient_options(wrapped)
    optimizer = build_optimizer(wrapped, cfg.optimizer, use_distributed_optimizer)
    scheduler = build_scheduler(optimizer, cfg.optimizer, cfg.trainer.total_steps)
    settings = ForwardSettings.from_config(cfg, vocab_size)
    objective = ObjectiveSettings.from_config(cfg.algorithm, horizon=cfg.rollout.max_response_length)
    if sft:
        settings = dataclasses.replace(settings, temperature=1.0)
        objective = dataclasses.replace(objective, sft=True, entropy_coeff=0.0, use_kl_loss=False, tis_cap=None, mis=None)
    return MegatronActor(wrapped, optimizer, scheduler, settings, objective, epochs=1 if sft else cfg.trainer.ppo_epochs)


def build_reference(cfg: Any, models: Sequence[torch.nn.Module], vocab_size: int) -> ReferenceModel:
    """The reference policy: the same forward path, no optimizer, parameters frozen."""
    for model in models:
        for param in model.parameters():
            param.requires_grad_(False)
    return ReferenceModel(models, ForwardSettings.from_config(cfg, vocab_size))
