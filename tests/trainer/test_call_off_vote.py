"""The trainer's side of an spmd engine's call-off, in one process over an in-memory store: a rank's
vote (`SigtermFlag.votes_to_call_off`: its SIGTERM, or the gather meeting called off by another
rank), the conversion of the engine group's `GenerationCalledOff` into the gather meeting's
call-off (`SigtermFlag.calling_off_generation`), which of them `_generate_batch` uses per
placement, and how the vote reaches the engine (`generate_and_score` -> `RolloutGroup.generate`).
The real engine: tests/rollout/engines/test_spmd_call_off.py."""

from __future__ import annotations

import os
import signal
from contextlib import nullcontext
from types import SimpleNamespace

import pytest

from megatron_dapo.distributed import liveness
from megatron_dapo.data.dataset import PromptExample
from megatron_dapo.distributed.placement import SpmdSlot
from megatron_dapo.rollout.base import GenerationCalledOff, RolloutEngine, SamplingParams
from megatron_dapo.rollout.group import RolloutGroup
from megatron_dapo.trainer.loop import DAPOTrainer
from megatron_dapo.trainer.preemption import SigtermFlag
from megatron_dapo.trainer.samples import generate_and_score




def test_a_rank_votes_on_its_own_sigterm(liveness_job):
    with SigtermFlag() as flag:
        assert flag.votes_to_call_off() is False
        os.kill(os.getpid(), signal.SIGTERM)
        assert flag.votes_to_call_off() is True
    assert liveness_job.add("count/gather/0", 0) == 0  # the vote called nothing off by itself


def test_a_rank_votes_when_another_called_the_gather_meeting_off(liveness_job):
    flag = SigtermFlag()
    assert flag.votes_to_call_off() is False
    assert liveness_job.compare_set("outcome/gather/0", "", "off") == b"off"  # rank 1's SIGTERM, in its own group
    liveness_job.add("count/gather/0", liveness.CALLED_OFF)
    assert flag.votes_to_call_off() is True and not flag.received


def test_the_engine_groups_call_off_becomes_the_gather_meetings(liveness_job):
    flag = SigtermFlag()
    with pytest.raises(liveness.MeetingCalledOff, match="called off") as raised:
        with flag.calling_off_generation():
            raise GenerationCalledOff("the group voted to stop")
    assert isinstance(raised.value.__cause__, GenerationCalledOff)
    # Every rank of the world finds the meeting off: those waiting in it, those still generating.
    assert liveness_job.get("outcome/gather/0") == b"off"
    assert liveness_job.add("count/gather/0", 0) >= liveness.CALLED_OFF
    # Anything else passes through untouched, and a finished generate calls nothing off.
    with pytest.raises(RuntimeError, match="engine died"):
        with flag.calling_off_generation():
            raise RuntimeError("engine died")
    with flag.calling_off_generation():
        pass
    assert not liveness_job.check(["outcome/gather/1"])


def test_generate_batch_picks_the_call_off_of_its_placement():
    trainer = DAPOTrainer.__new__(DAPOTrainer)  # only what `_generation_call_off` reads
    trainer.sigterm = SigtermFlag()
    trainer.step, trainer._last_saved_step = 5, 4  # the step's start is on disk
    trainer.rollout = SimpleNamespace(placement="leader")
    assert trainer._generation_call_off() == (trainer.sigterm.interruptible, None)
    trainer.rollout = SimpleNamespace(placement="spmd")
    assert trainer._generation_call_off() == (trainer.sigterm.calling_off_generation, trainer.sigterm.votes_to_call_off)
    trainer._last_saved_step = 3  # not saved: the batch is finished, whatever the placement
    assert trainer._generation_call_off() == (nullcontext, None)


class VotingEngine(RolloutEngine):
    """Records the vote an spmd engine is given and honours it once, as `VLLMEngine.generate` does
    at its first check (the forwarding is what is tested here, not the engine)."""

    def __init__(self):
        self.calls = []

    def generate(self, prompt_ids, params, collect=True, call_off=None):
        self.calls.append((collect, call_off))
        if call_off is not None and call_off():
            raise GenerationCalledOff("the group voted to stop")
        raise AssertionError("not asked to stop")

    def load_weights(self, weights):
        pass


def test_the_vote_reaches_the_spmd_engine_and_comes_back_as_the_meetings_call_off(liveness_job):
    engine = VotingEngine()
    examples = [PromptExample(index=0, prompt_ids=[1, 2], prompt_text="", ground_truth="1", data_source="d", extra_info={})]
    params = SamplingParams(n=2, max_new_tokens=4, seed=1)
    with SigtermFlag() as flag:
        os.kill(os.getpid(), signal.SIGTERM)
        for tp_rank in (0, 1):  # the group's first rank hands results on; the other does not collect
            rollout = RolloutGroup(engine, engine_kind="vllm", spmd=SpmdSlot(tp_rank, 2, 2))
            with pytest.raises(liveness.MeetingCalledOff):
                generate_and_score(rollout, None, examples, params, uid_prefix="s2g0r0p",
                                   during_generate=flag.calling_off_generation, call_off=flag.votes_to_call_off)  # fmt: skip
    assert engine.calls == [(True, flag.votes_to_call_off), (False, flag.votes_to_call_off)]
    assert liveness_job.get("outcome/gather/0") == b"off"
    # The leader placement's generate is left from the signal handler: it takes no vote.
    with pytest.raises(ValueError, match="spmd placement"):
        RolloutGroup(engine, engine_kind="vllm").generate([[1, 2]], params, call_off=lambda: True)
