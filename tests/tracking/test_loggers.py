"""MetricsLogger backends: jsonl (round trip, crash safety, resume truncation), TensorBoard (read back
with TensorBoard's own EventAccumulator), console table, W&B contract, disabled ranks, errors."""

from __future__ import annotations

import io
import json
import math
import sys
import types

import numpy as np
import pytest
import torch

from megatron_dapo.tracking import (
    LoggerBackendUnavailable,
    MetricsLogger,
    format_metrics_table,
    read_metrics,
    truncate_metrics_after,
)
from megatron_dapo.tracking.loggers import format_value

STEP_METRICS = {
    "critic/score/mean": 0.453125,
    "critic/rewards/mean": 0.40625,
    "actor/pg_loss": -0.0123456,
    "actor/pg_clipfrac": 0.00125,
    "actor/pg_clipfrac_lower": 0.0,
    "actor/ppo_kl": 1.5e-4,
    "actor/entropy": 0.693147,
    "actor/grad_norm": 1.25,
    "actor/lr": 1e-6,
    "response_length/mean": 312.5,
    "response_length/clip_ratio": 0.03125,
    "train/num_gen_batches": 3,
    "timing_s/gen": 12.25,
    "timing_s/step": 30.5,
    "perf/tokens_per_s": 12345.678,
}


def _metrics_at(step: int) -> dict[str, float]:
    """Distinct values per step so that a record written at the wrong step is caught."""
    return {key: (value + step if isinstance(value, float) else value * step) for key, value in STEP_METRICS.items()}


# ------------------------------------------------------------------ jsonl


def test_jsonl_round_trip_keeps_values_and_puts_step_first(tmp_path):
    with MetricsLogger(tmp_path, ["jsonl"]) as logger:
        for step in (1, 2, 3):
            logger.log(_metrics_at(step), step)
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == 3
    for step, line in zip((1, 2, 3), lines):
        assert line.startswith('{"step": %d,' % step)
        assert list(json.loads(line))[0] == "step"
    records = read_metrics(tmp_path / "metrics.jsonl")
    assert records == [{"step": step, **_metrics_at(step)} for step in (1, 2, 3)]
    assert isinstance(records[0]["train/num_gen_batches"], int)
    assert read_metrics(tmp_path) == records  # a run directory reads its metrics.jsonl


def test_jsonl_accepts_numpy_and_tensor_scalars_and_writes_non_finite_as_null(tmp_path):
    metrics = {
        "a/np_float": np.float32(0.5),
        "a/np_int": np.int64(7),
        "a/tensor": torch.tensor(2.5),
        "a/int_tensor": torch.tensor(4),
        "a/bool": True,
        "b/nan": float("nan"),
        "b/inf": float("inf"),
        "b/neg_inf": -math.inf,
    }
    with MetricsLogger(tmp_path, ["jsonl"]) as logger:
        logger.log(metrics, np.int64(5))

    def reject_constant(name):
        raise AssertionError(f"non-standard JSON constant {name} written")

    raw = json.loads((tmp_path / "metrics.jsonl").read_text(), parse_constant=reject_constant)
    assert raw == {
        "step": 5, "a/np_float": 0.5, "a/np_int": 7, "a/tensor": 2.5, "a/int_tensor": 4, "a/bool": 1,
        "b/nan": None, "b/inf": None, "b/neg_inf": None,
    }  # fmt: skip
    (record,) = read_metrics(tmp_path)
    assert all(math.isnan(record[key]) for key in ("b/nan", "b/inf", "b/neg_inf"))


def test_each_line_is_on_disk_before_log_returns(tmp_path):
    logger = MetricsLogger(tmp_path, ["jsonl"])
    logger.log({"critic/score/mean": 0.25}, 1)
    # Read by a separate handle while the logger is still open, as after a crash.
    assert read_metrics(tmp_path / "metrics.jsonl") == [{"step": 1, "critic/score/mean": 0.25}]
    logger.close()


def _write_steps(path, steps):
    with MetricsLogger(path, ["jsonl"]) as logger:
        for step in steps:
            metrics = {"critic/score/mean": step / 10}
            if step == 3:
                metrics["val/acc/mean@4"] = step / 100
            logger.log(metrics, step)


