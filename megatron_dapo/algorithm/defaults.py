"""DAPO's clip constants, the one place their default values are written.

`config.AlgorithmConfig`, `algorithm.loss.policy_loss` and `actor.objective.ObjectiveSettings` take
their defaults from here. A module of its own, without torch, because `config.py` imports it and
`config.py` must stay quick to import (`megatron-dapo --help`, `megatron-dapo config`).
"""

CLIP_LOW = 0.2
"""epsilon_low: the probability ratio is clipped below at 1 - CLIP_LOW (PPO's usual value)."""
CLIP_HIGH = 0.28
"""epsilon_high: the upper clip 1 + CLIP_HIGH, decoupled and larger (DAPO's clip-higher)."""
CLIP_C = 3.0
"""Dual-clip constant c (> 1): the loss of a negative-advantage token is at most -A * c."""
