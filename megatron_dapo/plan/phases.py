"""The plan: what one GPU holds in each phase of a DAPO step, whether that fits, and the largest
micro-batch token budget and engine pool that would.

The actor, the rollout engine and the trainer share every GPU and take turns:

* generation: the actor state that is not offloaded (`actor.offload_params / _grads / _optimizer`;
  without offload all of it: params, grads, optimizer state) + reference + the engine's memory pool
  (`rollout.gpu_memory_utilization` x GPU, the vLLM / SGLang convention: weights, KV cache and, for
  vLLM, the engine's profiled activations live inside it) + the gathered results + reserve;
* weight sync (after the update, `trainer/loop.py`: grads and optimizer state go to host first if
  offloaded, then the engine's weights wake, the push, then the params go to host, and only then
  does the KV cache wake): the actor's params + the rest of the actor state not offloaded +
  reference + the engine's weights (its whole pool if `rollout.free_cache_engine` is off: then
  nothing sleeps) + one weight-sync bucket (`rollout.weight_sync_bucket_mb`) + reserve;
  the rollout phase needs the larger of these two moments;
* training phase: actor (all of it: whatever was offloaded is back) + reference + activations of
  one micro-batch + reserve; the engine sleeps and its pool is released (`rollout.free_cache_engine`,
  the default; if it is off the pool stays).

With `rollout.placement=separate` the engines have GPUs of their own (the last `rollout.num_gpus`
of the cluster) and the two pools are sized apart: a rollout GPU holds the engine's pool (weights,
KV cache, vLLM's activations; SGLang's beside it), which never sleeps, and the bucket a push brings;
a trainer GPU holds the whole actor (nothing to offload: no engine shares it) + reference, and
either one micro-batch's activations (training) or one weight-sync bucket of the export, or the
gathered results, between updates (`MemoryPlan.trainer_between_updates`).

Offload therefore lets the pool grow by the offloaded bytes: the largest `rollout.gpu_memory_utilization`
is (GPU - actor state kept while generating - reference - reserve) / GPU, shown for the config's
offload, for a resident actor and for everything offloaded. The offloaded params and optimizer state
live in host memory (pinned) for the whole run (offloaded grads are dropped and come back as zeros:
no host copy): per GPU the fullest stage's offloaded params + optimizer state, plus the engine's weights
where a sleeping engine keeps them there (vLLM at `rollout.sleep_level=1`, the embedded engine at
either level; vLLM at level 2 and SGLang drop them);
per node that times the GPUs per node (an upper bound with PP > 1, where stages differ).

The reserve (`--reserve-gib`) stands for what no formula here counts: the CUDA context, NCCL
buffers, allocator fragmentation with varying micro-batch shapes, and small per-token inputs
(position ids, labels, the per-token loss inputs: tens of bytes per token).

A mixture of experts is planned the same way, its actor state summed from a dense part and the
routed experts (`parameters.StageParameters`, `memory.py`: each part's optimizer state sharded over
its own data-parallel group) and its activations with the MoE layer's terms and the token
dispatcher's buffers (`activations.py`; the alltoall dispatcher, `model/builder.py`'s default);
`MemoryPlan.moe` holds the split by part (None for a dense model).

The largest `trainer.max_tokens_per_micro_batch` is then (GPU - reserve - fixed) / per-token on
the pipeline stage where it is smallest. At a fixed world size, TP and PP the actor state per GPU
does not change with CP (the distributed optimizer shards over DP x CP, a constant), so the plan
also gives the smallest CP whose micro-batch holds the longest sequence.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Optional

from megatron_dapo.config import Config, engine_returns_routing, validate_model_shape
from megatron_dapo.distributed.layout import ParallelLayout
from megatron_dapo.plan.activations import StageActivation, dispatch_buffer_bytes_per_token, stage_activation_bytes
from megatron_dapo.plan.memory import (
    OFFLOAD_KINDS,
    ActorMemory,
    actor_memory,
    actor_parts,
    dtype_bytes,
    kv_cache_bytes_per_token,
    result_buffer_bytes,
    routing_host_bytes,
    vllm_activation_peak,
    vllm_batch_defaults,
)
from megatron_dapo.plan.parameters import (
    check_tensor_parallel,
    hf_active_parameter_count,
    hf_parameter_count,
    layer_parameters,
    local_experts,
    rollout_weight_parameters,
    stage_parameter_split,
)
from megatron_dapo.plan.shapes import GIB, ClusterShape

if TYPE_CHECKING:  # megatron_dapo.model imports torch: kept out of `megatron-dapo --help`
    from megatron_dapo.model.hf_config import HFModelConfig

DEFAULT_RESERVE_GIB = 6.0
"""GiB kept free for what no formula counts (module doc): `--reserve-gib`."""


@dataclass
class StageMemory:
    """One pipeline stage's rank during the actor update."""

    stage: int
    parameters: int
    actor: ActorMemory
    """With the config's optimizer choice."""
    actor_distributed_optimizer: ActorMemory
    actor_plain_optimizer: ActorMemory
    reference: float
    activation_per_token: float
    activation_per_token_no_recompute: float
    activation_per_token_full_recompute: float
    activation_fixed: float
    activation_at_budget: float
    """Activations at the config's micro-batch token budget."""
    training_total: float
    """Everything the training phase holds at the config's budget."""
    max_tokens: int
    """Largest micro-batch token budget that fits, with the config's recompute setting."""
    max_tokens_no_recompute: int
    max_tokens_full_recompute: int


