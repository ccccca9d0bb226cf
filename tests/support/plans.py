"""Plans of the built-in model shapes that the planner's tests (tests/plan, tests/cli) share."""

from __future__ import annotations

from megatron_dapo import plan as mp
from megatron_dapo.config import load_config


def known(name):
    return mp.known_model(name)


def plan_for(overrides, model="qwen2.5-7b", nodes=2, gpus_per_node=8, **kwargs):
    cfg = load_config(None, overrides)
    cluster = mp.ClusterShape(nodes=nodes, gpus_per_node=gpus_per_node)
    return mp.plan_memory(cfg, known(model), cluster, model_name=model, **kwargs)


OFFLOAD_ALL = ["actor.offload_params=true", "actor.offload_grads=true", "actor.offload_optimizer=true", "rollout.sleep_level=2"]
