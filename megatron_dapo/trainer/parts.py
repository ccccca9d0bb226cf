"""The parts a DAPO run holds, each built from its section of the config.

    actor, reference     `actor.build_actor` / `build_reference` on the weights `startup` loaded
    train, val data      `data.dataset` (prompts tokenised, too-long ones handled as configured)
    prompt sampler       `data.sampler.PromptSampler`: gen_batch_size prompts per generation batch
    reward manager       `reward.RewardManager`: the reward function in a worker pool, overlong penalty
    sampling buffer      `algorithm.sampling.DynamicSamplingBuffer`: DAPO's dynamic sampling
"""

from __future__ import annotations

import os
from typing import Any, Callable, Optional

from megatron_dapo.actor import MegatronActor, ReferenceModel, build_actor, build_reference
from megatron_dapo.algorithm.sampling import DynamicSamplingBuffer
from megatron_dapo.config import Config
from megatron_dapo.data.dataset import PromptDataset, datasets_from_config
from megatron_dapo.data.sampler import PromptSampler
from megatron_dapo.reward.loader import load_reward_function
from megatron_dapo.reward.manager import RewardManager
from megatron_dapo.trainer.startup import Runtime


def build_policies(cfg: Config, runtime: Runtime) -> tuple[MegatronActor, Optional[ReferenceModel]]:
    """The actor on `runtime.models` and, with a KL loss, the frozen reference on `runtime.reference_models`
    (both loaded by `startup.start`; the reference only when asked with `reference=True`)."""
    vocab = runtime.hf_config.vocab_size
    wants_reference = cfg.algorithm.kl.use_kl_loss
    if wants_reference != (runtime.reference_models is not None):
        raise ValueError(
            f"algorithm.kl.use_kl_loss={wants_reference} but start-up loaded "
            f"{'a' if runtime.reference_models is not None else 'no'} reference model: start(cfg, reference={wants_reference})"
        )
    reference = build_reference(cfg, runtime.reference_models, vocab) if wants_reference else None
    return build_actor(cfg, runtime.models, vocab), reference


def load_datasets(cfg: Config, tokenizer: Any, say: Callable[[str], None]) -> tuple[PromptDataset, Optional[PromptDataset]]:
    """The train set and the validation set (None without `data.val_files`); `say` describes each."""
    train, val = datasets_from_config(cfg, tokenizer)
    for dataset in (train, val):
        if dataset is not None:
            say(f"{dataset.name} data: {dataset.stats.describe()}")
    return train, val


def build_prompt_sampler(cfg: Config, num_prompts: int) -> PromptSampler:
    return PromptSampler(num_prompts, cfg.trainer.gen_batch_size, shuffle=cfg.data.shuffle, seed=cfg.data.seed)


def build_reward_manager(cfg: Config, tokenizer: Any) -> RewardManager:
    """`reward.*` and the overlong penalty of `algorithm.overlong_buffer`; `reward.num_workers=0`:
    one worker per CPU core, at most 8."""
    a, r = cfg.algorithm, cfg.rollout
    return RewardManager(
        tokenizer,
        score_fn=load_reward_function(cfg.reward.custom_function.path, cfg.reward.custom_function.name),
        num_workers=cfg.reward.num_workers or max(1, min(8, os.cpu_count() or 1)),
        timeout_s=cfg.reward.timeout_s,
        overlong_enable=a.overlong_buffer.enable,
        overlong_buffer_length=a.overlong_buffer.len,
        overlong_penalty_factor=a.overlong_buffer.penalty_factor,
        max_response_length=r.max_response_length,
        min_reward=cfg.reward.min_reward,
    )


def build_sampling_buffer(cfg: Config) -> DynamicSamplingBuffer:
    """Keeps the prompt groups whose rewards differ until `trainer.train_batch_size` groups are kept
    (asynchronous training: also those beyond, for the next step while they are fresh enough)."""
    f = cfg.algorithm.filter_groups
    return DynamicSamplingBuffer(
        cfg.trainer.train_batch_size, cfg.rollout.n, f.max_num_gen_batches, enabled=f.enable, carry_over=cfg.trainer.max_staleness > 0
    )
