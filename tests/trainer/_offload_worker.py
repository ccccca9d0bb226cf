"""Worker for tests/trainer/test_offload_order.py: a script (one process, `run_torchrun_script`; the
`__main__` guard keeps the reward pool's spawned workers from running it again).

The real trainer on the tiny demo workspace, twice in one process: with the actor offloaded
(`actor.offload_*` all on, `rollout.sleep_level=2`) and without. The rollout group, the offloader
and the actor are spied on at class level (the real methods run), so the start-up and each step
record the order of engine sleep / wake-ups, weight syncs, offloads / onloads, log-probs, updates
and generation, and at each of those moments whether the actor's storages are really resident or
really freed. Each run takes two steps and writes a checkpoint after the first, and one more
after the second as if `rollout.sleep_level` were 1; the metrics and the final weights of the two
runs are returned for comparison.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import sys

import torch


def _install_spies(events: list, checks: list, trainer_box: dict) -> None:
    from megatron_dapo.actor.offload import KINDS, ActorOffload
    from megatron_dapo.actor.policy import MegatronActor
    from megatron_dapo.rollout.group import RolloutGroup

    def where() -> dict:
        """Bytes of the actor's storages per kind right now (0: freed)."""
        trainer = trainer_box.get("trainer")
        if trainer is None or not trainer.offload.enabled:
            return {}
        return {kind: [s.nbytes() for s in trainer.offload.storages(kind)] for kind in KINDS}

    def check(moment: str, resident: tuple, away: tuple) -> None:
        sizes = where()
        if not sizes:
            return
        for kind in resident:
            if not all(n > 0 for n in sizes[kind]):
                checks.append(f"{moment}: {kind} not resident")
        for kind in away:  # (before the first update a distributed fp32 optimizer owns no storage yet)
            if any(n != 0 for n in sizes[kind]) or (kind != "optimizer" and not sizes[kind]):
                checks.append(f"{moment}: {kind} not freed")

    def spy(cls, name, label, before=None):
        real = getattr(cls, name)

        def wrapper(self, *args, **kwargs):
            events.append(label(*args, **kwargs) if callable(label) else label)
            if before is not None:
                before()
            return real(self, *args, **kwargs)

        setattr(cls, name, wrapper)

    real_create = RolloutGroup.create.__func__

    def create(cls, *args, **kwargs):
        events.append("engine:create")
        return real_create(cls, *args, **kwargs)

    RolloutGroup.create = classmethod(create)
    spy(RolloutGroup, "sleep", "engine:sleep")
    spy(RolloutGroup, "wake_up", lambda tags=None: "engine:wake:" + ("+".join(tags) if tags else "all"))
    spy(RolloutGroup, "sync_weights", "sync", lambda: check("sync", ("params",), ("grads", "optimizer")))
    spy(RolloutGroup, "generate", "generate", lambda: check("generate", (), KINDS))
    spy(ActorOffload, "offload", lambda *kinds: "offload:" + ("+".join(kinds) or "all"))
    spy(ActorOffload, "onload", lambda *kinds: "onload:" + ("+".join(kinds) or "all"))
    spy(MegatronActor, "compute_log_probs", "log_probs", lambda: check("log_probs", KINDS, ()))
    spy(MegatronActor, "update", "update", lambda: check("update", KINDS, ()))


def _weights_digest(actor) -> str:
    digest = hashlib.sha256()
    for model in actor.models:
        for name, p in model.named_parameters():
            digest.update(name.encode())
            digest.update(p.detach().reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def _collapse(events: list) -> list:
    """Consecutive generate events (dynamic sampling generates until the batch is full) as one."""
    out = []
    for event in events:
        if not (event == "generate" and out and out[-1] == "generate"):
            out.append(event)
    return out


def run(config: str, overrides: list, offload_overrides: list, output_dir: str) -> None:
    from tests.support.torchrun_utils import reporting

    from megatron_dapo.config import load_config
    from megatron_dapo.trainer.startup import load_models, start
    from megatron_dapo.trainer.loop import DAPOTrainer

    with reporting({}) as result:
        events: list = []
        checks: list = []
        box: dict = {}
        _install_spies(events, checks, box)
        runtime = None
        for name, extra in (("offload", offload_overrides), ("resident", [])):
            cfg = load_config(config, [*overrides, *extra, f"trainer.output_dir={output_dir}/{name}"])
            if runtime is None:
                runtime = start(cfg)
            else:  # same process groups and tokenizer, fresh weights
                models = load_models(cfg, runtime.hf_config, runtime.ctx.layout)
                runtime = dataclasses.replace(runtime, cfg=cfg, models=models, output_dir=runtime.output_dir.parent / name)
                runtime.output_dir.mkdir(parents=True, exist_ok=True)
            events.clear()
            box.pop("trainer", None)
            trainer = DAPOTrainer(cfg, runtime, say=lambda *a: None)
            box["trainer"] = trainer
            phases = {"start": _collapse(events)}
            metrics = []
            for step in (1, 2):
                events.clear()
                trainer.step = step
                metrics.append(trainer.train_step())
                phases[f"step{step}"] = _collapse(events)
                if step == 1:
                    events.clear()
                    trainer.save()
                    phases["save"] = _collapse(events)
            # At sleep level 1 the engine keeps its weights: a checkpoint hands the GPU back without a push.
            events.clear()
            trainer.rollout.sleep_level = 1
            trainer.save()
            phases["save_level1"] = _collapse(events)
            trainer.offload.onload()  # to read the final weights
            result[name] = {
                "phases": phases,
                "checks": list(checks),
                "metrics": metrics,
                "weights": _weights_digest(trainer.actor),
                "offload_enabled": trainer.offload.enabled,
                "host_bytes": trainer.offload.host_bytes(),
            }
            checks.clear()
            trainer.close()

if __name__ == "__main__":
    run(**json.loads(sys.argv[1]))
