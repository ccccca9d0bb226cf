"""Share one flat tensor per contributing rank with every rank: the bulk of rollout results.

Generation results are mostly token ids and log-probs: at 32B scale (1536 prompts x 16 responses x
20k tokens) that is half a billion numbers per generation batch. Pickled as Python lists they cost
about 14 bytes a token and minutes of (un)pickling on every rank; as one int32 buffer per
contributor they cost 8 bytes a token (id + float32 log-prob) and a memcpy. The small per-sample
fields (uid, score, prediction, ...) still travel as one pickled header, next to the buffer.

`share_from_contributors` is a world collective: every rank calls it, contributors with a header
and a 1-D tensor, the others with None. It runs in two phases:

1. meet: every rank waits for the others' arrival in the job's store (`liveness.await_ranks`: a
   rank that is gone ends the wait within the liveness window, a live one is waited for as long as
   it takes), then the headers are all-gathered on the gather group (`distributed.setup.
   gather_group`, gloo, timeout `rollout.gather_timeout_s`). Ranks arrive here as their engines
   finish, possibly minutes apart, so this is the only wait for someone else's generation, and it
   happens outside the default group's (NCCL's) timeout and watchdog;
2. move: each contributor's buffer is broadcast from its rank over the default group (one broadcast
   per contributor, so bytes on the wire equal the bytes produced, whatever the world size), on the
   GPU under NCCL. Every rank has already met, so nobody waits long inside these calls.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.distributed as dist

from megatron_dapo.distributed.objects import await_everyone, meeting_group


def _initialised() -> bool:
    return dist.is_available() and dist.is_initialized()


def _wire_device() -> torch.device:
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def share_from_contributors(
    order_key: Optional[int],
    header: Any,
    payload: Optional[torch.Tensor],
    meet_on: Optional[Any] = None,
    on_host: bool = False,
) -> list[tuple[Any, torch.Tensor]]:
    """Every contributor's (header, payload), ordered by `order_key`, on every rank.

    A contributor passes an integer `order_key` (unique among contributors, e.g. its data-parallel
    replica), a picklable `header` and a 1-D `payload` tensor; every other rank passes
    ``order_key=None`` (its header and payload are ignored). Payloads keep their dtype and come back
    on the CPU. Without torch.distributed this is ``[(header, payload)]``.

    `meet_on` is the group of the meeting phase (default: `objects.meeting_group()`, the gather
    group); tests pass the default group to show what the gather group prevents. `on_host`: the
    buffers move over that same (gloo) group in host memory, never through a GPU: for payloads only
    the host needs (MoE routing, which would otherwise land on GPUs whose engine still holds its pool).
    """
    if payload is not None and payload.dim() != 1:
        raise ValueError(f"payload must be a 1-D tensor, got shape {tuple(payload.shape)}")
    if not _initialised():
        if order_key is None:
            return []
        return [(header, payload.cpu())]
    mine = None if order_key is None else (int(order_key), header, int(payload.numel()), payload.dtype)
    await_everyone("gathering the generation results", meet_on)  # the wait for slow engines
    entries: list[Optional[tuple]] = [None] * dist.get_world_size()
    dist.all_gather_object(entries, mine, group=meeting_group(meet_on))
    contributors = sorted((entry[0], rank, entry) for rank, entry in enumerate(entries) if entry is not None)
    keys = [key for key, _, _ in contributors]
    if len(set(keys)) != len(keys):
        raise RuntimeError(f"two ranks contributed with the same order key: {keys}")
    device = torch.device("cpu") if on_host else _wire_device()
    move_on = meeting_group(meet_on) if on_host else None
    shared = []
    for _, src, (_, src_header, numel, dtype) in contributors:
        if src == dist.get_rank():
            buffer = payload.to(device).contiguous()
        else:
            buffer = torch.empty(numel, dtype=dtype, device=device)
        if numel:
            dist.broadcast(buffer, src=src, group=move_on)
        shared.append((src_header, buffer.cpu()))
    return shared
