"""check-sync's separate placement, the decisions that need no engine (the end-to-end runs, with the
embedded engine and vLLM: tests/rollout/sync/test_check_sync.py): an owner that cannot answer fails
the check at once without leaving another owner, or itself, waiting in a send."""

from __future__ import annotations

import argparse
from types import SimpleNamespace

import pytest
import torch

from megatron_dapo.distributed.layout import ParallelLayout
from megatron_dapo.trainer.check_sync_separate import Answer, RemoteEngines, StopCheck, serve_check


class RecordingBridge:
    """The head's or an owner's end of the bridge: hands out `incoming` in order, records the rest."""

    def __init__(self, incoming=()) -> None:
        self.incoming, self.sent, self.read_from = list(incoming), [], []

    def recv(self, source: int, channel: str = "work"):
        self.read_from.append(source)
        return self.incoming.pop(0)

    def send(self, message, to: int, wait: bool = True, channel: str = "work"):
        self.sent.append((to, message))


def _layout(engines: int) -> ParallelLayout:
    return ParallelLayout(tp=2, placement="separate", rollout_ranks=engines).resolve(2 + engines)


def test_every_answer_is_read_before_an_owners_error_is_raised():
    bridge = RecordingBridge([Answer("ready"), Answer(error="the engine did not start: OSError: no such file"), Answer("ready")])
    engines = RemoteEngines(argparse.Namespace(), SimpleNamespace(layout=_layout(3), bridge=bridge))
    with pytest.raises(RuntimeError, match=r"engine owner 2 \(launch rank 3\): the engine did not start: OSError"):
        engines._answers()
    assert bridge.read_from == [1, 2, 3]  # owner 3's answer taken too: it does not wait in its send


def test_an_answer_of_the_wrong_kind_names_the_owner():
    engines = RemoteEngines(argparse.Namespace(), SimpleNamespace(layout=_layout(1), bridge=RecordingBridge(["ready"])))
    with pytest.raises(RuntimeError, match="engine owner 1 answered with 'ready'"):
        engines._answers()


def test_an_owner_whose_engine_does_not_start_answers_and_waits_for_the_stop():
    bridge = RecordingBridge([StopCheck()])
    ctx = SimpleNamespace(layout=_layout(1), bridge=bridge, device=torch.device("cpu"))

    def make_engine(devices):
        raise OSError("no model here")

    with pytest.raises(OSError, match="no model here"):
        serve_check(argparse.Namespace(engine="embedded", hf_dir="nowhere"), ctx, make_engine)
    assert len(bridge.sent) == 1 and bridge.sent[0][0] == 0
    assert bridge.sent[0][1].error == "the engine did not start: OSError: no model here"
    assert bridge.read_from == [0]  # it left only after the head's stop


def test_an_owner_corrupts_compares_and_samples_its_own_engine(tiny_model_dirs):
    """What an owner does with the head's requests, on a real embedded engine: the self-test's
    corruption (an unknown name answered as the option's error), then the comparison with the
    export streamed to it (one bucket per tensor, the end marker), which finds exactly that tensor."""
    from megatron_dapo.model.hf_config import read_hf_config
    from megatron_dapo.rollout.base import SamplingParams
    from megatron_dapo.rollout.engines.embedded import EmbeddedEngine
    from megatron_dapo.trainer.check_sync_separate import CompareWithExport, CorruptTensor, SampleForCheck, _handle

    model = tiny_model_dirs["qwen2"]
    engine = EmbeddedEngine(model, dtype=torch.float32, device=torch.device("cpu"))
    hf_cfg = read_hf_config(model)
    export = {name: tensor.clone() for name, tensor in engine.named_weights()}  # what the actor would export
    name = "model.layers.1.mlp.up_proj.weight"

    assert _handle(None, engine, hf_cfg, CorruptTensor("nope")).value == "--corrupt-tensor 'nope': the engine has no such tensor"
    assert _handle(None, engine, hf_cfg, CorruptTensor(name)) == Answer(None)

    bridge = RecordingBridge()
    buckets = [[(n, t)] for n, t in export.items()] + [None]
    bridge.broadcast_bucket = lambda _: buckets.pop(0)
    report = _handle(bridge, engine, hf_cfg, CompareWithExport(only_failures=True, printing=True)).value
    assert (report.equal, report.compared, report.problems) == (len(export) - 1, len(export), [name])
    assert len(report.lines) == 1 and report.lines[0].startswith(f"   DIFF  {name}")

    sampled = _handle(None, engine, hf_cfg, SampleForCheck([[5, 6, 7]], SamplingParams(n=2, max_new_tokens=4, seed=0))).value
    assert sampled["prompt_index"] == [0, 0] and all(1 <= len(r) <= 4 for r in sampled["responses"])
    assert [len(lp) for lp in sampled["log_probs"]] == [len(r) for r in sampled["responses"]]
