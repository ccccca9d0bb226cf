"""A previous run in `trainer.output_dir`, and resuming past a damaged checkpoint, through `megatron-dapo train`.

* a fresh run (no --resume) into a non-empty output directory is refused (exit 2, one line that
  names --resume and --overwrite), and the old run's files are left as they were;
* --resume past a damaged newest checkpoint (garbage inside a .distcp) continues from the one
  before, names what it skipped and why, and its step equals the uninterrupted run's;
* --overwrite removes the old run's checkpoints, metrics and TensorBoard events first, so the new
  run's step_1 is kept by keep_last and nothing of the old run remains;
* the periodic checkpoints are dp_reshardable, the one after the last step fully_reshardable.
The directory rules themselves (`trainer.output_dir.check_output_dir`) are checked without a run.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
from pathlib import Path

import pytest

from megatron_dapo.trainer.output_dir import OutputDirectoryError, check_output_dir, clear_previous_run
from tests.support.torchrun_utils import two_at_a_time
from tests.support.trainer_runs import CONFIG, FAST, assert_ok, deterministic, read_metrics, run_cli, workspace_overrides


# ------------------------------------------------------------------ the rules, without a run


def test_output_dir_rules(tmp_path):
    out = tmp_path / "run"
    assert check_output_dir(out, resume=False, overwrite=False) == []  # does not exist yet
    out.mkdir()
    assert check_output_dir(out, resume=False, overwrite=False) == []  # empty
    (out / "metrics.jsonl").write_text("{}\n")
    with pytest.raises(OutputDirectoryError, match=r"is not empty \(metrics.jsonl\).*--resume.*--overwrite"):
        check_output_dir(out, resume=False, overwrite=False)
    assert check_output_dir(out, resume=True, overwrite=False) == ["metrics.jsonl"]
    assert check_output_dir(out, resume=False, overwrite=True) == ["metrics.jsonl"]
    with pytest.raises(OutputDirectoryError, match="give one"):
        check_output_dir(out, resume=True, overwrite=True)
    with pytest.raises(OutputDirectoryError, match="is a file"):
        check_output_dir(out / "metrics.jsonl", resume=False, overwrite=False)


@pytest.mark.skipif(os.geteuid() == 0, reason="root may write anywhere")
def test_output_dir_that_cannot_be_created(tmp_path):
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    with pytest.raises(OutputDirectoryError, match="cannot be created"):
        check_output_dir(locked / "run", resume=False, overwrite=False)


def test_clear_previous_run_removes_only_what_a_run_writes(tmp_path):
    for name in ("checkpoints/step_00000005", "tensorboard", "wandb"):
        (tmp_path / name).mkdir(parents=True)
    for name in ("metrics.jsonl", "plot.png", "config.yaml", "wandb_run_id", "notes.txt"):
        (tmp_path / name).write_text("x")
    removed = clear_previous_run(tmp_path)
    assert sorted(removed) == sorted(["checkpoints", "tensorboard", "wandb", "metrics.jsonl", "plot.png", "config.yaml", "wandb_run_id"])
    assert [p.name for p in tmp_path.iterdir()] == ["notes.txt"]


# ------------------------------------------------------------------ through the command line


def _train(workspace: dict, out: Path, *extra: str) -> subprocess.CompletedProcess:
    # One thread: the runs on the previous run start two at a time, and the resumed step is compared
    # exactly with the previous run's.
    return run_cli("train", "--config", str(CONFIG), *FAST, *workspace_overrides(workspace, out), *extra, threads=1)


@pytest.fixture(scope="module")
def previous_run(demo_workspace, tmp_path_factory) -> Path:
    """Three steps with a checkpoint after each (keep_last=3) and TensorBoard events."""
    out = tmp_path_factory.mktemp("previous") / "run"
    assert_ok(_train(demo_workspace, out, "trainer.total_steps=3", "trainer.save_every=1", "trainer.keep_last=3",
                      "trainer.loggers=[console,jsonl,tensorboard]"))  # fmt: skip
    return out


def _listing(path: Path) -> dict[str, int]:
    return {p.relative_to(path).as_posix(): p.stat().st_size for p in sorted(path.rglob("*")) if p.is_file()}


def test_periodic_checkpoints_are_dp_reshardable_and_the_last_one_fully(previous_run):
    formats = {
        p.name: json.loads((p / "metadata.json").read_text())["contents"]["optimizer_sharding"]
        for p in sorted((previous_run / "checkpoints").glob("step_*"))
    }
    assert formats == {"step_00000001": "dp_reshardable", "step_00000002": "dp_reshardable", "step_00000003": "fully_reshardable"}


def _copy_of(previous_run: Path, root: Path, name: str) -> Path:
    run = root / name
    shutil.copytree(previous_run, run)
    return run


@pytest.fixture(scope="module")
def runs_on_the_previous_run(demo_workspace, previous_run, tmp_path_factory) -> dict[str, tuple]:
    """Every run that starts from the previous run, two at a time (a run is mostly start-up on one
    core, so a second one uses the other): name -> (output directory, process, what the test needs).
    Each run but the refused one works on its own copy of the previous run."""
    root = tmp_path_factory.mktemp("on_previous")
    listing_before = _listing(previous_run)

    corrupt = _copy_of(previous_run, root, "corrupt")
    victim = max((corrupt / "checkpoints" / "step_00000003" / "dist").glob("*.distcp"), key=lambda p: p.stat().st_size)
    with open(victim, "r+b") as handle:  # 4 KiB of garbage inside: same size, wrong content
        handle.seek(victim.stat().st_size // 2)
        handle.write(random.Random(0).randbytes(4096))

    overwrite = _copy_of(previous_run, root, "overwrite")
    assert list((overwrite / "tensorboard").iterdir())
    (overwrite / "notes.txt").write_text("mine")

    other_layout = _copy_of(previous_run, root, "other_layout")
    shutil.rmtree(other_layout / "checkpoints" / "step_00000003")  # the final, fully reshardable one

    runs = {
        # The two-process run first: the longest.
        "other_layout": (other_layout, lambda: run_cli("train", "--config", str(CONFIG), *FAST, *workspace_overrides(demo_workspace, other_layout),
                                                       "trainer.total_steps=3", "parallel.tp=2", "--resume", nproc=2)),  # fmt: skip
        "corrupt": (corrupt, lambda: _train(demo_workspace, corrupt, "trainer.total_steps=3", "trainer.save_every=1", "trainer.keep_last=3", "--resume")),
        "overwrite": (overwrite, lambda: _train(demo_workspace, overwrite, "trainer.total_steps=1", "trainer.save_every=1", "trainer.keep_last=1", "--overwrite")),
        "refused": (previous_run, lambda: _train(demo_workspace, previous_run, "trainer.total_steps=1")),
    }
    done = {name: (runs[name][0], proc) for name, proc in two_at_a_time({name: run for name, (_, run) in runs.items()}).items()}
    return {**done, "victim": victim, "listing_before": listing_before}


def test_a_fresh_run_into_a_previous_run_is_refused(runs_on_the_previous_run, previous_run):
    _, proc = runs_on_the_previous_run["refused"]
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    assert "is not empty" in proc.stderr and "--resume" in proc.stderr and "--overwrite" in proc.stderr
    # Nothing of the old run touched (the other runs work on copies).
    assert _listing(previous_run) == runs_on_the_previous_run["listing_before"]


def test_resume_skips_a_corrupt_checkpoint_and_equals_the_uninterrupted_run(runs_on_the_previous_run, previous_run):
    run, proc = runs_on_the_previous_run["corrupt"]
    victim = runs_on_the_previous_run["victim"]
    reference = read_metrics(previous_run)
    assert_ok(proc)
    assert "Traceback" not in proc.stderr
    assert "resumed from" in proc.stdout and "step_00000002 at step 2" in proc.stdout, proc.stdout[-3000:]
    assert f"skipped {run / 'checkpoints' / 'step_00000003'}: dist/{victim.name} is corrupt" in proc.stdout, proc.stdout[-3000:]
    resumed = read_metrics(run)
    assert sorted(resumed) == [1, 2, 3]
    assert deterministic(resumed[3]) == deterministic(reference[3])


def test_overwrite_replaces_the_previous_run(runs_on_the_previous_run):
    run, proc = runs_on_the_previous_run["overwrite"]
    assert_ok(proc)
    assert "--overwrite: removed checkpoints, tensorboard, metrics.jsonl" in proc.stdout, proc.stdout[-3000:]
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["latest", "step_00000001"]
    assert sorted(read_metrics(run)) == [1]
    assert not (run / "tensorboard").exists()  # FAST logs no TensorBoard: the old events are gone, not kept
    assert (run / "notes.txt").read_text() == "mine"  # not a run's file: left alone


def test_resume_at_another_layout_from_a_dp_reshardable_checkpoint_is_a_named_error(runs_on_the_previous_run):
    """The latest intact checkpoint is a periodic (dp_reshardable) one; resuming it at TP=2 stops with
    one message that says what differs and what to do, before the rollout engine starts."""
    _, proc = runs_on_the_previous_run["other_layout"]
    assert proc.returncode != 0
    assert "megatron-dapo: error (rank " in proc.stderr and "dp_reshardable" in proc.stderr, proc.stderr[-3000:]
    assert "tp 1 -> 2" in proc.stderr and "fully reshardable" in proc.stderr
    assert "CheckpointLayoutError" not in proc.stderr  # reported, not raised through