def test_truncate_metrics_after_drops_later_steps_atomically(tmp_path):
    _write_steps(tmp_path, [1, 2, 3, 4, 5])
    path = tmp_path / "metrics.jsonl"
    original = path.read_text()
    truncate_metrics_after(path, 3)
    assert [r["step"] for r in read_metrics(path)] == [1, 2, 3]
    assert original.startswith(path.read_text())  # the kept lines are byte-identical
    assert sorted(p.name for p in tmp_path.iterdir()) == ["metrics.jsonl"]  # no temporary left
    truncate_metrics_after(path, 10)  # nothing later: unchanged
    assert [r["step"] for r in read_metrics(path)] == [1, 2, 3]
    truncate_metrics_after(tmp_path / "absent.jsonl", 1)
    assert not (tmp_path / "absent.jsonl").exists()


def test_resumed_logger_records_each_step_once(tmp_path):
    _write_steps(tmp_path, [1, 2, 3, 4, 5])  # crashed after step 5; the checkpoint is step 3
    with MetricsLogger(tmp_path, ["jsonl"], resume_step=3) as logger:
        for step in (4, 5, 6):
            logger.log({"critic/score/mean": step}, step)
    records = read_metrics(tmp_path)
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5, 6]
    assert [r["critic/score/mean"] for r in records[3:]] == [4, 5, 6]
    assert records[2]["val/acc/mean@4"] == 0.03


def test_torn_last_line_is_ignored_and_repaired(tmp_path):
    _write_steps(tmp_path, [1, 2])
    path = tmp_path / "metrics.jsonl"
    with open(path, "a") as handle:
        handle.write('{"step": 3, "critic/sco')  # the process died mid-write
    with pytest.warns(UserWarning, match="torn last line"):
        assert [r["step"] for r in read_metrics(path)] == [1, 2]
    with MetricsLogger(tmp_path, ["jsonl"]) as logger:
        logger.log({"critic/score/mean": 0.5}, 3)
    assert [r["step"] for r in read_metrics(path)] == [1, 2, 3]


def test_corrupt_line_in_the_middle_is_an_error(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "a": 1}\nnot json\n{"step": 3, "a": 1}\n')
    with pytest.raises(ValueError, match=r"metrics.jsonl:2"):
        read_metrics(path)
    path.write_text('{"a": 1}\n')
    with pytest.raises(ValueError, match="integer 'step'"):
        truncate_metrics_after(path, 1)


# ------------------------------------------------------------------ TensorBoard


def _tensorboard_scalars(log_dir) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    accumulator = EventAccumulator(str(log_dir), size_guidance={"scalars": 0})
    accumulator.Reload()
    return {tag: [(e.step, e.value) for e in accumulator.Scalars(tag)] for tag in accumulator.Tags()["scalars"]}


def test_tensorboard_events_read_back_equal(tmp_path):
    with MetricsLogger(tmp_path, ["tensorboard"], config={"trainer": {"total_steps": 3}}) as logger:
        for step in (1, 2, 3):
            logger.log(_metrics_at(step), step)
    scalars = _tensorboard_scalars(tmp_path / "tensorboard")
    assert set(scalars) == set(STEP_METRICS)
    for key in STEP_METRICS:
        # TensorBoard stores float32.
        assert scalars[key] == [(step, float(np.float32(_metrics_at(step)[key]))) for step in (1, 2, 3)], key


def test_tensorboard_resume_hides_events_after_the_checkpoint(tmp_path):
    with MetricsLogger(tmp_path, ["tensorboard"]) as logger:
        for step in range(1, 6):
            logger.log({"critic/score/mean": float(step)}, step)
    with MetricsLogger(tmp_path, ["tensorboard"], resume_step=2) as logger:
        for step in (3, 4):
            logger.log({"critic/score/mean": 10.0 * step}, step)
    assert _tensorboard_scalars(tmp_path / "tensorboard")["critic/score/mean"] == [
        (1, 1.0), (2, 2.0), (3, 30.0), (4, 40.0)
    ]  # fmt: skip


