"""Rollout experience: generate + score one batch of prompts, merge replicas, build the policy batch.

`Samples` is the driver loop's record of one generation batch: one entry per response (prompt-major,
the n responses of a prompt contiguous) with named fields, so the loop never passes an untyped
"data proto" around. The leader of each data-parallel replica produces its share
(`generate_and_score`); `gather_samples` gives every rank the whole batch in the same order, so that
dynamic sampling and advantages are computed identically everywhere.

Token ids and log-probs are 1-D tensors per response (views into one buffer after a gather): they
travel between ranks as one flat int32 buffer per replica (`pack_samples` / `unpack_samples`), the
prompt of a group once rather than n times; only the small per-sample fields are pickled.
"""

from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass, fields
from typing import Any, Callable, ContextManager, Optional, Sequence

import torch
import torch.distributed as dist

from megatron_dapo.rollout.base import SamplingParams, WeightPushes, oldest_version
from megatron_dapo.actor import PolicyBatch
from megatron_dapo.config import FILTER_GROUP_METRICS
from megatron_dapo.distributed.objects import data_parallel_rank_and_size
from megatron_dapo.distributed.tensor_gather import share_from_contributors
from megatron_dapo.reward.overlong import overlong_loss_mask
from megatron_dapo.trainer.routing_exchange import RoutingStore


@dataclass
class Samples:
    """Per-response fields of a batch of generations (all lists of the same length)."""

    uid: list[str]
    """The prompt group of each response (unique within a training step)."""
    prompt_ids: list[torch.Tensor]
    """int64 [prompt length] per response (the n responses of a prompt may share one tensor)."""
    response_ids: list[torch.Tensor]
    """int64 [response length]."""
    rollout_log_probs: list[torch.Tensor]
    """float32 [response length]: the engine's log-prob of each sampled token."""
    truncated: list[bool]
    """Stopped by the length limit (the engine's finish reason)."""
    score: list[float]
    """Reward used for advantages: task score (or the minimum reward) + overlong penalty."""
    task_score: list[float]
    """The reward function's score alone, before the overlong penalty (`critic/score/*`)."""
    acc: list[bool]
    pred: list[Any]
    overlong_penalty: list[float]
    data_source: list[str]
    reward_error: list[Optional[str]]
    """Why the reward function failed on the response (it then scores reward.min_reward), None where it scored."""
    routed_experts: Optional[list[torch.Tensor]] = None
    """Mixture-of-experts models, when the engine returned it (`SamplingParams.return_routed_experts`):
    [prompt + response - 1, MoE layers, top-k] of `actor.routing.routing_dtype`, the experts of every
    token the model read."""
    routing_ref: Optional[list[tuple[int, int]]] = None
    """Instead of ``routed_experts`` after a `gather_samples` with a `RoutingStore`: where each
    sample's routing stays (owner rank, index) until `routing_exchange.fetch_routing` delivers it."""
    weight_version: Optional[list[int]] = None
    """The separate placement: how many updates the engine's weights had when it generated the sample
    (the trainer at step t starts from version t - 1; the difference is the sample's staleness). With
    partial rollouts, the oldest version of any of its tokens."""
    version_spans: Optional[list[tuple[tuple[int, int], ...]]] = None
    """Partial rollouts (`rollout.partial_rollouts`): the version of each run of the response's
    tokens (`rollout.base.VersionSpans`: (first token, version), ...)."""

    def __post_init__(self) -> None:
        for name in _PER_SAMPLE_OPTIONAL:
            values = getattr(self, name)
            if values is not None and len(values) != len(self.uid):
                raise ValueError(f"{len(values)} {name} for {len(self.uid)} samples")

    def __len__(self) -> int:
        return len(self.uid)

    def as_fields(self) -> dict[str, Any]:
        """The fields as `DynamicSamplingBuffer` stores them (lists, indexed by sample); no
        ``routed_experts`` / ``routing_ref`` key where there is none."""
        values = {f.name: getattr(self, f.name) for f in fields(self)}
        for name in _PER_SAMPLE_OPTIONAL:
            if values[name] is None:
                del values[name]
        return values

    @classmethod
    def from_fields(cls, values: dict[str, Any]) -> "Samples":
        return cls(**{f.name: list(values[f.name]) for f in fields(cls) if f.name in values})

    @classmethod
    def concat(cls, parts: Sequence["Samples"]) -> "Samples":
        names = [f.name for f in fields(cls) if f.name not in _PER_SAMPLE_OPTIONAL]
        merged = cls(**{name: [v for part in parts for v in getattr(part, name)] for name in names})
        for name in _PER_SAMPLE_OPTIONAL:
            present = [getattr(part, name) is not None for part in parts if len(part)]
            if present and all(present):
                setattr(merged, name, [v for part in parts for v in (getattr(part, name) or [])])
            elif any(present):
                raise ValueError(f"some generation batches carry {name.replace('_', ' ')} and others not")
        return merged


