"""The rollout engine of one data-parallel replica, as the driver loop sees it.

Placement: each replica (the TP x PP x CP ranks that hold one copy of the actor) has one engine,
created on the replica's first rank (`is_replica_leader`). That rank generates for the replica's
share of the prompts. On a GPU node the engine shares the leader's GPU with training (colocated;
`sleep` frees its memory during the update when the engine supports it).

Weight sync is a collective of the replica's ranks (pipeline stages broadcast to the first stage)
in one of two modes (`rollout.weight_sync_mode`, decided once, identically on every rank):

* "gather": each parameter's TP shards are all-gathered into full HF tensors and the leader
  loads them into its engine (works anywhere, including a TP group spread over nodes);
* "shared_memory": the first stage's TP ranks each write only their own slices into a shared
  bucket file in /dev/shm that the engine reads (`shard_handover`): no TP gather, 1/TP of the
  bytes per rank, written in parallel. It needs the leader's TP group on one node.

"auto" takes shared_memory when the actor's TP > 1 and the leader's TP group shares a node, except
for the embedded engine on a GPU (there the NCCL gather lands directly in GPU memory, while the
file path would go through host memory); otherwise gather.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Optional, Sequence

import torch

from megatron_dapo.distributed.objects import gather_objects, is_replica_leader
from megatron_dapo.rollout.base import GenerationOutput, RolloutEngine, SamplingParams

def make_engine(cfg: Any, hf_dir: str | os.PathLike, device: torch.device) -> RolloutEngine:
    """The engine `cfg.rollout.engine` names, loaded from `hf_dir` (weights are replaced by the first sync)."""
    r = cfg.rollout
    max_model_len = r.max_prompt_length + r.max_response_length + 8
    if r.engine == "embedded":
        from megatron_dapo.rollout.embedded import EmbeddedEngine

        return EmbeddedEngine(hf_dir, dtype=getattr(torch, cfg.model.dtype), device=device)
    if r.engine == "vllm":
        from megatron_dapo.rollout.vllm_engine import VLLMEngine

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
            **kwargs,
        )
    if r.engine == "sglang":
        from megatron_dapo.rollout.sglang_engine import SGLangEngine

        return SGLangEngine(
            hf_dir,
            tensor_parallel_size=r.tp,
            dtype=cfg.model.dtype,
            mem_fraction_static=r.gpu_memory_utilization,
            max_model_len=max_model_len,
            seed=r.seed,
            weight_bucket_mb=r.weight_sync_bucket_mb,
        )
    raise ValueError(f"unknown rollout.engine {r.engine!r}")


def choose_sync_mode(requested: str, tp_size: int, tp_group_hosts: Sequence[str], engine_kind: str, device_type: str) -> str:
    """The weight-sync mode for `rollout.weight_sync_mode=requested` (see the module doc); pure.

    `tp_group_hosts` are the host names of the engine leader's TP group. Raises ValueError when
    "shared_memory" is asked for a TP group spread over several nodes.
    """
    one_node = len(set(tp_group_hosts)) <= 1
    if requested == "gather":
        return "gather"
    if requested == "shared_memory":
        if not one_node:
            raise ValueError(
                f"rollout.weight_sync_mode=shared_memory needs the TP group on one node; it spans {sorted(set(tp_group_hosts))} "
                "(use gather or auto)"
            )
        return "shared_memory"
    if requested != "auto":
        raise ValueError(f"unknown rollout.weight_sync_mode {requested!r} (auto, gather or shared_memory)")
    if tp_size > 1 and one_node and not (engine_kind == "embedded" and device_type == "cuda"):
        return "shared_memory"
    return "gather"


def _leader_tp_group_hosts() -> list[str]:
    """Host names of the first pipeline stage's TP ranks of this replica (a model-parallel collective)."""
    import socket

    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    if not (dist.is_initialized() and ps.model_parallel_is_initialized()):
        return [socket.gethostname()]
    mine = (ps.get_pipeline_model_parallel_rank(), ps.get_context_parallel_rank(), socket.gethostname())
    entries = gather_objects(mine, ps.get_model_parallel_group())
    return [host for pp_rank, cp_rank, host in entries if pp_rank == 0 and cp_rank == 0]


