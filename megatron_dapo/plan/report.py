"""The plan as the table `megatron-dapo plan` prints (figures in GiB = 2^30 bytes)."""

from __future__ import annotations

import math

from megatron_dapo.plan.phases import MemoryPlan
from megatron_dapo.plan.shapes import GIB, GPU_MODELS


def _gib(value: float) -> str:
    return f"{value / GIB:8.2f} GiB"


def format_utilization(fraction: float) -> str:
    """A utilisation with two decimals, rounded down (a printed limit must not exceed the real one)."""
    return f"{math.floor(fraction * 100 + 1e-9) / 100:.2f}"


def _row(label: str, *values: str) -> str:
    return (f"  {label:<54}" + "".join(f"{v:>18}" for v in values)).rstrip()


def _gpu_label(name: str) -> str:
    model = GPU_MODELS.get(name.lower())
    return f"{model.label} as reported" if model else name


def _expert_lines(plan: MemoryPlan) -> list[str]:
    """A mixture of experts' section: the experts' layout and the actor state of the binding stage by part."""
    moe = plan.moe
    assert moe is not None
    part = moe.stages[plan.binding_stage]
    dense = "attention, embeddings, norms, router" + (", shared expert" if moe.shared_expert else "")
    return [
        "",
        f"  mixture of experts: {moe.num_experts} experts per layer, top-{moe.experts_per_token} per token; "
        f"{moe.hf_expert_parameters / 1e9:.2f}B of the {plan.hf_parameters / 1e9:.2f}B parameters are experts, "
        f"{moe.active_parameters / 1e9:.2f}B active per token",
        f"    {moe.experts_per_rank} experts per GPU (EP={moe.ep}), each split over expert-TP={moe.expert_tp} (= TP); "
        f"expert DP={moe.expert_dp} (copies of each expert: DP x CP / EP)",
        _row("  actor by part (per GPU)", "dist. optimizer", "no dist. optim."),
        _row(
            f"    dense ({part.dense_parameters / 1e9:.3f}B parameters)",
            _gib(part.dense_distributed_optimizer.total),
            _gib(part.dense_plain_optimizer.total),
        ),
        _row(
            f"    experts ({part.expert_parameters / 1e9:.3f}B parameters)",
            _gib(part.expert_distributed_optimizer.total),
            _gib(part.expert_plain_optimizer.total),
        ),
        f"    dense: {dense}; the distributed optimizer shards its state over DP x CP = {plan.dp * plan.cp}, "
        f"the experts' over expert DP = {moe.expert_dp}",
    ]


def _offload_lines(plan: MemoryPlan) -> list[str]:
    r = plan.rollout
    return [
        _row("actor offload while generating (actor.offload_*)", ", ".join(r.offloaded) or "none"),
        _row("  actor state kept on the GPU (+ reference)", _gib(r.actor_kept)),
        _row("  host memory, pinned (per GPU, per node)", _gib(r.host_per_gpu), _gib(r.host_per_node)),
    ]


def _colocated_phase_lines(plan: MemoryPlan, fits) -> list[str]:
    r = plan.rollout
    return [
        _row("  generation: kept actor state + ref + pool + results", _gib(r.generation_total), fits(r.generation_total)),
        _row(
            "  weight sync: params + kept + engine "
            + ("weights" if not plan.engine_pool_during_training else "pool")
            + " + bucket",
            _gib(r.sync_total),
            fits(r.sync_total),
        ),
        _row(
            "  training: actor + ref + activations" + (" + pool" if plan.engine_pool_during_training else ""),
            _gib(max(x.training_total for x in plan.stages)),
            "yes" if plan.training_fits else "NO",
        ),
    ]


def _separate_phase_lines(plan: MemoryPlan, fits) -> list[str]:
    r = plan.rollout
    training = max(x.training_total for x in plan.stages)
    return [
        _row("  rollout GPU, generating: pool" + ("" if r.activation_in_pool else " + activations"), _gib(r.generation_total),
             fits(r.generation_total)),
        _row("  rollout GPU, receiving a push: pool + bucket", _gib(r.sync_total), fits(r.sync_total)),
        _row("  trainer GPU, training: actor + ref + activations", _gib(training), fits(training)),
        _row("  trainer GPU, between updates: actor + ref + bucket", _gib(plan.trainer_between_updates),
             fits(plan.trainer_between_updates)),
    ]  # fmt: skip


def _largest_utilization_line(r) -> str:
    if r.separate:
        return (f"largest rollout.gpu_memory_utilization: {format_utilization(r.max_gpu_memory_utilization)} on the engines' "
                f"own GPUs ({r.concurrent_full_sequences_at_max} full-length sequences per engine)")  # fmt: skip
    return (
        "largest rollout.gpu_memory_utilization: "
        f"{format_utilization(r.max_gpu_memory_utilization)} with this offload "
        f"({r.concurrent_full_sequences_at_max} full-length sequences per engine); "
        f"{format_utilization(r.max_gpu_memory_utilization_resident)} with the actor resident, "
        f"{format_utilization(r.max_gpu_memory_utilization_offloaded)} with params, grads and optimizer offloaded"
    )


