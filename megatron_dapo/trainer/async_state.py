"""What an asynchronous run (`trainer.max_staleness` > 0) keeps beside its checkpoint: the work done ahead.

At a checkpoint the engines have generated batches that no step has trained on yet: the batches
handed out ahead of the update (in flight: their results on the way to the trainer's head) and the
informative groups carried over in the sampling buffer. They were generated with older weights than
the checkpoint's, which a resumed run no longer has, so they cannot be made again: they are saved
with the checkpoint (`ASYNC_STATE_FILE`, written by the head, checksummed with the rest) and put
back on resume, with the counters that decide what is handed out next. The resumed run then takes
the same decisions and trains on the same samples as the uninterrupted one.

MoE routing replay (`actor.router_replay=r3`): the results in flight hold their routing; the
carried groups hold only references into the head's `RoutingStore` (it contributed every sample of
the separate placement), so the head saves the routing those references name and puts it back
under the same keys. A resumed run must return the engine's routing exactly when the saved one did
(a named error otherwise: samples with and without it cannot share a train batch).

Saving costs no wait: a checkpoint follows the step's weight push, which the engines take only after
every request before it (they serve in order), so by then every result in flight has been sent.
The file holds tensors and plain values only and loads with ``weights_only=True``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

import torch

from megatron_dapo.trainer.remote_rollout import InFlight, ShareResult
from megatron_dapo.trainer.routing_exchange import RoutingStore

HEAD_RANK = 0
"""The trainer's head (launch rank 0): the contributor of every sample of the separate placement."""

__all__ = ["ASYNC_STATE_FILE", "capture", "load", "restore", "save"]

ASYNC_STATE_FILE = "async_state.pt"
_RESULT_FIELDS = ("version", "started", "ended", "waited_s")


def capture(
    rollout: Any, buffer: Any, kept_per_batch: Optional[float], gen_indices: dict[int, int], routing_store: Optional[RoutingStore] = None
) -> dict:
    """The state to save (every trainer rank calls it; only the head's holds the results, after
    reading every one still on its way, and the carried groups' routing)."""
    rollout.receive_all()
    head = rollout.bridge is not None
    return {
        "inflight": [
            {
                "shares": batch.shares,
                "version": batch.version,
                "results": None if batch.results is None else [_result_to_plain(r) for r in batch.results],
            }
            for batch in rollout.inflight_batches()
        ],
        "carried": buffer.carried_state(),
        "engine_routing": routing_store is not None,
        "carried_routing": _carried_routing(buffer, routing_store) if head and routing_store is not None else {},
        "kept_per_batch": kept_per_batch,
        "gen_indices": {int(step): int(n) for step, n in gen_indices.items()},
    }


def _carried_routing(buffer: Any, store: RoutingStore) -> dict[int, torch.Tensor]:
    """{key: routing} of the carried groups, all in the head's store (the head contributed them)."""
    refs = buffer.carried_values("routing_ref")
    strays = sorted({owner for owner, _ in refs if owner != HEAD_RANK})
    if strays:
        raise RuntimeError(f"carried groups keep their routing on ranks {strays}, not on the head: it would not be saved")
    return store.export(HEAD_RANK, refs)


def save(state: dict, path: Path) -> None:
    torch.save(state, path)


def load(checkpoint_dir: Path) -> dict:
    """The saved state of a checkpoint of an asynchronous run (a named error where it is missing)."""
    path = Path(checkpoint_dir) / ASYNC_STATE_FILE
    if not path.is_file():
        raise FileNotFoundError(
            f"{checkpoint_dir} has no {ASYNC_STATE_FILE}: it was not written by a run with trainer.max_staleness > 0, "
            "so the samples generated ahead of it are unknown; resume with trainer.max_staleness=0, or from a checkpoint "
            "of the asynchronous run"
        )
    return torch.load(path, weights_only=True)


def restore(
    state: dict, rollout: Any, buffer: Any, head: bool, routing_store: Optional[RoutingStore] = None
) -> tuple[Optional[float], dict[int, int]]:
    """Put the saved work back: batches in flight (their results on the head) and carried groups
    (their routing into the head's store). Returns (kept_per_batch, gen_indices) for the trainer."""
    saved_routing, routing = bool(state.get("engine_routing", False)), routing_store is not None
    if saved_routing != routing:
        raise ValueError(
            f"the checkpoint's asynchronous run {'returned' if saved_routing else 'did not return'} the engine's routing "
            f"and this one {'does' if routing else 'does not'} (actor.router_replay=r3 or rollout.return_routed_experts=true): "
            "its samples generated ahead cannot be trained here; resume with the same actor.router_replay and "
            "rollout.return_routed_experts"
        )
    batches = []
    for record in state["inflight"]:
        results = None
        if head:
            if record["results"] is None:
                raise ValueError(f"{ASYNC_STATE_FILE} holds no results of a batch in flight: it was not written by the head")
            results = [_result_from_plain(r) for r in record["results"]]
        batches.append(InFlight(shares=int(record["shares"]), version=int(record["version"]), results=results))
    rollout.restore_inflight(batches)
    buffer.restore_carried(state["carried"])
    if head and routing_store is not None:
        routing_store.adopt(state["carried_routing"])
    return state["kept_per_batch"], {int(k): int(v) for k, v in state["gen_indices"].items()}


def _result_to_plain(result: ShareResult) -> dict:
    plain = {name: getattr(result, name) for name in _RESULT_FIELDS}
    if result.packed is not None:
        header, payload, routing = result.packed
        plain["header"], plain["payload"], plain["routing"] = header, payload, routing
    return plain


def _result_from_plain(plain: dict) -> ShareResult:
    packed = (plain["header"], plain["payload"], plain["routing"]) if "header" in plain else None
    return ShareResult(packed=packed, **{name: plain[name] for name in _RESULT_FIELDS})