_PER_SAMPLE_OPTIONAL = ("routed_experts", "routing_ref", "weight_version", "version_spans")


def generate_and_score(
    rollout,
    reward_manager,
    examples: Sequence[Any],
    params: SamplingParams,
    uid_prefix: str,
    *,
    validating: bool = False,
    apply_overlong: bool = True,
    routing_dtype: torch.dtype = torch.int32,
    during_generate: Callable[[], ContextManager] = contextlib.nullcontext,
    call_off: Optional[Callable[[], bool]] = None,
    pushes: Optional[WeightPushes] = None,
) -> Optional[Samples]:
    """Generate `params.n` responses per example and score them where `rollout.is_leader`; None elsewhere.

    `examples` are `data.PromptExample`s (prompt ids, ground truth, data source, extra info); the uid
    of example i is ``f"{uid_prefix}{i}"``. Routed experts, when the engine returns them, are kept
    in host memory as `routing_dtype` (`actor.routing.routing_dtype` of the model: 1 byte an entry
    up to 128 experts). `during_generate()` is entered around the engine's generate (the trainer's
    `SigtermFlag.interruptible`, where a SIGTERM may abandon it; `SigtermFlag.calling_off_generation`
    in the spmd placement). `call_off` (spmd placement only) goes to `rollout.generate`: this rank's
    vote, asked every few engine steps, to abandon the batch (`GenerationCalledOff` on every rank of
    the engine). `pushes` (partial rollouts, the separate placement's engine owners): weight pushes
    the engine takes between decode steps (`WeightPushes`); each sample then carries its tokens'
    `version_spans` and, as `weight_version`, the oldest of them.
    """
    if not examples:
        return Samples.concat([]) if rollout.is_leader else None
    # Every rank calls generate: in the spmd placement all ranks of an engine generate together.
    with during_generate():
        stop = {} if call_off is None else {"call_off": call_off}
        if pushes is not None:
            stop["pushes"] = pushes
        out = rollout.generate([ex.prompt_ids for ex in examples], params, **stop)
    if out is None:
        return None
    owners = [examples[i] for i in out.prompt_index]
    rewards = reward_manager.score(
        out.response_ids,
        [ex.ground_truth for ex in owners],
        data_sources=[ex.data_source for ex in owners],
        extra_infos=[ex.extra_info for ex in owners],
        validating=validating,
        apply_overlong=apply_overlong,
    )
    log_probs = out.log_probs or [torch.zeros(len(r)) for r in out.response_ids]
    prompts = [torch.as_tensor(ex.prompt_ids, dtype=torch.long) for ex in examples]
    return Samples(
        uid=[f"{uid_prefix}{i}" for i in out.prompt_index],
        prompt_ids=[prompts[i] for i in out.prompt_index],
        response_ids=[torch.as_tensor(r, dtype=torch.long).reshape(-1) for r in out.response_ids],
        rollout_log_probs=[torch.as_tensor(lp, dtype=torch.float32).reshape(-1) for lp in log_probs],
        truncated=[bool(t) for t in out.truncated.tolist()],
        score=rewards.scores.tolist(),
        task_score=rewards.raw_scores.tolist(),
        acc=[bool(a) for a in rewards.acc.tolist()],
        pred=list(rewards.preds),
        overlong_penalty=rewards.overlong_penalty.tolist(),
        data_source=[ex.data_source for ex in owners],
        reward_error=list(rewards.errors),
        routed_experts=None if out.routed_experts is None else [torch.as_tensor(r).to("cpu", routing_dtype) for r in out.routed_experts],
        weight_version=None if out.weight_versions is None else [oldest_version(spans) for spans in out.weight_versions],
        version_spans=None if out.weight_versions is None else [tuple(spans) for spans in out.weight_versions],
    )


def filter_metric(samples: Samples, name: str) -> torch.Tensor:
    """float64 [len(samples)]: the value `algorithm.filter_groups.metric=name` compares within a group."""
    if name == "acc":
        values: list = samples.acc
    elif name == "score":
        values = samples.task_score
    elif name == "seq_reward":
        values = samples.score
    else:
        raise ValueError(f"unknown algorithm.filter_groups.metric {name!r}; use one of {', '.join(FILTER_GROUP_METRICS)}")
    return torch.tensor(values, dtype=torch.float64)


