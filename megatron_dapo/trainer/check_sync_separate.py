"""check-sync in the separate placement: the engines on ranks of their own, reached over the bridge.

    megatron-dapo check-sync --hf-dir tiny --placement separate --tp 2 --rollout-ranks 1

`run_check` (check_sync.py) runs the same steps in every placement; here they reach engines that
live on the last `--rollout-ranks` processes of the launch (`rollout.num_gpus` in training):

* the trainer's ranks hold `RemoteEngines`: the head (launch rank 0) sends each engine owner a
  request over the bridge's message channel and reads its answer; the weights travel exactly as in
  training, `RemoteRollout.sync_weights` (the first replica's "gather" export, one broadcast per
  bucket and dtype over the bridge: NCCL between GPUs, gloo on the CPU);
* each engine owner runs `serve_check`: it builds its engine from the checkpoint, then answers,
  one message at a time: sample (`SampleForCheck`), compare its weights with the export the head
  streams over the bridge (`CompareWithExport`, the comparison the colocated check runs on rank 0),
  load a push (`PushWeights`, the training path's `receive_push`), corrupt a tensor (the
  self-test), stop. The group's other ranks lend their GPUs and wait, as in training.

The owners do the comparisons (the engine's weights never cross the bridge) and send back the
lines to print; rank 0 prints them, so the report reads as in the colocated placements.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from megatron_dapo.model.hf_config import read_hf_config
from megatron_dapo.model.load import export_megatron_to_hf
from megatron_dapo.rollout.base import SamplingParams
from megatron_dapo.rollout.sync.remote import PushWeights, receive_push
from megatron_dapo.trainer.remote_rollout import RemoteRollout
from megatron_dapo.trainer.rollout_worker import lend_until_done, owner_done, pool_engine_devices

__all__ = ["RemoteEngines", "serve_check"]


@dataclass(frozen=True)
class SampleForCheck:
    prompts: list
    params: SamplingParams


@dataclass(frozen=True)
class CompareWithExport:
    """The export follows on the bridge, one tensor per bucket, until the end marker."""

    only_failures: bool
    printing: bool


@dataclass(frozen=True)
class CompareReport:
    equal: int
    compared: int
    problems: list
    lines: list


@dataclass(frozen=True)
class CorruptTensor:
    name: str


@dataclass(frozen=True)
class Answer:
    """An owner's answer to a request: its `value`, or the `error` that stopped it."""

    value: Any = None
    error: Optional[str] = None


@dataclass(frozen=True)
class StopCheck:
    pass


class RemoteEngines:
    """The trainer ranks' view of the separate engines during the check (the colocated one:
    `check_sync._ColocatedEngine`). Calls are collectives of the trainer's ranks; only the head
    talks to the owners."""

    def __init__(self, args: argparse.Namespace, ctx: Any) -> None:
        self.args = args
        self.layout = ctx.layout
        self.bridge = ctx.bridge  # the head's end; None on the other trainer ranks
        self.count = self.layout.rollout_engines
        self._stopped = False

    def describe(self) -> str:
        first = self.layout.engine_leaders()[0]
        return (f"{self.count} engine(s) of TP={self.layout.rollout_tp} on {self.layout.rollout_ranks} rank(s) of their own "
                f"(separate, from launch rank {first})")  # fmt: skip

    # ------------------------------------------------------------------ requests

    def _ask_all(self, request: Any) -> list:
        """The head: send `request` to every owner (None: send nothing, read the answers they send
        anyway), return their answers in order. Every trainer rank gets the values, or raises the
        error an owner answered with."""

        def ask() -> list:
            if request is not None:
                for owner in self._owners():
                    self.bridge.send(request, owner)
            return self._answers()

        return self._on_head(ask)

    def _on_head(self, work: Callable[[], Any]) -> Any:
        """`work()` on the head, its value (or its error) on every trainer rank: the others raise
        with it instead of waiting in a collective for the head that left."""
        outcome: list = [None]
        if self.bridge is not None:
            try:
                outcome = [("value", work())]
            except RuntimeError as error:
                outcome = [("error", str(error))]
        dist.broadcast_object_list(outcome, src=0)
        kind, payload = outcome[0]
        if kind == "error":
            raise RuntimeError(payload)
        return payload

    def _answers(self) -> list:
        """Every owner's answer, in order; read all before raising the first error (an owner whose
        answer is left unread would wait in its send)."""
        answers = [self.bridge.recv(owner) for owner in self._owners()]
        for owner, answer in enumerate(answers, start=1):
            if not isinstance(answer, Answer):
                raise RuntimeError(f"engine owner {owner} answered with {answer!r}")
            if answer.error is not None:
                raise RuntimeError(f"engine owner {owner} (launch rank {self.layout.engine_leaders()[owner - 1]}): {answer.error}")
        return [answer.value for answer in answers]

    def _owners(self) -> range:
        return range(1, self.count + 1)

    def ready(self) -> None:
        self._ask_all(None)  # each owner answers once its engine is up
        dist.barrier()

    def sample(self, prompts: list, seed: int) -> list[dict]:
        a = self.args
        params = SamplingParams(n=a.responses_per_prompt, temperature=a.temperature, max_new_tokens=a.max_new_tokens, seed=seed)
        return self._ask_all(SampleForCheck(prompts, params))

    def compare(self, models, hf_cfg, say: Callable[[str], None], only_failures: bool) -> list[tuple[int, int, list[str]]]:
        printing = bool(getattr(say, "enabled", True))
        if self.bridge is not None:
            request = CompareWithExport(only_failures, printing)
            for owner in self._owners():
                self.bridge.send(request, owner)
        for name, tensor in export_megatron_to_hf(models, hf_cfg):
            if self.bridge is not None:
                self.bridge.broadcast_bucket([(name, tensor)])

        def end_and_read_reports() -> list:
            self.bridge.broadcast_bucket(None)
            return self._answers()

        reports = self._on_head(end_and_read_reports)
        if self.bridge is None:
            return [(0, 0, [])]
        for index, report in enumerate(reports):
            if self.count > 1 and printing:
                say(f"   engine {index + 1} (launch rank {self.layout.engine_leaders()[index]}):")
            for line in report.lines:
                say(line)
        return [(r.equal, r.compared, r.problems) for r in reports]

    def sync(self, models, hf_cfg):
        """The training path: `RemoteRollout.sync_weights` (the owners load it with `receive_push`)."""
        remote = RemoteRollout.create(None, self.layout, self.bridge)
        try:
            return remote.sync_weights(models, hf_cfg, self.args.bucket_mb), remote.sync_mode
        finally:
            remote.close_weight_sync()

    def corrupt(self, name: str, hf_cfg) -> None:
        errors = self._ask_all(CorruptTensor(name))
        problem = next((e for e in errors if e), None)
        if problem:
            from megatron_dapo.trainer.check_sync import CheckSyncError

            raise CheckSyncError(problem)

    def close(self) -> None:
        """Stop every engine (the head; once)."""
        if self.bridge is not None and not self._stopped:
            self._stopped = True
            for owner in self._owners():
                self.bridge.send(StopCheck(), owner)


