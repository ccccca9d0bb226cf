"""Worker for test_handover_barrier.py (run with tests/torchrun_utils.py; not collected by pytest).

Two ranks, one replica (tensor parallel 2, leader placement): rank 0 owns a fake engine whose
creation, sleep and wake take a while; each rank's fake offloader takes a while on rank 1. The
real `start_engine` and `GpuHandover` run (the engine and the offloader are the fakes), through a
start, a step's two hand-overs and a checkpoint's (`actor_on_gpu`). Every call's start and end go
with a wall-clock time to one shared log, which the test reads to check the order across ranks.
"""

from __future__ import annotations

import json
import os
import time
from types import SimpleNamespace

from tests.support.torchrun_utils import reporting

ENGINE_S = 1.0  # the leader's engine: creation, sleep and wake each take this long
OFFLOAD_S = 1.0  # rank 1's offloads and onloads take this long (rank 0's are instant)


_LOG: list[str] = []


def _log(event: str, edge: str) -> None:
    """One line appended to the log both ranks share (O_APPEND: whole lines, whoever writes)."""
    line = json.dumps({"t": time.time(), "rank": int(os.environ["RANK"]), "event": event, "edge": edge})
    fd = os.open(_LOG[0], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, (line + "\n").encode())
    finally:
        os.close(fd)


def _timed(event: str, seconds: float) -> None:
    _log(event, "begin")
    time.sleep(seconds)
    _log(event, "end")


def main(log: str, barrier: bool = True) -> None:
    _LOG[:] = [log]
    from megatron_dapo.distributed import ParallelLayout, init_distributed
    from megatron_dapo.rollout.base import RolloutEngine
    from megatron_dapo.rollout.group import RolloutGroup
    from megatron_dapo.trainer import handover

    ctx = init_distributed(ParallelLayout(tp=2), timeout_s=120, seed=1)
    slow = ctx.rank == 1

    class SlowEngine(RolloutEngine):
        def generate(self, prompt_ids, params):
            raise NotImplementedError

        def load_weights(self, weights):
            pass

        def sleep(self, level=1):
            _timed("engine:sleep", ENGINE_S)

        def wake_up(self, tags=None):
            _timed("engine:wake:" + "+".join(tags or ["all"]), ENGINE_S)

    class Group(RolloutGroup):
        def sync_weights(self, models, hf_config, bucket_mb):
            import torch.distributed as dist

            _log("sync", "begin")
            dist.barrier()  # the real push is a collective of the replica's ranks too
            _log("sync", "end")
            return SimpleNamespace(seconds=0.0)

    def create(cls, cfg, layout, hf_dir, device):
        engine = None
        if ctx.rank == 0:
            _timed("engine:create", ENGINE_S)
            engine = SlowEngine()
        return Group(engine, engine_kind="vllm", device_type="cpu", layout=layout)

    class Offload:
        enabled = True
        offloaded = ()

        def offload(self, *kinds):
            _timed("offload:" + "+".join(kinds or ("all",)), OFFLOAD_S if slow else 0.0)
            self.offloaded = kinds or ("all",)
            return 0

        def onload(self, *kinds):
            _timed("onload:" + "+".join(kinds or ("all",)), OFFLOAD_S if slow else 0.0)
            self.offloaded = ()
            return 0

    handover.RolloutGroup.create = classmethod(create)
    if not barrier:  # the control: the hand-over as it was, without the replica's meetings
        handover.ReplicaBarrier.wait = lambda self, *args: None
    cfg = SimpleNamespace(
        model=SimpleNamespace(hf_dir="unused"),
        rollout=SimpleNamespace(engine="vllm", gather_timeout_s=120.0, weight_sync_bucket_mb=1.0),
    )
    out: dict = {"rank": ctx.rank}
    with reporting(out):
        actor = SimpleNamespace(models=[])
        moves, _ = handover.start_engine(cfg, ctx.layout, actor, Offload(), None, ctx.device)
        moves.to_actor()  # a step: the engine sleeps, the actor comes back ...
        moves.to_engine()  # ... and after the update the GPU goes back to the engine
        with moves.actor_on_gpu():  # a checkpoint of an offloaded actor
            _log("save", "begin")
        out["groups"] = handover.handover_groups(ctx.layout, "vllm")
