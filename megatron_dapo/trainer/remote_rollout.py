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

from collections import deque
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

import torch

from megatron_dapo.distributed.layout import ParallelLayout
from megatron_dapo.distributed.objects import data_parallel_rank_and_size
from megatron_dapo.rollout.base import SamplingParams
from megatron_dapo.rollout.sync.dispatch import SyncStats, WeightTransport, sync_weights
from megatron_dapo.rollout.sync.remote import BridgeBroadcast
from megatron_dapo.trainer.samples import Samples, gather_samples, unpack_samples

__all__ = ["GenerateShare", "InFlight", "RemoteRollout", "ShareResult", "StopServing"]


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
    for an empty share; the weight version it generated with; when it worked on the share (wall-clock
    start and end, `time.time()`) and how long it had waited for the request before."""

    packed: Optional[tuple] = None
    version: int = 0
    started: float = 0.0
    ended: float = 0.0
    waited_s: float = 0.0


@dataclass
class InFlight:
    """One generation batch handed to the engines and not collected yet (every trainer rank keeps
    the same record: the decisions that follow are taken alike everywhere)."""

    shares: int
    version: int
    """The weights the engines generate it with: the last push sent before it."""
    results: Optional[list] = None
    """The head: the engines' `ShareResult`s once received (each engine answers in order, so a later
    batch's results are read after every earlier one's, which then wait here)."""


@dataclass(frozen=True)
class StopServing:
    """The head's last message to every engine owner: shut the engine down and leave."""


