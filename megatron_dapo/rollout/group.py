"""The rollout engines as the driver loop sees them: placement, generation, weight sync, sleep.

Placement (`rollout.placement`, see `distributed/placement.py`):

* "leader": each replica (the TP x PP x CP ranks that hold one copy of the actor) has one engine,
  created on the replica's first rank (`is_replica_leader`), which generates the replica's share of
  the prompts. On a GPU node the engine shares the leader's GPU with training (colocated).
* "spmd" (vLLM): every rank holds its shard of its rollout-TP group's engine (`rollout.tp`
  consecutive ranks, vLLM's external launcher); all ranks of a group generate the group's share of
  the prompts together and its first rank hands the results on. Nothing idles while generating,
  and a node whose tasks own one GPU each works.

`data_rank` / `data_size` say which share of the prompts this rank's engine generates (the actor's
data-parallel rank and size in the leader placement, the rollout-DP rank and size in spmd);
`is_leader` says whether this rank's generation results are the ones to gather.

Weight sync is a collective of the actor's model-parallel ranks (pipeline stages broadcast) in one
of these modes (`rollout.weight_sync_mode`, decided at the first sync, identically on every rank,
and made into one `sync.dispatch.WeightTransport` that serves every later push):

* "gather": each parameter's TP shards are all-gathered into full HF tensors and the engine's
  owner loads them (leader: the leader rank; spmd: every rank, into its own engine, whose loaders
  take that rank's slice). Works anywhere, any rollout TP.
* "shared_memory" (leader placement): the first stage's TP ranks each write only their own slices
  into a shared bucket file in /dev/shm that the engine reads (`sync/shared_memory.py`): no TP gather.
  Needs the leader's TP group on one node.
* "tp_shards" (spmd, rollout TP = actor TP): each rank loads its own slices into its own
  in-process engine (`sync/tp_shards.py`): no gather, no file.

"auto" picks one of them (`distributed.placement.choose_sync_mode`). The placement and the sizes come
from the run's `ParallelLayout` (`RolloutGroup.create(cfg, layout, ...)`).

Devices (GPU runs): every engine computes on GPUs of its own ranks (`placement.assign_engine_devices`,
decided from every rank's GPU at start, identically on every rank): a leader's vLLM processes get
them as CUDA_VISIBLE_DEVICES, SGLang as base_gpu_id / gpu_id_step; a layout that cannot hold the
engines stops the run at start with a `PlacementError`.

Sleep: `sleep(level)` frees the engines' accelerator memory during the update (`rollout.
free_cache_engine`, level `rollout.sleep_level`); `wake_up(tags)` brings back "weights" and/or
"kv_cache" (None = both), so the trainer can push weights before the KV cache returns.
"""

from __future__ import annotations

import os
import socket
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps

from megatron_dapo.distributed.layout import ParallelLayout
from megatron_dapo.distributed.objects import data_parallel_rank_and_size, gather_objects, is_replica_leader
from megatron_dapo.distributed.placement import (
    EngineDevices,
    RankGpu,
    SpmdSlot,
    assign_engine_devices,
    choose_sync_mode,
    replica_groups,
)
from megatron_dapo.rollout.base import GenerationOutput, RolloutEngine, SamplingParams, WeightPushes
from megatron_dapo.rollout.engines.embedded import EmbeddedEngine
from megatron_dapo.rollout.sync.dispatch import FullTensors, SyncStats, WeightTransport, sync_weights
from megatron_dapo.rollout.sync.shared_memory import SharedMemoryShards
from megatron_dapo.rollout.sync.tp_shards import InProcessShards