@dataclass
class RolloutMemory:
    tp: int
    engines: int
    weights: float
    kv_bytes_per_token: int
    pool: float
    """rollout.gpu_memory_utilization x GPU memory."""
    activation_peak: float
    """vLLM's profiled activation peak (`vllm_activation_peak`): inside the pool for vLLM, next to it for SGLang."""
    activation_in_pool: bool
    max_num_batched_tokens: int
    max_num_seqs: int
    """vLLM's batch defaults on this GPU, which size its profiling run."""
    kv_cache: float
    """pool - weights (- the activation peak when it is inside the pool)."""
    result_buffers: float
    """The rollout gather's GPU buffers while the engine is awake (`result_buffer_bytes`)."""
    full_sequence_tokens: int
    concurrent_full_sequences: int
    """Full-length sequences whose KV cache fits the pool at once, per engine."""
    generation_sequences_per_engine: int
    """Sequences of one generation batch (gen_batch_size x n) each engine serves."""
    offloaded: list[str]
    """What the actor offloads while the engine generates (actor.offload_*): params, grads, optimizer."""
    actor_kept: float
    """Actor state + reference that stay on the fullest GPU while the engine generates."""
    generation_total: float
    """Kept actor state + reference + pool + result buffers (+ SGLang's activations) + reserve."""
    sync_total: float
    """At the weight sync: params + kept state + reference + engine weights (the pool if the engine
    never sleeps) + weight-sync bucket + reserve."""
    phase_total: float
    """The rollout phase: the larger of generation_total and sync_total."""
    max_gpu_memory_utilization: float
    """The largest rollout.gpu_memory_utilization that fits with the config's offload."""
    max_gpu_memory_utilization_resident: float
    """... with the whole actor resident (no offload)."""
    max_gpu_memory_utilization_offloaded: float
    """... with params, grads and optimizer state offloaded."""
    concurrent_full_sequences_at_max: int
    """Full-length sequences per engine at max_gpu_memory_utilization."""
    host_per_gpu: float
    """Host memory the offloaded state (and, at sleep level 1, the sleeping engine's weights) takes per GPU."""
    host_per_node: float
    """host_per_gpu x GPUs per node (the fullest stage on every GPU: an upper bound with PP > 1)."""
    separate: bool = False
    """rollout.placement=separate: these figures are a rollout GPU's (no actor there)."""
    routing_host_per_gpu: float = 0.0
    """MoE with the engine's routing (r3, rollout.return_routed_experts, the embedded engine): the routing a
    generating rank keeps (its engine's share of a generation batch) plus its replica's rows of the train
    batch, in host memory (not pinned; `memory.routing_host_bytes`, `trainer/routing_exchange.py`)."""