def gather_samples(
    local: Optional[Samples],
    order_key: Optional[int] = None,
    meet_on: Optional[Any] = None,
    routing_store: Optional[RoutingStore] = None,
) -> Samples:
    """Every rank gets all contributors' samples, in `order_key` order (world collective).

    Contributors are the ranks with samples (`generate_and_score` returns None on the others);
    `order_key` defaults to the data-parallel rank, so replica 0's samples come first. Called right
    after engines generated on their own: ranks first meet on the gather group (gloo,
    `rollout.gather_timeout_s`; `meet_on` overrides it), then the token buffers move over the default
    group (`tensor_gather.share_from_contributors`). MoE routing, when present, moves in a second
    exchange over the gather group in host memory (it never lands on a GPU), in its compact type; with
    a `routing_store` (training) it does not move at all: the contributor keeps it there and the
    samples carry ``routing_ref`` for `routing_exchange.fetch_routing` once the train batch is chosen.
    """
    key, header, payload, routing = None, None, None, None
    if local is not None:
        if routing_store is not None and local.routed_experts is not None:
            owner = dist.get_rank() if dist.is_initialized() else 0
            refs = routing_store.keep(owner, local.routed_experts)
            _routing_shape(local)  # the same checks as a shared routing: it covers the tokens the model reads
            local = dataclasses.replace(local, routed_experts=None, routing_ref=refs)
        header, payload, routing = pack_samples(local)
        key = data_parallel_rank_and_size()[0] if order_key is None else order_key
    shared = share_from_contributors(key, header, payload, meet_on=meet_on)
    routings: list[Optional[torch.Tensor]] = [None] * len(shared)
    if any(entry_header["routing_shape"] is not None for entry_header, _ in shared):  # the same verdict on every rank
        mine = routing if routing is not None else torch.empty(0, dtype=torch.int8)
        routed = share_from_contributors(key, None, mine, meet_on=meet_on, on_host=True)
        routings = [flat for _, flat in routed]
    return Samples.concat([unpack_samples(h, p, r) for (h, p), r in zip(shared, routings)])


_TENSOR_FIELDS = ("prompt_ids", "response_ids", "rollout_log_probs", "routed_experts")


def pack_samples(samples: Samples) -> tuple[dict[str, Any], torch.Tensor, Optional[torch.Tensor]]:
    """(header, payload, routing): the small fields as lists; one flat int32 tensor holding the
    prompts (each run of responses sharing a prompt sends it once), the responses and the float32
    log-probs' bits; and the routed experts, when present, as one flat tensor of their own compact
    type (None otherwise). `unpack_samples` inverts it exactly (the log-probs bit for bit)."""
    prompt_runs: list[int] = []  # how many consecutive responses share each distinct prompt
    prompts: list[torch.Tensor] = []
    for prompt in samples.prompt_ids:
        if prompts and (prompt is prompts[-1] or torch.equal(prompt, prompts[-1])):
            prompt_runs[-1] += 1
        else:
            prompts.append(prompt)
            prompt_runs.append(1)
    header = {name: value for name, value in samples.as_fields().items() if name not in _TENSOR_FIELDS}
    header["prompt_runs"] = prompt_runs
    header["prompt_lengths"] = [int(p.numel()) for p in prompts]
    header["response_lengths"] = [int(r.numel()) for r in samples.response_ids]
    for response, log_probs in zip(samples.response_ids, samples.rollout_log_probs):
        if log_probs.numel() != response.numel():
            raise ValueError(f"a response has {response.numel()} tokens but {log_probs.numel()} rollout log-probs")
    parts = [torch.cat(prompts) if prompts else torch.empty(0, dtype=torch.long)]
    parts.append(torch.cat(samples.response_ids) if len(samples) else torch.empty(0, dtype=torch.long))
    ids = torch.cat(parts).to(torch.int32)
    if len(samples):
        log_probs = torch.cat([lp.to(torch.float32) for lp in samples.rollout_log_probs])
    else:
        log_probs = torch.empty(0, dtype=torch.float32)
    header["routing_shape"] = None
    routing = None
    if samples.routed_experts is not None:
        header["routing_shape"] = _routing_shape(samples)
        dtype = samples.routed_experts[0].dtype if len(samples) else torch.int8
        routing = torch.cat([r.to(dtype).reshape(-1) for r in samples.routed_experts]) if len(samples) else torch.empty(0, dtype=dtype)
    return header, torch.cat([ids, log_probs.view(torch.int32)]), routing


