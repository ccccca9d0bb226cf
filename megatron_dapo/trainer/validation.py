"""Validation: every prompt of the validation set, `rollout.val_n` responses each, scored.

Each rollout replica generates its contiguous share of the set (`data.sampler.shard_for_rank`, the
rule that also shares out the training prompts; a validation set need not split evenly), with a
seed per prompt so that the scores do not depend on how an engine batches. The replicas' samples
are pooled on every rank (a collective) and summarised as avg@n, pass@k and maj@n
(`metrics.validation_metrics`).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from megatron_dapo.config import Config
from megatron_dapo.data.sampler import shard_for_rank
from megatron_dapo.rollout.base import SamplingParams
from megatron_dapo.trainer.metrics import validation_metrics
from megatron_dapo.trainer.remote_rollout import GenerateShare
from megatron_dapo.trainer.samples import gather_samples, generate_and_score
from megatron_dapo.trainer.seeds import validation_seed


def validate(cfg: Config, rollout: Any, reward: Any, val_data: Sequence[Any]) -> dict[str, float]:
    """The `val/*` metrics of `val_data` (every rank calls it; every rank gets the same metrics)."""
    started = time.perf_counter()
    shares = rollout.data_size
    if rollout.placement == "separate":  # every engine its share, on the rollout ranks
        samples = rollout.generate_all([_share(cfg, val_data, share, shares) for share in range(shares)])
    else:
        share = rollout.data_rank  # this rank's engine's share of the prompts
        request = _share(cfg, val_data, share, shares)
        local = generate_and_score(
            rollout, reward, request.examples, request.params, uid_prefix=request.uid_prefix, validating=True,
            apply_overlong=request.apply_overlong,
        )  # fmt: skip
        samples = gather_samples(local, order_key=share)
    return validation_metrics(samples, cfg.rollout.val_n, seconds=time.perf_counter() - started)


def _share(cfg: Config, val_data: Sequence[Any], share: int, shares: int) -> GenerateShare:
    """Engine `share`'s part of the validation set, with its seed."""
    r = cfg.rollout
    examples = [val_data[i] for i in shard_for_rank(range(len(val_data)), share, shares, even=False)]
    params = SamplingParams(
        n=r.val_n, temperature=r.val_temperature, top_p=r.val_top_p, top_k=r.top_k,
        max_new_tokens=r.max_response_length, stop=tuple(r.stop), seed=validation_seed(r.seed, share),
        seed_per_prompt=True,  # validation scores must not depend on how the engine batches
    )  # fmt: skip
    return GenerateShare(
        examples, params, uid_prefix=f"val{share}:", validating=True, apply_overlong=cfg.algorithm.overlong_buffer.apply_in_validation
    )
