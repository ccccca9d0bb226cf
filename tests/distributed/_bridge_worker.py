"""Ranks of test_bridge.py (run by torchrun; not collected): the bridge's listened channel between a
head (rank 0) and one owner (rank 1)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_dapo.distributed.bridge import Bridge
from megatron_dapo.rollout.sync.remote import PushWeights


def listened_channel() -> dict:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    store = dist.distributed_c10d._get_default_store()
    bridge = Bridge.connect(store, [0, 1], rank, torch.device("cpu"), timeout_s=60)
    result: dict = {}
    if rank == 0:
        dist.barrier()  # the owner looked before anything was sent
        for message in ("request 1", PushWeights(1), "request 2", "stop"):
            bridge.send(message, 1, channel="listened")
        result["from owner"] = bridge.recv(1)  # the work channel meanwhile, on the other group
        dist.barrier()
    else:
        listener = bridge.listen(0, last=lambda message: message == "stop")
        result["before"] = listener.take(block=False)
        dist.barrier()
        bridge.send("result 1", 0)
        dist.barrier()  # everything was sent (and so received by the listener)
        result["push first"] = listener.take(PushWeights, block=True).version  # results travel as JSON
        result["no other push"] = listener.take(PushWeights, block=False)
        result["rest"] = [listener.take(), listener.take(), listener.take()]
        try:
            listener.take()
        except RuntimeError as error:
            result["after last"] = str(error)
        listener.join()
    dist.destroy_process_group()
    return result
