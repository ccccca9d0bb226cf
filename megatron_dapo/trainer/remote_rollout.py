"""The trainer's side of engines on ranks of their own (`rollout.placement=separate`).

`RemoteRollout` stands where a colocated run has its `rollout.group.RolloutGroup`: the GPU hand-over,
the generation loop and validation call the same methods. The engines live on the rollout ranks
(`rollout_worker.serve_rollout`), reached over the bridge (`distributed/bridge.py`) from the
trainer's head (launch rank 0):

* generation: every trainer rank builds the same requests, one share of the prompts per engine
  (`GenerateShare`: the examples, the sampling parameters with the share's seed, the uid prefix);
  the head sends share i to engine i, which generates and scores it and answers with the packed
  samples (`ShareResult`); the head then hands them to every trainer rank with the colocated
  runs' gather (`samples.gather_samples`), so what follows (dynamic sampling, the MoE routing
  exchange, the actor's batch) is the same code. Shares and seeds follow the engines, as in the
  colocated placements: with as many engines as a colocated run's replicas the samples are the same.
* weights: after each update the first data-parallel replica exports full HF tensors and the head
  broadcasts them to every engine (`rollout.sync.remote.BridgeBroadcast`); the other replicas do
  nothing.
* no sleep and no wake: the engines keep their GPUs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

import torch

from megatron_dapo.distributed.layout import ParallelLayout
from megatron_dapo.distributed.objects import data_parallel_rank_and_size
from megatron_dapo.rollout.base import SamplingParams
from megatron_dapo.rollout.sync.dispatch import SyncStats, WeightTransport, sync_weights
from megatron_dapo.rollout.sync.remote import BridgeBroadcast
from megatron_dapo.trainer.samples import Samples, gather_samples, unpack_samples

__all__ = ["GenerateShare", "RemoteRollout", "ShareResult", "StopServing"]


@dataclass(frozen=True)
class GenerateShare:
    """One engine's share of a generation batch or of validation: generate, score, answer."""

    examples: list
    """`data.PromptExample`s."""
    params: SamplingParams
    uid_prefix: str
    validating: bool = False
    apply_overlong: bool = True
    routing_dtype: torch.dtype = torch.int32


@dataclass(frozen=True)
class ShareResult:
    """An engine's answer to `GenerateShare`: its samples packed (`samples.pack_samples`), or None
    for an empty share, and the seconds it generated and scored."""

    packed: Optional[tuple] = None
    seconds: float = 0.0


@dataclass(frozen=True)
class StopServing:
    """The head's last message to every engine owner: shut the engine down and leave."""


@dataclass
class RemoteRollout:
    """The trainer ranks' handle on the separate placement's engines (see the module doc)."""

    layout: ParallelLayout
    bridge: Optional[Any] = None
    """The head's end of the bridge (launch rank 0); None on the other trainer ranks."""
    sync_mode: str = "gather"
    free_cache: bool = False
    _transport: Optional[BridgeBroadcast] = field(default=None, repr=False)

    placement = "separate"
    is_leader = False
    engine = None

    @classmethod
    def create(cls, cfg: Any, layout: ParallelLayout, bridge: Optional[Any]) -> "RemoteRollout":
        if not layout.separate:
            raise ValueError(f"RemoteRollout is the separate placement's; this layout's is {layout.placement}")
        if (bridge is not None) != (_trainer_rank() == 0):
            raise RuntimeError("the bridge belongs to the trainer's head (launch rank 0) alone")
        return cls(layout, bridge)

    @property
    def data_size(self) -> int:
        """Into how many shares the prompts are split: one per engine."""
        return self.layout.rollout_engines

    def generate_all(self, requests: Sequence[GenerateShare], routing_store: Optional[Any] = None) -> Samples:
        """Every engine generates and scores its share (`requests[i]` for engine i; the same list on
        every trainer rank); every trainer rank gets all the samples, in share order (a collective
        of the trainer's ranks, like the colocated gather)."""
        if len(requests) != self.data_size:
            raise ValueError(f"{len(requests)} shares for {self.data_size} engines")
        local = None
        if self.bridge is not None:
            for engine, request in enumerate(requests):
                self.bridge.send(request, engine + 1)
            results = [self.bridge.recv(engine + 1) for engine in range(len(requests))]
            parts = [unpack_samples(*result.packed) for result in results if result.packed is not None]
            local = Samples.concat(parts)
        return gather_samples(local, order_key=0, routing_store=routing_store)

    # ------------------------------------------------------------------ weights

    def sync_weights(self, models: Sequence[torch.nn.Module], hf_config: Any, bucket_mb: float) -> SyncStats:
        """The first replica exports full tensors, the head broadcasts them to every engine (a
        collective of that replica's ranks); the other replicas have nothing to do."""
        if data_parallel_rank_and_size()[0] != 0:
            return SyncStats(bytes=0, seconds=0.0, load_seconds=0.0, num_tensors=0, num_buckets=0, peak_bucket_bytes=0)
        if self._transport is None:
            self._transport = BridgeBroadcast(self.bridge)
        return sync_weights(models, hf_config, self._transport, bucket_mb=bucket_mb)

    @property
    def transport(self) -> Optional[WeightTransport]:
        return self._transport

    # ------------------------------------------------------------------ what a colocated engine needs

    def sleep(self, level: Optional[int] = None) -> None:
        """The engines keep their own GPUs: nothing to free."""

    def wake_up(self, tags: Optional[Sequence[str]] = None) -> None:
        """Nothing was freed."""

    @property
    def sleep_discards_weights(self) -> bool:
        return False

    def close_weight_sync(self) -> None:
        self._transport = None

    def shutdown(self) -> None:
        """Tell every engine owner to stop (the head; once)."""
        if self.bridge is not None:
            bridge, self.bridge = self.bridge, None
            for owner in range(1, bridge.size):
                bridge.send(StopServing(), owner)


def _trainer_rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_initialized() else 0
