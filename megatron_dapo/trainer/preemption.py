"""SIGTERM (SLURM preemption, a time limit): every rank stops at the same point and leaves a checkpoint.

The signal handler only sets a flag. The ranks look at it together (`SigtermFlag.asked`, a
collective) where they are in step: after each generation batch (they have just met in the gather
of its results), before the update, and after the step.

* Before the update the actor has not changed: the checkpoint is the state at the step's start (the
  previous step, with the prompt sampler and RNGs put back by `StepStart.restore`), and the resumed
  run redoes the step with the same prompts and seeds.
* After the step the step is finished (weight sync, metrics) and saved.

* During generation, when the step's start is on disk already (the previous step was saved), the
  ranks do not finish the generation batch: it is called off at once and every rank leaves with that
  checkpoint as the resume point. The ranks agree through the store: the gather meeting's outcome is
  either "off" or "done", set once for all. How a generating rank leaves depends on the placement:
  - leader: an engine's generate holds no collective with other ranks, so the signal handler leaves
    it at once (`SigtermFlag.interruptible`);
  - spmd: the ranks of a rollout-TP group step their engine shards together and none can leave
    mid-step alone, so each votes between engine steps (`SigtermFlag.votes_to_call_off`: its own
    SIGTERM, or the gather meeting called off by another rank, e.g. another rollout replica's)
    every `CALL_OFF_CHECK_STEPS` steps, the group agrees over its TP group, aborts the batch and
    leaves together (`SigtermFlag.calling_off_generation`);
  and the ranks already waiting in the gather meeting leave it (`liveness.calling_off_when`).

Either way the process exits with code 143 (`TrainingInterrupted`). The exit save needs no
engine (`GpuHandover.actor_for_exit`: it never gives the GPU back), and the engine's own processes
never see the SIGTERM (`process_state.sigterm_ignored_by_new_processes`). The time from SIGTERM to
exit is therefore seconds during generation with the step's start saved (leader: at once; spmd: up
to `CALL_OFF_CHECK_STEPS` engine steps, plus one store read and the exit), else what is left of
the current generation batch or of the update, weight sync and validation, plus one checkpoint
write: the lead time of `#SBATCH --signal=TERM@N` must cover it (slurm/README.md).
"""

from __future__ import annotations

import signal
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator, Optional

from megatron_dapo.checkpoint.rng import capture_rng_state, restore_rng_state
from megatron_dapo.distributed import liveness
from megatron_dapo.distributed.objects import any_rank
from megatron_dapo.rollout.base import GenerationCalledOff

EXIT_PREEMPTED = 143  # 128 + SIGTERM: the job was asked to stop and left a checkpoint


class TrainingInterrupted(SystemExit):
    """Raised after the checkpoint written on SIGTERM (exit code 143)."""


class SigtermFlag:
    """Remembers a SIGTERM while installed (``with flag:``, the training loop's duration)."""

    def __init__(self) -> None:
        self.received = False
        self.received_at: Optional[float] = None
        """`time.monotonic()` at the first SIGTERM (None before one)."""
        self._previous = None
        self._interruptible = False

    def __enter__(self) -> "SigtermFlag":
        self._previous = signal.signal(signal.SIGTERM, self._on_signal)
        return self

    def __exit__(self, *exc) -> None:
        signal.signal(signal.SIGTERM, self._previous)

    def _on_signal(self, signum, frame) -> None:
        if not self.received:
            self.received_at = time.monotonic()
        self.received = True
        if self._interruptible:
            self._leave_generation()

    @contextmanager
    def interruptible(self) -> Iterator[None]:
        """The body may be left at once on SIGTERM (now or already received): the gather meeting
        that follows is called off for every rank (`liveness.call_off`) and `MeetingCalledOff` is
        raised here. Only around what holds no collective with other ranks and may be abandoned: an
        engine's `generate` on the leader (its processes, or the embedded engine, are its own)."""
        if self.received:
            self._leave_generation()
        self._interruptible = True
        try:
            yield
        finally:
            self._interruptible = False

    def _leave_generation(self) -> None:
        if liveness.call_off(liveness.GATHER):  # False: the meeting completed, finish as usual
            self._interruptible = False
            raise liveness.MeetingCalledOff("SIGTERM while generating: this generation batch is called off")

    def votes_to_call_off(self) -> bool:
        """This rank's vote, between an spmd engine's steps (`VLLMEngine.generate`'s `call_off`), to
        call the generation batch off: this process received SIGTERM, or the world's gather meeting
        after the batch is called off already (another rank's SIGTERM reached it first: another
        rollout-TP group's rank, or one of this group between two checks). One store read at most."""
        return self.received or liveness.called_off(liveness.GATHER)

    @contextmanager
    def calling_off_generation(self) -> Iterator[None]:
        """Around an spmd engine's generate given `votes_to_call_off`: when the engine's group agreed
        to stop (`GenerationCalledOff`, raised on each of its ranks at the same engine step), call
        off the gather meeting that follows for every rank (`liveness.call_off`: the ranks waiting
        in it leave it, the other groups' ranks vote yes at their next check) and raise
        `MeetingCalledOff` here, as `interruptible` does in the leader placement. This rank has not
        arrived at that meeting, so it cannot have completed: it is off for every rank."""
        try:
            yield
        except GenerationCalledOff as stop:
            liveness.call_off(liveness.GATHER)  # False only without a beat (no store, no other rank)
            raise liveness.MeetingCalledOff(f"SIGTERM while generating: this generation batch is called off ({stop})") from stop

    def seconds_since(self) -> Optional[float]:
        """Seconds since this process's SIGTERM (None where another rank's made the run stop)."""
        return None if self.received_at is None else time.monotonic() - self.received_at

    def asked(self) -> bool:
        """Did any rank receive SIGTERM? A collective on the default group: call it only where every
        rank is in step, never while an engine may still be generating (that wait belongs to the
        gather group, `rollout.gather_timeout_s`)."""
        return any_rank(self.received)


@dataclass(frozen=True)
class StepStart:
    """What a stop before the update puts back: the prompt sampler's and the RNGs' state at the step's start."""

    sampler: dict
    rng: dict

    @classmethod
    def capture(cls, sampler) -> "StepStart":
        return cls(sampler=sampler.state_dict(), rng=capture_rng_state())

    def restore(self, sampler) -> None:
        sampler.load_state_dict(self.sampler)
        restore_rng_state(self.rng)