@dataclass
class ExpertStageMemory:
    """One pipeline stage's rank of a mixture of experts, its actor state by part."""

    stage: int
    dense_parameters: int
    """Attention, embeddings, norms, router, shared expert: optimizer state sharded over DP x CP."""
    expert_parameters: int
    """This rank's routed experts: optimizer state sharded over the expert data-parallel group."""
    dense_distributed_optimizer: ActorMemory
    dense_plain_optimizer: ActorMemory
    expert_distributed_optimizer: ActorMemory
    expert_plain_optimizer: ActorMemory


@dataclass
class ExpertPlan:
    """What a mixture of experts adds to the plan."""

    num_experts: int
    experts_per_token: int
    shared_expert: bool
    """Qwen2-MoE's shared expert (part of the dense parameters)."""
    ep: int
    expert_tp: int
    """Ranks each expert's matrices split over: TP (Megatron's default, kept by `model/builder.py`)."""
    expert_dp: int
    """Ranks holding a copy of each expert: DP x CP / EP, the distributed optimizer's shards of expert state."""
    experts_per_rank: int
    hf_expert_parameters: int
    """The routed experts of all layers (of `MemoryPlan.hf_parameters`)."""
    active_parameters: int
    """Parameters one token goes through (dense part + top-k experts): what training FLOPs scale with."""
    dispatcher: str
    dispatch_bytes_per_token: float
    """The token dispatcher's buffers of the layer being run, per token (included in the activations)."""
    stages: list[ExpertStageMemory]


@dataclass
class MemoryPlan:
    model_name: str
    architecture: str
    hf_parameters: int
    nodes: int
    gpus_per_node: int
    world_size: int
    gpu_memory: float
    gpu: str
    reserve: float
    tp: int
    pp: int
    vpp: Optional[int]
    cp: int
    dp: int
    sequence_parallel: bool
    distributed_optimizer: bool
    recompute: bool
    dtype: str
    reference_built: bool
    engine_pool_during_training: bool
    micro_batch_tokens: int
    """The config's budget per rank: trainer.max_tokens_per_micro_batch, or micro_batch_size x longest sequence / CP."""
    longest_sequence: int
    stages: list[StageMemory]
    binding_stage: int
    """The stage with the smallest token budget (reported in the table)."""
    rollout: RolloutMemory
    max_tokens_per_micro_batch: int
    """Per rank (under CP a rank computes 1/CP of each sequence's tokens)."""
    longest_sequence_per_micro_batch: int
    """max_tokens_per_micro_batch x CP: the longest sequence one micro-batch can hold."""
    min_cp_for_longest_sequence: Optional[int]
    """The smallest parallel.cp (a divisor of world / (TP x PP)) whose micro-batch holds the longest sequence at this
    world, TP and PP; None: no CP does."""
    training_fits: bool
    rollout_fits: bool
    notes: list[str] = field(default_factory=list)
    moe: Optional[ExpertPlan] = None
    placement: str = "leader"
    """The resolved rollout.placement."""
    rollout_gpus: int = 0
    """rollout.placement=separate: the GPUs that hold the engines (rollout.num_gpus); `world_size` are the trainer's."""
    trainer_between_updates: float = 0.0
    """rollout.placement=separate: a trainer GPU between updates, the whole actor + reference + the larger
    of one weight-sync bucket (the export) and the gathered results, + reserve."""
    """Mixtures of experts only: the actor state by part, EP, active parameters, dispatch buffers."""

    @property
    def fits(self) -> bool:
        return self.training_fits and self.rollout_fits

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["fits"] = self.fits
        for stage, raw in zip(self.stages, out["stages"]):
            for key in ("actor", "actor_distributed_optimizer", "actor_plain_optimizer"):
                raw[key]["total"] = getattr(stage, key).total
        if self.moe is None:
            del out["moe"]  # a dense model's JSON has no MoE section
        else:
            for stage, raw in zip(self.moe.stages, out["moe"]["stages"]):
                for key in ("dense", "expert"):
                    for optimizer in ("distributed_optimizer", "plain_optimizer"):
                        raw[f"{key}_{optimizer}"]["total"] = getattr(stage, f"{key}_{optimizer}").total
        return out