@dataclass
class RemoteRollout:
    """The trainer ranks' handle on the separate placement's engines (see the module doc)."""

    layout: ParallelLayout
    bridge: Optional[Any] = None
    """The head's end of the bridge (launch rank 0); None on the other trainer ranks."""
    next_version: int = 0
    """The weight version the next push delivers (the number of updates the actor has had)."""
    sync_mode: str = "gather"
    partial_rollouts: bool = False
    """Pushes land between the engines' decode steps (`rollout.partial_rollouts`): a batch's samples
    may hold tokens of versions newer than the one it was handed out with."""
    _transport: Optional[BridgeBroadcast] = field(default=None, repr=False)
    _inflight: deque = field(default_factory=deque, repr=False)
    _sending: list = field(default_factory=list, repr=False)

    placement = "separate"

    @classmethod
    def create(cls, cfg: Any, layout: ParallelLayout, bridge: Optional[Any], weight_version: int = 0) -> "RemoteRollout":
        """`weight_version`: the version of the actor's weights now (the step a resumed run starts after)."""
        if not layout.separate:
            raise ValueError(f"RemoteRollout is the separate placement's; this layout's is {layout.placement}")
        if (bridge is not None) != (_trainer_rank() == 0):
            raise RuntimeError("the bridge belongs to the trainer's head (launch rank 0) alone")
        partial = bool(cfg is not None and cfg.rollout.partial_rollouts)
        return cls(layout, bridge, next_version=weight_version, partial_rollouts=partial)

    @property
    def pushed_version(self) -> int:
        """The version of the last push (the weights a request sent now is generated with)."""
        return self.next_version - 1

    @property
    def _to_engines(self) -> str:
        """The bridge channel of the head's messages to the owners: with partial rollouts requests and
        pushes travel in one order on the channel an owner's thread listens to (`bridge.Listener`)."""
        return "listened" if self.partial_rollouts else "work"

    @property
    def inflight(self) -> int:
        """Generation batches handed to the engines and not collected yet."""
        return len(self._inflight)

    @property
    def data_size(self) -> int:
        """Into how many shares the prompts are split: one per engine."""
        return self.layout.rollout_engines

    def generate_all(self, requests: Sequence[GenerateShare], routing_store: Optional[Any] = None) -> Samples:
        """Every engine generates and scores its share (`requests[i]` for engine i; the same list on
        every trainer rank); every trainer rank gets all the samples, in share order (a collective
        of the trainer's ranks, like the colocated gather). `submit` then `collect`."""
        self.submit(requests)
        mine = self._inflight.pop()  # out of turn: the batches before it stay in flight, their results kept
        for batch in self._inflight:
            self._receive(batch)
        return self._samples(mine, routing_store)

    def submit(self, requests: Sequence[GenerateShare]) -> None:
        """Hand one generation batch to the engines, share i to engine i, and return at once (every
        trainer rank calls it alike). The engines work through their requests in order, each with
        the weights of the last push before it (`pushed_version`)."""
        if len(requests) != self.data_size:
            raise ValueError(f"{len(requests)} shares for {self.data_size} engines")
        if self.bridge is not None:
            self._sending = [pending for pending in self._sending if not pending.done()]
            for engine, request in enumerate(requests):
                self._sending.append(self.bridge.send(request, engine + 1, wait=False, channel=self._to_engines))
        self._inflight.append(InFlight(len(requests), self.pushed_version))

    def collect(self, routing_store: Optional[Any] = None) -> Samples:
        """The samples of the oldest batch in flight, on every trainer rank (waits for the engines;
        a collective of the trainer's ranks). Each sample carries the batch's `weight_version`."""
        if not self._inflight:
            raise RuntimeError("no generation batch in flight: submit one first")
        return self._samples(self._inflight.popleft(), routing_store)

    def receive_all(self) -> None:
        """The head: read the results of every batch in flight (they stay in flight, results kept)."""
        for batch in self._inflight:
            self._receive(batch)

    def inflight_batches(self) -> list[InFlight]:
        return list(self._inflight)

    def restore_inflight(self, batches: Sequence[InFlight]) -> None:
        """A resumed run: batches handed out before the checkpoint, with their results on the head
        (the engines of this run never saw their requests)."""
        if self._inflight:
            raise RuntimeError("batches are in flight already: restore before handing any out")
        self._inflight.extend(batches)

    def _receive(self, batch: InFlight) -> None:
        """The head: read `batch`'s results from every engine (once)."""
        if self.bridge is None or batch.results is not None:
            return
        results = [self.bridge.recv(engine + 1) for engine in range(batch.shares)]
        # In order, each request has the weights of the last push before it; with partial rollouts
        # a later push may land before or while it is generated, never an older one.
        wrong = [(i, r.version) for i, r in enumerate(results) if r.version < batch.version or (r.version > batch.version and not self.partial_rollouts)]
        if wrong:
            raise RuntimeError(f"engines {wrong} (engine, version) generated with other weights than version {batch.version}")
        batch.results = results

    def _samples(self, batch: InFlight, routing_store: Optional[Any]) -> Samples:
        """`batch`'s samples on every trainer rank, each with the batch's weight version."""
        local = None
        if self.bridge is not None:
            self._receive(batch)
            local = Samples.concat([unpack_samples(*r.packed) for r in batch.results if r.packed is not None])
            if local.version_spans is None:  # one version for the whole batch (else its oldest token's, per sample)
                local.weight_version = [batch.version] * len(local)
        return gather_samples(local, order_key=0, routing_store=routing_store)

    # ------------------------------------------------------------------ weights

    def sync_weights(self, models: Sequence[torch.nn.Module], hf_config: Any, bucket_mb: float) -> SyncStats:
        """The first replica exports full tensors, the head broadcasts them to every engine (a
        collective of that replica's ranks); the other replicas have nothing to do."""
        if data_parallel_rank_and_size()[0] != 0:
            self.next_version += 1
            return SyncStats(bytes=0, seconds=0.0, load_seconds=0.0, num_tensors=0, num_buckets=0, peak_bucket_bytes=0)
        if self._transport is None:
            self._transport = BridgeBroadcast(self.bridge, announce_on=self._to_engines)
        self._transport.version = self.next_version
        stats = sync_weights(models, hf_config, self._transport, bucket_mb=bucket_mb)
        self.next_version += 1
        return stats

    @property
    def transport(self) -> Optional[WeightTransport]:
        return self._transport

    def engine_timeline(self) -> tuple[list[tuple[float, float]], float]:
        """The head, after a push: every engine's busy (start, end) intervals since the push before,
        and the engines' mean seconds of waiting for work or weights in that time."""
        replies = self._transport.replies if self._transport is not None else []
        busy = [interval for reply in replies for interval in reply.busy]
        waited = sum(reply.waited_s for reply in replies) / len(replies) if replies else 0.0
        return busy, waited

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
            while self._inflight:  # what the engines still generate is not wanted: take it and drop it
                batch = self._inflight.popleft()
                if batch.results is None:
                    for engine in range(batch.shares):
                        bridge.recv(engine + 1)
            for owner in range(1, bridge.size):
                bridge.send(StopServing(), owner, channel=self._to_engines)
            for pending in self._sending:
                pending.wait()


def _trainer_rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_initialized() else 0