def make_engine(
    cfg: Any,
    hf_dir: str | os.PathLike,
    device: torch.device,
    placement: str = "leader",
    devices: Optional[EngineDevices] = None,
) -> RolloutEngine:
    """The engine `cfg.rollout.engine` names, loaded from `hf_dir` (weights are replaced by the first sync).

    `placement="spmd"` (vLLM only) is a collective: every rank of the world calls it at once.
    `devices` are the engine's GPUs (`engine_devices`; None: no GPU, or the engine's default).
    """
    r = cfg.rollout
    max_model_len = r.max_prompt_length + r.max_response_length + 8
    if r.engine != "embedded":
        from megatron_dapo.config import engine_returns_routing
        from megatron_dapo.model.hf_config import read_hf_config

        # Read the model's config only when routing is asked for (a dense model ignores the request).
        wanted = engine_returns_routing(cfg, is_moe=True)
        routing = {"return_routed_experts": wanted and read_hf_config(hf_dir).is_moe}
    if r.engine == "embedded":
        return EmbeddedEngine(hf_dir, dtype=getattr(torch, cfg.model.dtype), device=device)
    if r.engine == "vllm":
        # vLLM and SGLang are optional installs: their engine modules load only when configured.
        from megatron_dapo.rollout.engines.vllm.engine import VLLMEngine

        os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
        kwargs: dict[str, Any] = {}
        if device.type == "cpu":  # vLLM's CPU build sizes its KV cache from this, not from a GPU fraction
            kwargs["kv_cache_memory_bytes"] = 256 << 20
        return VLLMEngine(
            hf_dir,
            tensor_parallel_size=r.tp,
            dtype=cfg.model.dtype,
            gpu_memory_utilization=r.gpu_memory_utilization,
            max_model_len=max_model_len,
            seed=r.seed,
            weight_bucket_mb=r.weight_sync_bucket_mb,
            placement=placement,
            visible_devices=devices.cuda_visible_devices if devices is not None and placement == "leader" else None,
            **routing,
            **kwargs,
        )
    if r.engine == "sglang":
        from megatron_dapo.rollout.engines.sglang.engine import SGLangEngine

        return SGLangEngine(
            hf_dir,
            tensor_parallel_size=r.tp,
            dtype=cfg.model.dtype,
            mem_fraction_static=r.gpu_memory_utilization,
            max_model_len=max_model_len,
            seed=r.seed,
            weight_bucket_mb=r.weight_sync_bucket_mb,
            device=device.type,  # CPU: SGLang's CPU engine (and sglang_cpu_compat where its kernels are missing)
            **routing,
            **({} if devices is None else {"base_gpu_id": devices.base_gpu_id, "gpu_id_step": devices.gpu_id_step}),
        )
    raise ValueError(f"unknown rollout.engine {r.engine!r}")


def this_rank_gpu(device: torch.device) -> Optional[RankGpu]:
    """Where this rank computes (node, the GPUs its process sees, its own); None off the GPU."""
    if device.type != "cuda":
        return None
    count = torch.cuda.device_count()
    listed = os.environ.get("CUDA_VISIBLE_DEVICES")
    visible = tuple(v.strip() for v in listed.split(","))[:count] if listed else tuple(str(i) for i in range(count))
    index = device.index if device.index is not None else torch.cuda.current_device()
    return RankGpu(socket.gethostname(), visible, index)


def engine_devices(layout: ParallelLayout, engine: str, mine: RankGpu) -> Optional[EngineDevices]:
    """The GPUs of the engine this rank builds (leader placement: on the replica's leader; spmd: the
    engine its shard belongs to); None on ranks that build none. A world collective: every rank
    passes its `RankGpu` (`this_rank_gpu`) and every rank checks the whole layout, so a layout that
    cannot work fails on every rank alike (`placement.PlacementError`). Replicas and rollout-TP
    groups are the resolved `layout`'s (its rank order is Megatron's)."""
    rank, world = (dist.get_rank() if dist.is_initialized() else 0), layout.world_size
    ranks = gather_objects(mine)
    if layout.placement == "spmd":
        groups = [SpmdSlot(first, world, layout.rollout_tp).group_ranks for first in range(0, world, layout.rollout_tp)]
    else:
        coordinates = [layout.coordinates(r) for r in range(world)]
        groups = replica_groups([(c["dp"], c["pp"], c["cp"], c["tp"]) for c in coordinates])
    for devices in assign_engine_devices(layout.placement, engine, layout.rollout_tp, ranks, groups):
        if rank == devices.owner or (layout.placement == "spmd" and rank in devices.ranks):
            return devices
    return None


def _leader_tp_group_hosts() -> list[str]:
    """Host names of the first pipeline stage's TP ranks of this replica (a model-parallel collective)."""
    if not (dist.is_initialized() and ps.model_parallel_is_initialized()):
        return [socket.gethostname()]
    mine = (ps.get_pipeline_model_parallel_rank(), ps.get_context_parallel_rank(), socket.gethostname())
    entries = gather_objects(mine, ps.get_model_parallel_group())
    return [host for pp_rank, cp_rank, host in entries if pp_rank == 0 and cp_rank == 0]