def _routing_shape(samples: Samples) -> Optional[list[int]]:
    """[layers, top-k] of the samples' routing, after checking each covers the tokens the model read."""
    shape = None
    for prompt, response, routing in zip(samples.prompt_ids, samples.response_ids, samples.routed_experts or []):
        read = prompt.numel() + response.numel() - 1
        if routing.dim() != 3 or routing.shape[0] != read or (shape is not None and list(routing.shape[1:]) != shape):
            raise ValueError(
                f"routed experts of shape {tuple(routing.shape)} for a sequence the model reads {read} tokens of "
                f"(want [{read}, layers, top-k], the same layers and top-k for every sample)"
            )
        shape = list(routing.shape[1:])
    if len({r.dtype for r in samples.routed_experts or []}) > 1:
        raise ValueError("the samples' routed experts differ in type: give generate_and_score one routing_dtype")
    return shape


def unpack_samples(header: dict[str, Any], payload: torch.Tensor, routing: Optional[torch.Tensor] = None) -> Samples:
    """The `Samples` that `pack_samples` turned into (header, payload, routing); tensors are views of
    the buffers."""
    prompt_lengths, response_lengths = header["prompt_lengths"], header["response_lengths"]
    num_prompt_tokens, num_response_tokens = sum(prompt_lengths), sum(response_lengths)
    sample_prompt_lengths = [n for n, run in zip(prompt_lengths, header["prompt_runs"]) for _ in range(run)]
    routing_shape = header.get("routing_shape")
    per_token = 0 if routing_shape is None else routing_shape[0] * routing_shape[1]
    read_lengths = [p + r - 1 for p, r in zip(sample_prompt_lengths, response_lengths)]
    expected = num_prompt_tokens + 2 * num_response_tokens
    if payload.numel() != expected:
        raise ValueError(f"payload has {payload.numel()} values, the header describes {expected}")
    if routing_shape is not None and (routing is None or routing.numel() != per_token * sum(read_lengths)):
        got = None if routing is None else routing.numel()
        raise ValueError(f"routing has {got} entries, the header describes {per_token * sum(read_lengths)}")
    ids = payload[: num_prompt_tokens + num_response_tokens].long()
    log_probs_end = num_prompt_tokens + 2 * num_response_tokens
    log_probs = payload[num_prompt_tokens + num_response_tokens : log_probs_end].view(torch.float32)
    distinct_prompts = torch.split(ids[:num_prompt_tokens], prompt_lengths)
    prompt_ids = [prompt for prompt, run in zip(distinct_prompts, header["prompt_runs"]) for _ in range(run)]
    routed = None
    if routing_shape is not None:
        flat = torch.split(routing, [per_token * n for n in read_lengths])
        routed = [part.view(n, *routing_shape) for part, n in zip(flat, read_lengths)]
    skip = ("prompt_runs", "prompt_lengths", "response_lengths", "routing_shape")
    fields = {name: value for name, value in header.items() if name not in skip}
    return Samples(
        prompt_ids=prompt_ids,
        response_ids=list(torch.split(ids[num_prompt_tokens:], response_lengths)),
        rollout_log_probs=list(torch.split(log_probs, response_lengths)),
        routed_experts=routed,
        **fields,
    )


def build_policy_batch(
    samples: Samples,
    advantages: torch.Tensor,
    pad_token_id: int,
    response_width: int,
    mask_truncated: bool = False,
):
    """The `PolicyBatch` of `samples` (advantages per sequence; rollout log-probs kept for
    mismatch metrics and truncated IS). `mask_truncated` drops truncated responses from the loss
    (DAPO's overlong filtering, `algorithm.overlong_filter`)."""
    rollout = torch.zeros(len(samples), response_width)
    for row, values in enumerate(samples.rollout_log_probs):
        rollout[row, : len(values)] = torch.as_tensor(values, dtype=torch.float32)
    batch = PolicyBatch.from_token_lists(
        samples.prompt_ids,
        samples.response_ids,
        response_width=response_width,
        pad_token_id=pad_token_id,
        advantages=advantages.float(),
        rollout_log_probs=rollout,
    )
    if mask_truncated:
        batch.response_mask = overlong_loss_mask(torch.tensor(samples.truncated, dtype=torch.bool), batch.response_valid_mask())
    if samples.routed_experts is not None:
        batch.rollout_routed_experts = _routing_tensor(samples.routed_experts, batch.sequence_width)
    return batch


def _routing_tensor(routed_experts: Sequence[torch.Tensor], width: int) -> torch.Tensor:
    """[n, width, layers, top-k] from per-sample routings, in their compact type (positions past each one: -1)."""
    shape = routed_experts[0].shape[1:] if routed_experts else (0, 0)
    dtype = routed_experts[0].dtype if routed_experts else torch.int8
    out = torch.full((len(routed_experts), width, *shape), -1, dtype=dtype)
    for row, routing in enumerate(routed_experts):
        out[row, : routing.shape[0]] = routing
    return out