def test_fresh_run_removes_an_earlier_runs_tensorboard_events(tmp_path):
    """An old run's event file would be drawn into the new run's curves (TensorBoard reads every event
    file of the directory as one run), including steps the new run never made."""
    with MetricsLogger(tmp_path, ["tensorboard"]) as logger:
        for step in range(1, 6):
            logger.log({"critic/score/mean": float(step), "old/only": 1.0}, step)
    old_files = sorted((tmp_path / "tensorboard").glob("events.out.tfevents.*"))
    assert old_files
    (tmp_path / "tensorboard" / "notes.txt").write_text("not an event file: kept")
    with MetricsLogger(tmp_path, ["tensorboard"]) as logger:  # fresh: no resume_step
        for step in (1, 2):
            logger.log({"critic/score/mean": 10.0 * step}, step)
    assert not any(path.exists() for path in old_files)
    assert _tensorboard_scalars(tmp_path / "tensorboard") == {"critic/score/mean": [(1, 10.0), (2, 20.0)]}
    assert (tmp_path / "tensorboard" / "notes.txt").exists()


def test_tensorboard_missing_names_the_fix(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # import now fails as if absent
    with pytest.raises(LoggerBackendUnavailable, match=r"trainer\.loggers.*pip install tensorboard"):
        MetricsLogger(tmp_path, ["jsonl", "tensorboard"])


# ------------------------------------------------------------------ console


def test_console_table_groups_keys_by_prefix(tmp_path):
    stream = io.StringIO()
    with MetricsLogger(tmp_path, ["console"], stream=stream) as logger:
        logger.log({**STEP_METRICS, "val/acc/mean@16": 0.3125, "loss": 2.0}, 7)
    text = stream.getvalue()
    lines = text.splitlines()
    assert lines[0].startswith("── step 7 ")
    labels = [line.split()[0] for line in lines[1:] if not line.startswith(" ")]
    assert labels == ["critic", "actor", "response_length", "train", "val", "timing_s", "perf", "misc"]
    critic = next(line for line in lines if line.startswith("critic"))
    assert "score/mean" in critic and "0.4531" in critic and "critic/score" not in critic
    assert "1.235e+04" in text and "num_gen_batches" in text and "acc/mean@16" in text
    assert not list(tmp_path.iterdir())  # console only: no files


def test_console_table_wraps_long_groups_and_aligns_columns():
    metrics = {f"actor/metric_{i}": i / 3 for i in range(12)}
    text = format_metrics_table(metrics, 1, width=80)
    actor_lines = text.splitlines()[1:]
    assert len(actor_lines) > 1 and all(len(line) <= 80 for line in actor_lines)
    assert actor_lines[0].startswith("actor") and all(line.startswith(" ") for line in actor_lines[1:])
    assert sum(line.count("metric_") for line in actor_lines) == 12
    # Aligned: every line starts its cells at the same column.
    assert {line.index("metric_") for line in actor_lines} == {actor_lines[0].index("metric_")}


def test_console_every_skips_steps_but_not_validation(tmp_path):
    stream = io.StringIO()
    with MetricsLogger(tmp_path, ["console"], stream=stream, console_every=2) as logger:
        logger.log({"critic/score/mean": 0.1}, 1)
        logger.log({"critic/score/mean": 0.2}, 2)
        logger.log({"val/pass@8": 0.5}, 3)
    headers = [line.split()[2] for line in stream.getvalue().splitlines() if line.startswith("── step")]
    assert headers == ["2", "3"]


@pytest.mark.parametrize(
    "value, text",
    [(0.453125, "0.4531"), (12345.678, "1.235e+04"), (1e-6, "1e-06"), (3, "3"), (123456, "123456"), (-0.5, "-0.5"),
     (float("nan"), "nan"), (float("-inf"), "-inf")],
)  # fmt: skip
def test_format_value_four_significant_digits(value, text):
    assert format_value(value) == text


# ------------------------------------------------------------------ disabled ranks and errors


def test_disabled_logger_writes_nothing(tmp_path):
    out = tmp_path / "run"
    stream = io.StringIO()
    with MetricsLogger(out, ["console", "jsonl", "tensorboard", "wandb"], enabled=False, stream=stream) as logger:
        logger.log({"critic/score/mean": 1.0}, 1)
        logger.log({"not a number": "ignored on this rank"}, 2)
    assert not out.exists() and stream.getvalue() == ""


def test_unknown_backend_fails_on_every_rank(tmp_path):
    for enabled in (True, False):
        with pytest.raises(ValueError, match=r"trainer\.loggers.*'tensorbord'"):
            MetricsLogger(tmp_path, ["console", "tensorbord"], enabled=enabled)


def test_bad_calls_fail_loudly(tmp_path):
    logger = MetricsLogger(tmp_path, ["jsonl"])
    with pytest.raises(TypeError, match="'a/text'"):
        logger.log({"a/text": "high"}, 1)
    with pytest.raises(TypeError, match="'a/vector'"):
        logger.log({"a/vector": torch.ones(2)}, 1)
    with pytest.raises(TypeError, match="step"):
        logger.log({"a": 1.0}, 1.5)
    with pytest.raises(ValueError, match="reserved"):
        logger.log({"step": 1.0}, 1)
    with pytest.raises(ValueError, match=">= 0"):
        logger.log({"a": 1.0}, -1)
    logger.close()
    logger.close()  # idempotent
    with pytest.raises(RuntimeError, match="after close"):
        logger.log({"a": 1.0}, 1)
    assert (tmp_path / "metrics.jsonl").read_text() == ""  # no failed call wrote a line


# ------------------------------------------------------------------ W&B (contract: not installable here)


class _FakeWandb(types.ModuleType):
    """Records the calls the real `wandb` module and its Run would receive."""

    def __init__(self):
        super().__init__("wandb")
        self.calls = []

    def init(self, **kwargs):
        self.calls.append(("init", kwargs))
        recorder = self.calls

        class Run:
            def log(self, data, step=None):
                recorder.append(("log", dict(data), step))

            def finish(self):
                recorder.append(("finish",))

        return Run()


def test_wandb_backend_contract(tmp_path, monkeypatch):
    fake = _FakeWandb()
    monkeypatch.setitem(sys.modules, "wandb", fake)
    monkeypatch.delenv("WANDB_PROJECT", raising=False)
    config = {"trainer": {"total_steps": 2}}
    with MetricsLogger(tmp_path, ["wandb"], experiment_name="tiny-dapo", config=config) as logger:
        logger.log({"critic/score/mean": np.float64(0.5), "train/num_gen_batches": np.int64(2)}, 1)
        logger.log({"critic/score/mean": 0.75}, 2)
    (_, init), *rest = fake.calls
    run_id = (tmp_path / "wandb_run_id").read_text().strip()
    assert init == {
        "project": "tiny-dapo", "name": "tiny-dapo", "config": config, "dir": str(tmp_path), "id": run_id,
        "resume": "allow",
    }  # fmt: skip
    assert rest == [
        ("log", {"critic/score/mean": 0.5, "train/num_gen_batches": 2}, 1),
        ("log", {"critic/score/mean": 0.75}, 2),
        ("finish",),
    ]
    assert type(rest[0][1]["train/num_gen_batches"]) is int  # plain Python numbers, not numpy

    # A resumed run continues the same W&B run; the project comes from WANDB_PROJECT when set.
    fake.calls.clear()
    monkeypatch.setenv("WANDB_PROJECT", "dapo-sweeps")
    with MetricsLogger(tmp_path, ["wandb"], experiment_name="tiny-dapo", resume_step=1):
        pass
    assert fake.calls[0][1]["id"] == run_id and fake.calls[0][1]["project"] == "dapo-sweeps"

    # A fresh run in the same directory gets a new id.
    fake.calls.clear()
    with MetricsLogger(tmp_path, ["wandb"]):
        pass
    assert fake.calls[0][1]["id"] != run_id


def test_wandb_missing_names_the_fix(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # import now fails as if absent
    with pytest.raises(LoggerBackendUnavailable, match=r"pip install wandb.*trainer\.loggers"):
        MetricsLogger(tmp_path, ["console", "wandb"])


def test_console_defaults_to_stdout(tmp_path, capsys):
    with MetricsLogger(tmp_path, ["console"]) as logger:
        logger.log({"critic/score/mean": 0.5}, 1)
    captured = capsys.readouterr()
    assert "score/mean" in captured.out and captured.err == ""


def test_the_metrics_file_state_changes_with_every_logged_step(tmp_path):
    """What lets the trainer skip a redraw of its curves when nothing was logged since the last one
    (`Trainer.plot`): the state of `metrics.jsonl` moves with every flushed line."""
    from megatron_dapo.trainer.output_dir import metrics_file_state

    assert metrics_file_state(tmp_path) is None
    logger = MetricsLogger(tmp_path, ["jsonl"], experiment_name="x", config={})
    logger.log({"loss": 1.0}, step=1)
    first = metrics_file_state(tmp_path)
    assert first is not None and metrics_file_state(tmp_path) == first
    logger.log({"loss": 0.5}, step=2)
    assert metrics_file_state(tmp_path) != first
    logger.close()