def _actor_tp_group():
    return ps.get_tensor_model_parallel_group() if ps.model_parallel_is_initialized() else None


class RolloutGroup:
    """This rank's part of the rollout: its engine (or None), its share of the prompts, and weight sync."""

    def __init__(
        self,
        engine: Optional[RolloutEngine],
        free_cache: bool = True,
        sync_mode: str = "auto",
        engine_kind: str = "embedded",
        device_type: str = "cpu",
        sleep_level: int = 1,
        spmd: Optional[SpmdSlot] = None,
        layout: Optional[ParallelLayout] = None,
    ) -> None:
        """`spmd` is this rank's slot in the spmd placement (None: leader placement); `layout` the
        run's (its actor TP and EP decide the sync mode; None: Megatron's parallel state's sizes, for
        groups made without one)."""
        if sleep_level not in (1, 2):
            raise ValueError(f"rollout.sleep_level must be 1 or 2, got {sleep_level}")
        if spmd is not None and engine is None:
            raise ValueError("in the spmd placement every rank holds an engine")
        self.engine = engine
        self.free_cache = free_cache
        self.requested_sync_mode = sync_mode
        self.engine_kind = engine_kind
        self.device_type = device_type
        self.sleep_level = sleep_level
        self.spmd = spmd
        self.layout = layout
        self.sync_mode: Optional[str] = None
        """The mode in use, decided at the first `sync_weights` ("gather", "shared_memory" or "tp_shards")."""
        self._transport: Optional[WeightTransport] = None

    @classmethod
    def create(cls, cfg: Any, layout: ParallelLayout, hf_dir: str | os.PathLike, device: torch.device) -> "RolloutGroup":
        """This rank's part of the rollout of the run's resolved `layout` (placement, rollout TP, actor TP)."""
        if not (Path(hf_dir) / "config.json").is_file():
            raise FileNotFoundError(f"model.hf_dir={hf_dir} has no config.json (the rollout engine starts from it)")
        r = cfg.rollout
        slot = None
        mine = this_rank_gpu(device)  # the same device type on every rank: all gather, or none
        devices = engine_devices(layout, r.engine, mine) if mine is not None else None
        if layout.placement == "spmd":
            rank = dist.get_rank() if dist.is_initialized() else 0
            slot = SpmdSlot(rank, layout.world_size, layout.rollout_tp)
            engine = make_engine(cfg, hf_dir, device, placement="spmd", devices=devices)
        else:
            engine = make_engine(cfg, hf_dir, device, devices=devices) if is_replica_leader() else None
        return cls(
            engine,
            free_cache=r.free_cache_engine,
            sync_mode=r.weight_sync_mode,
            engine_kind=r.engine,
            device_type=device.type,
            sleep_level=r.sleep_level,
            spmd=slot,
            layout=layout,
        )

    @property
    def placement(self) -> str:
        return "leader" if self.spmd is None else "spmd"

    @property
    def is_leader(self) -> bool:
        """True where this rank's generation results are the ones handed on (gathered to all ranks)."""
        return self.spmd.hands_on_results if self.spmd is not None else self.engine is not None

    @property
    def data_rank(self) -> int:
        """Which share of the prompts this rank's engine generates."""
        return self.spmd.data_rank if self.spmd is not None else data_parallel_rank_and_size()[0]

    @property
    def data_size(self) -> int:
        """Into how many shares the prompts are split (engines generating independently)."""
        return self.spmd.data_size if self.spmd is not None else data_parallel_rank_and_size()[1]

    def generate(
        self,
        prompt_ids: Sequence[Sequence[int]],
        params: SamplingParams,
        call_off: Optional[Callable[[], bool]] = None,
        pushes: Optional[WeightPushes] = None,
    ) -> Optional[GenerationOutput]:
        """Generate where this rank takes part; the result only where `is_leader`, None elsewhere.

        spmd: every rank of a rollout-TP group must call this with the same prompts and params.
        `call_off` (spmd only): this rank's vote to abandon the batch, asked every few engine steps
        on every rank of the group; once any votes yes, all of them raise `GenerationCalledOff`
        (`VLLMEngine.generate`). In the leader placement a generate can be left without one.
        `pushes`: weight pushes the engine takes between decode steps (partial rollouts; an engine
        that `takes_pushes_while_generating`).
        """
        if call_off is not None and self.spmd is None:
            raise ValueError("call_off is for the spmd placement")
        if self.engine is None:
            return None
        stop = {} if call_off is None else {"call_off": call_off}
        if pushes is not None:
            if not self.engine.takes_pushes_while_generating:
                raise ValueError(f"{type(self.engine).__name__} cannot take weight pushes while it generates")
            stop["pushes"] = pushes
        if self.spmd is not None and not self.is_leader:
            # Only the group's first rank hands its results on: the others skip reading vLLM's outputs.
            return self.engine.generate(prompt_ids, params, collect=False, **stop)
        return self.engine.generate(prompt_ids, params, **stop)

    def sync_weights(self, models: Sequence[torch.nn.Module], hf_config: Any, bucket_mb: float) -> SyncStats:
        """Push the actor's weights into the engine(s) (collective over every rank; see the module doc)."""
        if self._transport is None:
            self.sync_mode = self.sync_mode or self._decide_sync_mode()
            self._transport = self._make_transport(self.sync_mode)
        return sync_weights(models, hf_config, self._transport, bucket_mb=bucket_mb)

    @property
    def transport(self) -> Optional[WeightTransport]:
        """The transport of `sync_mode`, made at the first sync (None before it and after `close_weight_sync`)."""
        return self._transport

    def _decide_sync_mode(self) -> str:
        if self.layout is not None:
            tp_size, ep = self.layout.tp, self.layout.ep
        elif ps.model_parallel_is_initialized():
            tp_size, ep = ps.get_tensor_model_parallel_world_size(), ps.get_expert_model_parallel_world_size()
        else:
            tp_size, ep = 1, 1
        if self.spmd is not None:
            return choose_sync_mode(
                self.requested_sync_mode, tp_size, [], self.engine_kind, self.device_type, placement="spmd", rollout_tp=self.spmd.tp, ep=ep
            )
        return choose_sync_mode(self.requested_sync_mode, tp_size, _leader_tp_group_hosts(), self.engine_kind, self.device_type, ep=ep)

    def _make_transport(self, mode: str) -> WeightTransport:
        """The transport of `mode`, made once (the shard transports collectively over the actor's TP group)."""
        if mode == "shared_memory":
            # The slices come from the first pipeline stage's CP rank 0; later stages and CP ranks take
            # part in the export's collectives only.
            first = not ps.model_parallel_is_initialized() or (
                ps.get_pipeline_model_parallel_rank() == 0 and ps.get_context_parallel_rank() == 0
            )
            return SharedMemoryShards.create(self.engine, _actor_tp_group(), takes_part=first)
        if mode == "tp_shards":
            return InProcessShards.create(self.engine, _actor_tp_group())
        return FullTensors(self.engine)

    def sleep(self, level: Optional[int] = None) -> None:
        """Free the engine's accelerator memory for the update (`level` None: rollout.sleep_level).

        A no-op where rollout.free_cache_engine is off or the engine cannot sleep (CPU)."""
        if self.engine is not None and self.free_cache:
            self.engine.sleep(self.sleep_level if level is None else level)

    @property
    def sleep_discards_weights(self) -> bool:
        """Whether `sleep` drops the engine's weights (level 2), so that waking needs a full push.

        The same on every rank (ranks without an engine take part in the push's collectives)."""
        return self.free_cache and self.sleep_level == 2

    def wake_up(self, tags: Optional[Sequence[str]] = None) -> None:
        """Bring back the memory of `tags` ("weights", "kv_cache"; None = all) before syncing / generating."""
        if self.engine is not None and self.free_cache:
            self.engine.wake_up(tags)

    def close_weight_sync(self) -> None:
        """Release the transport (the shared-memory bucket directory, if any); the next sync makes a
        new one of the same mode (a collective, like the first)."""
        if self._transport is not None:
            self._transport.close()
            self._transport = None

    def shutdown(self) -> None:
        self.close_weight_sync()
        if self.engine is not None:
            self.engine.shutdown()
            self.engine = None
