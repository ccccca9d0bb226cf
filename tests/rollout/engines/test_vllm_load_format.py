"""Whether a vLLM engine reads the checkpoint's weights at start (issue 26 item 9), pure.

The trainer pushes the actor's weights before the first generate, so an SPMD engine (every rank its
own shard) starts on vLLM's dummy weights by default: no rank reads the checkpoint only to have the
push overwrite it. The real SPMD engine starting that way, then filled by the push and compared with
the actor: test_spmd_vllm.py."""

from __future__ import annotations

import inspect

import pytest

from megatron_dapo.rollout.engines.vllm.engine import VLLMEngine, checkpoint_load_format


def test_spmd_engines_start_without_reading_the_checkpoint():
    assert checkpoint_load_format("spmd", None) == "dummy"  # the trainer's default (make_engine passes nothing)
    assert checkpoint_load_format("leader", None) is None  # vLLM's own default: the checkpoint
    assert checkpoint_load_format("spmd", True) is None  # generates before any push (seeding tests, a sampling check)
    assert checkpoint_load_format("leader", False) == "dummy"
    with pytest.raises(ValueError, match="placement"):
        checkpoint_load_format("everywhere", None)


def test_the_engine_takes_it_as_an_explicit_option_defaulting_to_the_trainers_choice():
    parameter = inspect.signature(VLLMEngine).parameters["load_checkpoint"]
    assert parameter.default is None and parameter.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD

