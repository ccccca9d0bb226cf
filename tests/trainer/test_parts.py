"""The parts built from the config (`trainer.parts`)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from megatron_dapo.config import Config
from megatron_dapo.trainer.parts import build_policies, build_prompt_sampler, build_sampling_buffer
from megatron_dapo.trainer.startup import Runtime


def test_a_kl_loss_needs_the_reference_weights_from_start_up():
    cfg = Config()
    cfg.algorithm.kl.use_kl_loss = True
    runtime = Runtime(cfg=cfg, ctx=None, tokenizer=None, hf_config=SimpleNamespace(vocab_size=8), models=[], output_dir=Path("."))
    with pytest.raises(ValueError, match=r"use_kl_loss=True but start-up loaded no reference model: start\(cfg, reference=True\)"):
        build_policies(cfg, runtime)


def test_sampler_and_buffer_follow_the_config():
    cfg = Config()
    cfg.trainer.gen_batch_size, cfg.trainer.train_batch_size, cfg.rollout.n = 6, 4, 3
    sampler = build_prompt_sampler(cfg, num_prompts=9)
    assert len(sampler.next_batch()) == 6 and sampler.seed == cfg.data.seed and sampler.shuffle == cfg.data.shuffle
    buffer = build_sampling_buffer(cfg)
    assert not buffer.is_full