def serve_check(args: argparse.Namespace, ctx: Any, make_engine: Callable[[Any], Any]) -> None:
    """A rollout rank's part of the check (see the module doc). `make_engine(devices)` builds the
    engine on the owner's GPUs."""
    layout = ctx.layout
    devices = pool_engine_devices(layout, args.engine, ctx.device)  # a collective of the rollout ranks
    bridge = ctx.bridge
    if bridge is None:
        lend_until_done(layout.rollout_engines)
        return
    engine = None
    try:
        try:
            engine = make_engine(devices)
        except Exception as error:  # the head reports it instead of waiting for its timeout ...
            bridge.send(Answer(error=f"the engine did not start: {type(error).__name__}: {error}"), 0)
            bridge.recv(0)  # ... and tells this owner to stop, which it waits for (a send to a gone rank would hang)
            raise
        bridge.send(Answer("ready"), 0)  # the first answer: the engine is up
        hf_cfg = read_hf_config(args.hf_dir)
        while True:
            message = bridge.recv(0)
            if isinstance(message, StopCheck):
                break
            if isinstance(message, PushWeights):
                receive_push(bridge, engine, message)
                continue
            bridge.send(_handle(bridge, engine, hf_cfg, message), 0)
    finally:
        if engine is not None:
            engine.shutdown()
        owner_done()


def _handle(bridge: Any, engine: Any, hf_cfg: Any, message: Any) -> Answer:
    """An owner's answer to one request of the head."""
    from megatron_dapo.trainer.check_sync import CheckSyncError, TensorComparison, corrupt_engine_tensor

    if isinstance(message, CompareWithExport):
        lines: list[str] = []
        tied = bool(getattr(hf_cfg, "tie_word_embeddings", False))
        comparison = TensorComparison(engine.named_weights(), tied, lines.append, message.only_failures)
        while True:
            bucket = bridge.broadcast_bucket(None)
            if bucket is None:
                break
            for name, tensor in bucket:
                comparison.add(name, tensor)
        equal, compared, problems = comparison.finish()
        return Answer(CompareReport(equal, compared, problems, lines if message.printing else []))
    if isinstance(message, SampleForCheck):
        try:
            out = engine.generate(message.prompts, message.params)
        except Exception as error:
            return Answer(error=f"generate failed: {type(error).__name__}: {error}")
        return Answer({
            "prompt_index": list(out.prompt_index),
            "responses": [list(r) for r in out.response_ids],
            "log_probs": [lp.tolist() for lp in out.log_probs],
        })  # fmt: skip
    if isinstance(message, CorruptTensor):
        try:
            corrupt_engine_tensor(engine, message.name, hf_cfg)
        except CheckSyncError as error:
            return Answer(str(error))
        return Answer(None)
    return Answer(error=f"unexpected request {message!r}")

