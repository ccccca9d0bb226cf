"""The clip constants are written once: the config, the loss function and the actor's objective
all default to `algorithm.defaults`."""

from __future__ import annotations

import inspect

from megatron_dapo.actor.objective import ObjectiveSettings
from megatron_dapo.algorithm.defaults import CLIP_C, CLIP_HIGH, CLIP_LOW
from megatron_dapo.algorithm.loss import policy_loss
from megatron_dapo.config import AlgorithmConfig


def test_config_loss_and_objective_share_the_clip_defaults():
    paper = {"clip_low": 0.2, "clip_high": 0.28, "clip_c": 3.0}  # DAPO: epsilon_low, epsilon_high; dual-clip c
    assert {"clip_low": CLIP_LOW, "clip_high": CLIP_HIGH, "clip_c": CLIP_C} == paper
    loss_defaults = {k: p.default for k, p in inspect.signature(policy_loss).parameters.items() if k in paper}
    config, objective = AlgorithmConfig(), ObjectiveSettings()
    for source in (loss_defaults, {k: getattr(config, k) for k in paper}, {k: getattr(objective, k) for k in paper}):
        assert source == paper