class RolloutGroup:
    """One replica's engine: present on the leader rank, None elsewhere; and the way weights reach it."""

    def __init__(
        self,
        engine: Optional[RolloutEngine],
        free_cache: bool = True,
        sync_mode: str = "auto",
        engine_kind: str = "embedded",
        device_type: str = "cpu",
    ) -> None:
        self.engine = engine
        self.free_cache = free_cache
        self.requested_sync_mode = sync_mode
        self.engine_kind = engine_kind
        self.device_type = device_type
        self.sync_mode: Optional[str] = None
        """The mode in use, decided at the first `sync_weights` ("gather" or "shared_memory")."""
        self._handover = None

    @classmethod
    def create(cls, cfg: Any, hf_dir: str | os.PathLike, device: torch.device) -> "RolloutGroup":
        if not (Path(hf_dir) / "config.json").is_file():
            raise FileNotFoundError(f"model.hf_dir={hf_dir} has no config.json (the rollout engine starts from it)")
        engine = make_engine(cfg, hf_dir, device) if is_replica_leader() else None
        return cls(
            engine,
            free_cache=cfg.rollout.free_cache_engine,
            sync_mode=cfg.rollout.weight_sync_mode,
            engine_kind=cfg.rollout.engine,
            device_type=device.type,
        )

    @property
    def is_leader(self) -> bool:
        return self.engine is not None

    def generate(self, prompt_ids: Sequence[Sequence[int]], params: SamplingParams) -> Optional[GenerationOutput]:
        """The leader generates; other ranks return None (results travel with `gather_from_leaders`)."""
        if self.engine is None:
            return None
        return self.engine.generate(prompt_ids, params)

    def sync_weights(self, models: Sequence[torch.nn.Module], hf_config: Any, bucket_mb: float):
        """Push the actor's weights into the engine (collective over every rank; see the module doc)."""
        from megatron_dapo.rollout.weight_sync import sync_weights

        if self.sync_mode is None:
            self.sync_mode = self._decide_sync_mode()
        if self.sync_mode == "shared_memory":
            return sync_weights(models, hf_config, self._shard_target(), bucket_mb=bucket_mb, tp_shards=True)
        return sync_weights(models, hf_config, self.engine, bucket_mb=bucket_mb)

    def _decide_sync_mode(self) -> str:
        from megatron.core import parallel_state as ps

        tp_size = ps.get_tensor_model_parallel_world_size() if ps.model_parallel_is_initialized() else 1
        return choose_sync_mode(self.requested_sync_mode, tp_size, _leader_tp_group_hosts(), self.engine_kind, self.device_type)

    def _shard_target(self):
        """The first pipeline stage's `SharedMemoryHandover` (made once, collectively); None on later stages."""
        from megatron.core import parallel_state as ps

        from megatron_dapo.rollout.shard_handover import SharedMemoryHandover

        if ps.model_parallel_is_initialized() and (ps.get_pipeline_model_parallel_rank() != 0 or ps.get_context_parallel_rank() != 0):
            return None
        if self._handover is None:
            group = ps.get_tensor_model_parallel_group() if ps.model_parallel_is_initialized() else None
            self._handover = SharedMemoryHandover.create(self.engine, group)
        return self._handover

    def sleep(self) -> None:
        """Free the engine's GPU memory for the update (no-op on CPU or when disabled)."""
        if self.engine is not None and self.free_cache:
            self.engine.sleep()

    def wake_up(self) -> None:
        if self.engine is not None and self.free_cache:
            self.engine.wake_up()

    def close_weight_sync(self) -> None:
        """Remove the shared-memory bucket directory, if any (the next sync makes a new one)."""
        if self._handover is not None:
            self._handover.close()
            self._handover = None

    def shutdown(self) -> None:
        self.close_weight_sync()
        if self.engine is not None:
            self.engine.shutdown()
            self.engine = None
