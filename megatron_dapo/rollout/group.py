"""The rollout engine of one data-parallel replica, as the driver loop sees it.

Placement: each replica (the TP x PP x CP ranks that hold one copy of the actor) has one engine,
created on the replica's first rank (`is_replica_leader`). That rank generates for the replica's
share of the prompts; weight sync is a collective of the replica's ranks (TP shards gathered,
pipeline stages broadcast) that ends with full HF tensors in the leader's engine. On a GPU node
the engine shares the leader's GPU with training (colocated; `sleep` frees its memory during the
update when the engine supports it).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Optional, Sequence

import torch

from megatron_dapo.distributed.objects import is_replica_leader
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


class RolloutGroup:
    """One replica's engine: present on the leader rank, None elsewhere."""

    def __init__(self, engine: Optional[RolloutEngine], free_cache: bool = True) -> None:
        self.engine = engine
        self.free_cache = free_cache

    @classmethod
    def create(cls, cfg: Any, hf_dir: str | os.PathLike, device: torch.device) -> "RolloutGroup":
        if not (Path(hf_dir) / "config.json").is_file():
            raise FileNotFoundError(f"model.hf_dir={hf_dir} has no config.json (the rollout engine starts from it)")
        engine = make_engine(cfg, hf_dir, device) if is_replica_leader() else None
        return cls(engine, free_cache=cfg.rollout.free_cache_engine)

    @property
    def is_leader(self) -> bool:
        return self.engine is not None

    def generate(self, prompt_ids: Sequence[Sequence[int]], params: SamplingParams) -> Optional[GenerationOutput]:
        """The leader generates; other ranks return None (results travel with `gather_from_leaders`)."""
        if self.engine is None:
            return None
        return self.engine.generate(prompt_ids, params)

    def sync_weights(self, models: Sequence[torch.nn.Module], hf_config: Any, bucket_mb: float):
        """Push the actor's weights into the engine (collective over every rank; see `weight_sync`)."""
        from megatron_dapo.rollout.weight_sync import sync_weights

        return sync_weights(models, hf_config, self.engine, bucket_mb=bucket_mb)

    def sleep(self) -> None:
        """Free the engine's GPU memory for the update (no-op on CPU or when disabled)."""
        if self.engine is not None and self.free_cache:
            self.engine.sleep()

    def wake_up(self) -> None:
        if self.engine is not None and self.free_cache:
            self.engine.wake_up()

    def shutdown(self) -> None:
        if self.engine is not None:
            self.engine.shutdown()
            self.engine = None