def plan_memory(
    cfg: Config,
    model: HFModelConfig,
    cluster: ClusterShape,
    *,
    reserve_gib: float = DEFAULT_RESERVE_GIB,
    model_name: str = "",
) -> MemoryPlan:
    """Per-GPU memory of `cfg` on `cluster` for `model`; raises `ConfigError` for an impossible layout.

    One function per phase of the step (module doc): the engine's pool, the training phase of each
    pipeline stage, the rollout phase (generation and weight sync), then what context parallelism
    would take for the longest sequence."""
    p, r, t = cfg.parallel, cfg.rollout, cfg.trainer
    layout = _validate(cfg, model, cluster.world_size)
    gpu = cluster.gpu_memory_bytes
    reserve = reserve_gib * GIB
    longest = r.max_prompt_length + r.max_response_length
    # Per rank, as the actor plans micro-batches: under CP a rank computes 1/CP of each sequence's tokens.
    budget = t.max_tokens_per_micro_batch or math.ceil(t.micro_batch_size * longest / layout.cp)
    engine = _engine_pool(cfg, model, cluster, layout)
    per_stage = [_training_stage(cfg, model, layout, stage, gpu, reserve, budget, engine) for stage in range(layout.pp)]
    stages = [stage for stage, _ in per_stage]
    binding = min(stages, key=lambda s: (s.max_tokens, s.stage))
    if layout.separate:
        rollout = _separate_engine_gpu(cfg, engine, cluster, reserve, longest)
        bucket = r.weight_sync_bucket_mb * 2**20
        between_updates = max(s.actor.total + s.reference for s in stages) + max(bucket, engine.results) + reserve
    else:
        rollout = _rollout_phase(cfg, stages, engine, cluster, reserve, longest)
        between_updates = 0.0
    if engine_returns_routing(cfg, model.is_moe):
        # A generating rank keeps its engine's routing of a generation batch; every rank receives its
        # replica's rows of the train batch (`trainer/routing_exchange.py`).
        kept = routing_host_bytes(model, engine.sequences_per_engine, longest)
        received = routing_host_bytes(model, t.train_batch_size * r.n // layout.dp, longest)
        rollout.routing_host_per_gpu = kept + received
    longest_per_micro_batch = binding.max_tokens * layout.cp
    cp_needed = _smallest_context_parallel(binding.max_tokens, longest, layout.dp * layout.cp)
    notes = _notes(cfg, model, engine, rollout, longest, longest_per_micro_batch, cp_needed)
    if layout.separate:
        notes += _separate_notes(cfg, layout, cluster, model, longest)
    return MemoryPlan(
        model_name=model_name,
        architecture=model.architecture,
        hf_parameters=hf_parameter_count(model),
        nodes=cluster.nodes,
        gpus_per_node=cluster.gpus_per_node,
        world_size=layout.world_size,
        gpu_memory=gpu,
        gpu=cluster.gpu,
        reserve=reserve,
        tp=layout.tp,
        pp=layout.pp,
        vpp=layout.vpp,
        cp=layout.cp,
        dp=layout.dp,
        sequence_parallel=p.sequence_parallel and layout.tp > 1,
        distributed_optimizer=p.use_distributed_optimizer,
        recompute=cfg.model.recompute_activations,
        dtype=cfg.model.dtype,
        reference_built=cfg.algorithm.kl.use_kl_loss,
        engine_pool_during_training=engine.in_training,
        micro_batch_tokens=budget,
        longest_sequence=longest,
        stages=stages,
        binding_stage=binding.stage,
        rollout=rollout,
        max_tokens_per_micro_batch=binding.max_tokens,
        longest_sequence_per_micro_batch=longest_per_micro_batch,
        min_cp_for_longest_sequence=cp_needed,
        training_fits=all(s.training_total <= gpu for s in stages) and longest_per_micro_batch >= longest
        and between_updates <= gpu,
        rollout_fits=rollout.phase_total <= gpu and rollout.concurrent_full_sequences >= 1,
        notes=notes,
        moe=(_expert_plan(model, layout, [parts for _, parts in per_stage], cfg.moe.token_dispatcher)
             if model.is_moe else None),  # fmt: skip
        placement=layout.placement,
        rollout_gpus=layout.rollout_ranks,
        trainer_between_updates=between_updates,
    )


def _validate(cfg: Config, model: HFModelConfig, world: int) -> ParallelLayout:
    """The run's layout on `world` GPUs, with the config's own messages for one that does not fit
    the world or the model."""
    layout = cfg.parallel_layout(world)
    shape = {
        "num_attention_heads": model.num_attention_heads,
        "num_key_value_heads": model.num_key_value_heads,
        "num_hidden_layers": model.num_layers,
        "num_experts": model.num_experts,
    }
    validate_model_shape(cfg, shape)  # heads, query groups, layers, experts vs EP
    check_tensor_parallel(model, layout.tp, "parallel.tp")  # adds the FFN split
    return layout


@dataclass(frozen=True)
class _EnginePool:
    """The rollout engine on one GPU (vLLM's conventions; SGLang's where they differ)."""

    tp: int
    weights: float
    kv_per_token: int
    pool: float
    batched_tokens: int
    num_seqs: int
    activation: float
    in_pool: bool
    """vLLM subtracts its activation peak from its pool; SGLang's static fraction excludes it."""
    engine_in_pool: float
    kv_cache: float
    engines: int
    sequences_per_engine: int
    results: float
    beside_pool: float
    """Allocated next to the pool while it is awake: the gather's result buffers (+ SGLang's activations)."""
    in_training: bool
    """The pool stays through the update (rollout.free_cache_engine off)."""


def _engine_pool(cfg: Config, model: HFModelConfig, cluster: ClusterShape, layout: ParallelLayout) -> _EnginePool:
    r, t = cfg.rollout, cfg.trainer
    gpu = cluster.gpu_memory_bytes
    weights = rollout_weight_parameters(model, layout.rollout_tp) * 2.0
    pool = r.gpu_memory_utilization * gpu
    batched_tokens, num_seqs = vllm_batch_defaults(cluster.gpu_memory_gib, cluster.gpu)
    activation = vllm_activation_peak(model, layout.rollout_tp, batched_tokens, num_seqs)
    in_pool = r.engine != "sglang"
    engine_in_pool = weights + (activation if in_pool else 0.0)
    engines = layout.rollout_engines
    sequences_per_engine = math.ceil(t.gen_batch_size * r.n / engines)
    results = result_buffer_bytes(sequences_per_engine, r.n, r.max_prompt_length, r.max_response_length)
    return _EnginePool(
        tp=layout.rollout_tp,
        weights=weights,
        kv_per_token=kv_cache_bytes_per_token(model, layout.rollout_tp),
        pool=pool,
        batched_tokens=batched_tokens,
        num_seqs=num_seqs,
        activation=activation,
        in_pool=in_pool,
        engine_in_pool=engine_in_pool,
        kv_cache=max(0.0, pool - engine_in_pool),
        engines=engines,
        sequences_per_engine=sequences_per_engine,
        results=results,
        beside_pool=results + (0.0 if in_pool else activation),
        in_training=not r.free_cache_engine and not layout.separate,  # a separate engine is on GPUs of its own
    )


def _training_stage(
    cfg: Config, model: HFModelConfig, layout: ParallelLayout, stage: int, gpu: float, reserve: float, budget: int,
    engine: _EnginePool,
) -> tuple[StageMemory, Optional[ExpertStageMemory]]:
    """The training phase on one pipeline stage's rank: the whole actor, the reference, one
    micro-batch's activations (and the pool if it never sleeps); for an MoE also the state by part.
    The distributed optimizer shards the dense state over DP x CP, the experts' over expert-DP."""
    p, r = cfg.parallel, cfg.rollout
    dense_shards = layout.dp * layout.cp
    split = stage_parameter_split(model, layout.tp, layout.pp, stage, layout.ep)
    params = split.total
    parts = None
    if model.is_moe:
        parts = ExpertStageMemory(
            stage=stage,
            dense_parameters=split.dense,
            expert_parameters=split.expert,
            dense_distributed_optimizer=actor_memory(split.dense, cfg.model.dtype, dense_shards),
            dense_plain_optimizer=actor_memory(split.dense, cfg.model.dtype, 1),
            expert_distributed_optimizer=actor_memory(split.expert, cfg.model.dtype, layout.expert_dp),
            expert_plain_optimizer=actor_memory(split.expert, cfg.model.dtype, 1),
        )
        with_dist = parts.dense_distributed_optimizer + parts.expert_distributed_optimizer
        plain = parts.dense_plain_optimizer + parts.expert_plain_optimizer
        actor = with_dist if p.use_distributed_optimizer else plain
    else:
        with_dist = actor_memory(params, cfg.model.dtype, dense_shards)
        plain = actor_memory(params, cfg.model.dtype, 1)
        actor = actor_memory(params, cfg.model.dtype, dense_shards if p.use_distributed_optimizer else 1)
    reference = params * dtype_bytes(cfg.model.dtype) if cfg.algorithm.kl.use_kl_loss else 0.0
    common = dict(
        vpp=layout.vpp,
        cp=layout.cp,
        sequence_parallel=p.sequence_parallel and layout.tp > 1,
        temperature=r.temperature,
        fused_swiglu=cfg.model.transformer_engine != "off",  # Megatron fuses it only with TE on GPU
        ep=layout.ep,
        moe_dispatcher=cfg.moe.token_dispatcher,
    )
    none = stage_activation_bytes(model, layout.tp, layout.pp, stage, recompute=False, **common)
    full = stage_activation_bytes(model, layout.tp, layout.pp, stage, recompute=True, **common)
    chosen = full if cfg.model.recompute_activations else none
    static = actor.total + reference + reserve + (engine.pool if engine.in_training else 0.0)

    def largest(act: StageActivation) -> int:
        return max(0, math.floor((gpu - static - act.fixed) / act.per_token))

    at_budget = chosen.fixed + chosen.per_token * budget
    memory = StageMemory(
        stage=stage,
        parameters=params,
        actor=actor,
        actor_distributed_optimizer=with_dist,
        actor_plain_optimizer=plain,
        reference=reference,
        activation_per_token=chosen.per_token,
        activation_per_token_no_recompute=none.per_token,
        activation_per_token_full_recompute=full.per_token,
        activation_fixed=chosen.fixed,
        activation_at_budget=at_budget,
        training_total=static + at_budget,
        max_tokens=largest(chosen),
        max_tokens_no_recompute=largest(none),
        max_tokens_full_recompute=largest(full),
    )
    return memory, parts


def _rollout_phase(
    cfg: Config, stages: list[StageMemory], engine: _EnginePool, cluster: ClusterShape, reserve: float, longest: int
) -> RolloutMemory:
    """Generation (the actor state not offloaded + the pool) and the weight sync after the update
    (params + engine weights + one bucket) on the fullest GPU; the largest pool either allows."""
    r = cfg.rollout
    gpu = cluster.gpu_memory_bytes
    bucket = r.weight_sync_bucket_mb * 2**20
    offloaded = [kind for kind in OFFLOAD_KINDS if getattr(cfg.actor, f"offload_{kind}")]

    def kept(stage: StageMemory, away: list[str]) -> float:
        """What `stage` keeps on the GPU while generating when `away` is offloaded."""
        parts = actor_parts(stage.actor)
        return stage.reference + sum(parts[kind] for kind in OFFLOAD_KINDS if kind not in away)

    actor_kept = max(kept(s, offloaded) for s in stages)
    at_sync = max(kept(s, [k for k in offloaded if k != "params"]) for s in stages)  # the push reads the params
    engine_at_sync = engine.weights if r.free_cache_engine else engine.pool
    generation_total = actor_kept + engine.pool + engine.beside_pool + reserve
    sync_total = at_sync + engine_at_sync + bucket + reserve

    def largest_utilization(away: list[str]) -> float:
        room = gpu - max(kept(s, away) for s in stages) - engine.beside_pool - reserve
        if not r.free_cache_engine:  # the pool is there during the sync too
            room = min(room, gpu - max(kept(s, [k for k in away if k != "params"]) for s in stages) - bucket - reserve)
        return max(0.0, room / gpu)

    max_utilization = largest_utilization(offloaded)
    # Offloaded grads are dropped, not copied (their values are dead between updates): no host memory.
    host_per_gpu = max(sum(actor_parts(s.actor)[k] for k in offloaded if k != "grads") for s in stages)
    if r.free_cache_engine and (r.engine == "embedded" or (r.engine == "vllm" and r.sleep_level == 1)):
        host_per_gpu += engine.weights  # a sleeping engine that keeps its weights in host memory (SGLang drops them)
    return RolloutMemory(
        **_engine_figures(engine, longest),
        offloaded=offloaded,
        actor_kept=actor_kept,
        generation_total=generation_total,
        sync_total=sync_total,
        phase_total=max(generation_total, sync_total),
        max_gpu_memory_utilization=max_utilization,
        max_gpu_memory_utilization_resident=largest_utilization([]),
        max_gpu_memory_utilization_offloaded=largest_utilization(list(OFFLOAD_KINDS)),
        concurrent_full_sequences_at_max=_full_sequences(engine, max_utilization * gpu, longest),
        host_per_gpu=host_per_gpu,
        host_per_node=host_per_gpu * cluster.gpus_per_node,
    )


def _full_sequences(engine: _EnginePool, pool_bytes: float, longest: int) -> int:
    """Full-length sequences whose KV cache fits a pool of `pool_bytes` beside the engine's weights."""
    return int(max(0.0, pool_bytes - engine.engine_in_pool) // (engine.kv_per_token * longest))


def _engine_figures(engine: _EnginePool, longest: int) -> dict[str, Any]:
    """The `RolloutMemory` fields that describe the engine itself, in every placement."""
    return dict(
        tp=engine.tp,
        engines=engine.engines,
        weights=engine.weights,
        kv_bytes_per_token=engine.kv_per_token,
        pool=engine.pool,
        activation_peak=engine.activation,
        activation_in_pool=engine.in_pool,
        max_num_batched_tokens=engine.batched_tokens,
        max_num_seqs=engine.num_seqs,
        kv_cache=engine.kv_cache,
        result_buffers=engine.results,
        full_sequence_tokens=longest,
        concurrent_full_sequences=_full_sequences(engine, engine.pool, longest),
        generation_sequences_per_engine=engine.sequences_per_engine,
    )


def _separate_engine_gpu(cfg: Config, engine: _EnginePool, cluster: ClusterShape, reserve: float, longest: int) -> RolloutMemory:
    """A rollout GPU of the separate placement: the pool (never asleep) and what sits beside it
    (SGLang's activations), and during a push the bucket it receives (`rollout/sync/remote.py`: one
    flat buffer per dtype); no actor, no offload, no gathered results (those go to the trainer)."""
    r = cfg.rollout
    gpu = cluster.gpu_memory_bytes
    bucket = r.weight_sync_bucket_mb * 2**20
    beside = 0.0 if engine.in_pool else engine.activation
    generation_total = engine.pool + beside + reserve
    sync_total = generation_total + bucket  # the owner loads a push between requests: the pool stays
    largest = max(0.0, (gpu - beside - bucket - reserve) / gpu)
    return RolloutMemory(
        **_engine_figures(engine, longest),
        offloaded=[],
        actor_kept=0.0,
        generation_total=generation_total,
        sync_total=sync_total,
        phase_total=sync_total,
        max_gpu_memory_utilization=largest,
        max_gpu_memory_utilization_resident=largest,
        max_gpu_memory_utilization_offloaded=largest,
        concurrent_full_sequences_at_max=_full_sequences(engine, largest * gpu, longest),
        host_per_gpu=0.0,
        host_per_node=0.0,
        separate=True,
    )


def _separate_notes(cfg: Config, layout: ParallelLayout, cluster: ClusterShape, model: HFModelConfig, longest: int) -> list[str]:
    """What the split of the cluster means for the separate placement."""
    notes = []
    if engine_returns_routing(cfg, model.is_moe):
        # The head receives every engine's samples, so their routing stays in its store until trained
        # (`trainer/routing_exchange.py`); asynchronous training holds the batches generated ahead too.
        t = cfg.trainer
        batch = routing_host_bytes(model, t.gen_batch_size * cfg.rollout.n, longest)
        held = (1 + t.max_staleness) * batch
        notes.append(
            f"the trainer's head (launch rank 0) keeps the engines' MoE routing of every sample not yet trained in host "
            f"memory: {batch / GIB:.1f} GiB a generation batch at full length, up to ~{held / GIB:.1f} GiB with "
            f"trainer.max_staleness={t.max_staleness} (batches generated ahead and carried groups); "
            "actor.router_replay=r2 with rollout.return_routed_experts=false keeps none"
        )
    trainer, engines = layout.world_size, layout.rollout_ranks
    per_node = cluster.gpus_per_node
    if engines % per_node or trainer % per_node:
        notes.append(
            f"rollout.num_gpus={engines} does not split the {cluster.nodes} node(s) of {per_node} GPUs into whole nodes: "
            "one node holds trainer and engine ranks (it works; whole nodes keep the trainer's NCCL traffic off the engines' links)"
        )
    if any(getattr(cfg.actor, f"offload_{kind}") for kind in OFFLOAD_KINDS):
        notes.append("actor.offload_* frees nothing useful with rollout.placement=separate (no engine shares the trainer's GPUs)")
    return notes


def _smallest_context_parallel(max_tokens: int, longest: int, cp_world: int) -> Optional[int]:
    """The smallest parallel.cp (a divisor of world / (TP x PP)) whose micro-batch holds `longest`.

    At a fixed world size, TP and PP the actor state per GPU does not depend on CP (the distributed
    optimizer shards over DP x CP and the experts' over DP x CP / EP, constants), so the longest
    sequence grows exactly with CP."""
    wanted = math.ceil(longest / max_tokens) if max_tokens > 0 else None
    choices = [c for c in range(1, cp_world + 1) if cp_world % c == 0]
    return next((c for c in choices if wanted is not None and c >= wanted), None)


def _notes(
    cfg: Config, model: HFModelConfig, engine: _EnginePool, rollout: RolloutMemory, longest: int,
    longest_per_micro_batch: int, cp_needed: Optional[int],
) -> list[str]:
    """What the table says under the figures: choices that change them and how to make a phase fit."""
    p, r = cfg.parallel, cfg.rollout
    notes = []
    if not p.use_distributed_optimizer:
        notes.append("parallel.use_distributed_optimizer=false: every rank keeps all optimizer state")
    if engine.pool <= engine.engine_in_pool:
        notes.append(
            "the rollout pool cannot even hold the engine weights and vLLM's profiled activations: raise "
            "rollout.gpu_memory_utilization or rollout.tp"
        )
    if rollout.concurrent_full_sequences < 1:
        notes.append("the KV pool holds no full-length sequence: raise rollout.gpu_memory_utilization or rollout.tp")
    if r.engine == "embedded":
        notes.append("rollout.engine=embedded has no memory pool: the rollout figures are those of a vLLM engine")
    if r.engine == "sglang":
        notes.append(
            "rollout.engine=sglang: its activations live outside mem_fraction_static (counted next to the pool, "
            "with vLLM's estimate of them)"
        )
    if cfg.model.transformer_engine == "off":
        notes.append(
            "model.transformer_engine=off: the local layer spec runs right-padded rows (no packing), so a "
            "micro-batch's tokens count its padding (rows x longest row); SwiGLU counted unfused"
        )
    if model.is_moe:
        notes.append(
            "mixture of experts: routing counted as balanced (each expert's rank gets its share of the tokens); "
            "a rank whose experts draw more tokens holds more dispatch and expert activations"
        )
    if longest_per_micro_batch < longest:
        remedy = f"set parallel.cp >= {cp_needed} (context parallelism), " if cp_needed else ""
        notes.append(
            f"one full-length sequence ({longest} tokens) does not fit a micro-batch ({longest_per_micro_batch} "
            f"tokens at CP={p.cp}): {remedy}enable model.recompute_activations, sequence parallelism, or raise "
            "parallel.tp / parallel.pp"
        )
    return notes


def _expert_plan(model: HFModelConfig, layout: ParallelLayout, stages: list[ExpertStageMemory], dispatcher: str) -> ExpertPlan:
    ep = layout.ep
    return ExpertPlan(
        num_experts=model.num_experts,
        experts_per_token=model.num_experts_per_tok,
        shared_expert=bool(model.shared_expert_ffn_hidden_size),
        ep=ep,
        expert_tp=layout.expert_tp,
        expert_dp=layout.expert_dp,
        experts_per_rank=local_experts(model, ep),
        hf_expert_parameters=model.num_layers * layer_parameters(model).expert,
        active_parameters=hf_active_parameter_count(model),
        dispatcher=dispatcher,
        dispatch_bytes_per_token=dispatch_buffer_bytes_per_token(model, ep, dispatcher),
        stages=stages,
    )

