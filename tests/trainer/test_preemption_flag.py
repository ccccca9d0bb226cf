"""SIGTERM's flag and what a stop before the update puts back (`trainer.preemption`), in one process."""

from __future__ import annotations

import os
import random
import signal

import numpy as np
import torch

from megatron_dapo.data.sampler import PromptSampler
from megatron_dapo.trainer.preemption import EXIT_PREEMPTED, SigtermFlag, StepStart, TrainingInterrupted


def test_sigterm_sets_the_flag_while_installed_and_the_previous_handler_comes_back():
    seen = []
    previous = signal.signal(signal.SIGTERM, lambda *_: seen.append("outer"))
    try:
        flag = SigtermFlag()
        assert not flag.asked()  # without a process group: this process's flag
        with flag:
            os.kill(os.getpid(), signal.SIGTERM)
            assert flag.received and flag.asked()
        assert seen == []  # the run's handler took it, not the outer one
        os.kill(os.getpid(), signal.SIGTERM)
        assert seen == ["outer"]
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert issubclass(TrainingInterrupted, SystemExit) and TrainingInterrupted(EXIT_PREEMPTED).code == 143


def test_step_start_puts_back_the_prompts_and_the_random_draws():
    sampler = PromptSampler(10, 4, shuffle=True, seed=3)
    sampler.next_batch()
    start = StepStart.capture(sampler)
    first = (sampler.next_batch(), random.random(), float(np.random.rand()), torch.rand(3))
    sampler.next_batch()
    start.restore(sampler)
    again = (sampler.next_batch(), random.random(), float(np.random.rand()), torch.rand(3))
    assert first[:3] == again[:3] and torch.equal(first[3], again[3])