def format_plan(plan: MemoryPlan) -> str:
    """The plan as a readable table (what `megatron-dapo plan` prints)."""
    s = plan.stages[plan.binding_stage]
    on = lambda flag: "on" if flag else "off"  # noqa: E731
    fits = lambda total: "yes" if total <= plan.gpu_memory else "NO"  # noqa: E731
    r = plan.rollout
    moe = plan.moe
    active = f", {moe.active_parameters / 1e9:.2f}B active" if moe else ""
    lines = [
        f"memory plan: {plan.model_name or plan.architecture} ({plan.architecture}, {plan.hf_parameters / 1e9:.2f}B "
        f"parameters{active}) on {plan.nodes} node(s) x {plan.gpus_per_node} GPUs = {plan.nodes * plan.gpus_per_node}, "
        f"{plan.gpu_memory / GIB:.1f} GiB per GPU ({_gpu_label(plan.gpu)}), reserve {plan.reserve / GIB:.1f} GiB",
        *(
            [f"rollout.placement=separate: {plan.world_size} GPUs train, {plan.rollout_gpus} hold the engines "
             f"({r.engines} engine(s) of rollout.tp={r.tp}); each pool is planned on its own GPUs"]
            if r.separate else []
        ),  # fmt: skip
        f"layout: TP={plan.tp} PP={plan.pp}" + (f" VPP={plan.vpp}" if plan.vpp else "") + f" CP={plan.cp} "
        f"DP={plan.dp}" + (f" EP={moe.ep}" if moe else "") + "; sequence parallel "
        f"{on(plan.sequence_parallel)}, distributed optimizer "
        f"{on(plan.distributed_optimizer)}, full recompute {on(plan.recompute)}; {plan.dtype}",
        f"pipeline stage shown: {s.stage} of {plan.pp} (the one with the smallest token budget); "
        f"{s.parameters / 1e9:.3f}B parameters on each of its GPUs",
        "",
        _row("actor (per GPU)", "dist. optimizer", "no dist. optim."),
    ]
    d, n = s.actor_distributed_optimizer, s.actor_plain_optimizer
    lines += [
        _row(f"  params ({plan.dtype})", _gib(d.params), _gib(n.params)),
        _row("  grads (fp32 DDP grad buffer)", _gib(d.grads), _gib(n.grads)),
        _row("  main params (fp32)", _gib(d.main_params), _gib(n.main_params)),
        _row("  Adam moments (fp32 m, v)", _gib(d.optimizer), _gib(n.optimizer)),
        _row("  total", _gib(d.total), _gib(n.total)),
        _row(
            "reference model (bf16, actor layout)",
            _gib(s.reference if plan.reference_built else s.parameters * 2),
            "counted" if plan.reference_built else "not built (no KL)",
        ),
        *(_expert_lines(plan) if moe else []),
        "",
        _row(f"rollout engine (rollout.tp={r.tp}, {r.engines} engines)"),
        _row("  weights (bf16)", _gib(r.weights)),
        _row("  KV cache per token", f"{r.kv_bytes_per_token / 1024:8.1f} KiB"),
        _row("  pool (gpu_memory_utilization x GPU)", _gib(r.pool)),
        _row(
            f"  profiled activation peak ({r.max_num_batched_tokens} tokens, {r.max_num_seqs} seqs)",
            _gib(r.activation_peak),
            "in the pool" if r.activation_in_pool else "beside the pool",
        ),
        _row("  KV cache (pool - weights" + (" - activation peak)" if r.activation_in_pool else ")"), _gib(r.kv_cache)),
        _row(f"  full-length sequences ({r.full_sequence_tokens} tokens) at once", f"{r.concurrent_full_sequences:>12} / engine"),
        _row("  sequences per generation batch", f"{r.generation_sequences_per_engine:>12} / engine"),
        _row("  result buffers while generating (gathered rollouts)", _gib(r.result_buffers)),
        "",
        *(_offload_lines(plan) if not r.separate else []),
        *(
            [_row("  MoE routing kept + received, host (per GPU, per node)", _gib(r.routing_host_per_gpu),
                  _gib(r.routing_host_per_gpu * plan.gpus_per_node))]
            if r.routing_host_per_gpu else []
        ),  # fmt: skip
        "",
        _row("activations (actor update, per token)", "no recompute", "full recompute"),
        _row(
            "  per token of the micro-batch",
            f"{s.activation_per_token_no_recompute / 1024:8.1f} KiB",
            f"{s.activation_per_token_full_recompute / 1024:8.1f} KiB",
        ),
        *(
            [_row(f"  of which token dispatch ({moe.dispatcher}, in + out)", f"{moe.dispatch_bytes_per_token / 1024:8.1f} KiB")]
            if moe
            else []
        ),
        _row("  fixed (log-prob chunk buffers)", _gib(s.activation_fixed)),
        _row(
            "  largest micro-batch token budget",
            f"{s.max_tokens_no_recompute:>12}",
            f"{s.max_tokens_full_recompute:>12}",
        ),
        _row(f"  at the config's budget ({plan.micro_batch_tokens} tokens)", _gib(s.activation_at_budget)),
        "",
        _row("phase totals (fullest GPU, reserve included)", "total", "fits"),
        *(_separate_phase_lines(plan, fits) if r.separate else _colocated_phase_lines(plan, fits)),
        "",
        f"largest trainer.max_tokens_per_micro_batch: {plan.max_tokens_per_micro_batch} "
        f"(full recompute {on(plan.recompute)}; config uses {plan.micro_batch_tokens}, "
        f"longest sequence {plan.longest_sequence})",
        f"context parallelism: at CP={plan.cp} one micro-batch holds a sequence of up to "
        f"{plan.longest_sequence_per_micro_batch} tokens; the longest sequence ({plan.longest_sequence}) needs "
        + (f"CP >= {plan.min_cp_for_longest_sequence}" if plan.min_cp_for_longest_sequence else "more memory than any CP gives"),
        _largest_utilization_line(r),
    ]
    lines += [f"note: {note}" for note in plan.notes]
    return "\n".join(lines)
