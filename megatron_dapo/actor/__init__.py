"""The Megatron actor and reference model: forward-only log-probs and the policy update.

    batch.py      PolicyBatch (named per-sequence / per-token fields) and the micro-batch model inputs
    forward.py    the pipeline schedule and vocab-parallel response log-probs
    objective.py  the loss of one micro-batch, normalised by GLOBAL counts (exact token-mean)
    optim.py      Megatron DDP, optimizer and LR schedule, and why Megatron does not rescale our loss
    policy.py     ReferenceModel, MegatronActor, build_actor, build_reference

Importing this package does not import Megatron-Core (call `distributed.init_distributed` first).
"""

from megatron_dapo.actor.batch import MicroBatch, PolicyBatch, build_micro_batch, plan_micro_batches, split_mini_batches
from megatron_dapo.actor.objective import GlobalCounts, ObjectiveSettings, summarise
from megatron_dapo.actor.policy import ForwardSettings, MegatronActor, ReferenceModel, build_actor, build_reference

__all__ = [
    "ForwardSettings",
    "GlobalCounts",
    "MegatronActor",
    "MicroBatch",
    "ObjectiveSettings",
    "PolicyBatch",
    "ReferenceModel",
    "build_actor",
    "build_micro_batch",
    "build_reference",
    "plan_micro_batches",
    "split_mini_batches",
    "summarise",
]
