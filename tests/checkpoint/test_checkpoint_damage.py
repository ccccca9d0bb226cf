"""Resuming from damaged checkpoints, in one process on the tiny Qwen2 (real Megatron, gloo).

One launch (`_train_worker.damaged_checkpoints`) trains steps 1-2, saving a dp_reshardable
checkpoint after each, and step 3 (the reference). Then, for every case, a copy of the checkpoint
root is damaged the way a user or a file system would and resumed with `load_latest_checkpoint`
into fresh models: the newest intact checkpoint must load (the step after it reproduces the
reference loss exactly), and what was passed over must be named with the file and the reason, or,
with nothing intact, a named error. The same fallback under torchrun with DP=2 is in
test_checkpoint_resume.py (`dp_fallback`).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.torchrun_utils import run_torchrun_function

WORKER = Path(__file__).parent / "_train_worker.py"
TOL = 1e-6
CASES = [
    "intact",
    "garbage_in_distcp",
    "truncated_distcp",
    "garbage_latest",
    "bad_trainer_state",
    "missing_common_pt",
    "latest_to_missing_dir",
    "missing_metadata_json",
    "old_format_missing_common_pt",
    "planted_rng_pickle",
    "all_damaged",
]


@pytest.fixture(scope="module")
def outcome(tiny_model_dirs, tmp_path_factory) -> dict:
    base = tmp_path_factory.mktemp("damage")
    result = run_torchrun_function(
        WORKER, "damaged_checkpoints", nproc=1, use_torchrun=False, timeout=420,
        kwargs={"model_dir": str(tiny_model_dirs["qwen2"]), "root": str(base / "checkpoints"), "work": str(base / "cases"),
                "cases": CASES},
    )  # fmt: skip
    result.check()
    return result.rank_results[0]


def _case(outcome: dict, name: str) -> dict:
    entry = outcome["cases"][name]
    if entry["damaged"] == "absent":
        pytest.skip("this megatron-core writes no common.pt")
    assert "error" not in entry, entry["error"]
    return entry


def _resumed_exactly(outcome: dict, entry: dict, step: int) -> None:
    assert entry["step"] == step
    assert abs(entry["next_loss"] - outcome["losses"][str(step + 1)]) <= TOL, (entry, outcome["losses"])


def test_intact_checkpoints_resume_from_the_newest(outcome):
    entry = _case(outcome, "intact")
    _resumed_exactly(outcome, entry, 2)
    assert entry["skipped"] == [] and entry["notes"] == []


@pytest.mark.parametrize(
    "case, reason",
    [
        ("garbage_in_distcp", "is corrupt: its crc32"),  # crc32 or crc32c
        ("truncated_distcp", "is truncated"),
        ("bad_trainer_state", "trainer_state.json"),
        ("missing_common_pt", "dist/common.pt"),
        ("old_format_missing_common_pt", "dist/common.pt"),
    ],
)
def test_a_damaged_newest_checkpoint_falls_back_to_the_one_before(outcome, case, reason):
    entry = _case(outcome, case)
    _resumed_exactly(outcome, entry, 1)
    assert len(entry["skipped"]) == 1 and "step_00000002" in entry["skipped"][0]
    skipped = entry["skipped"][0]
    assert reason in skipped, skipped
    damaged = entry["damaged"].split("/", 1)[1]  # e.g. "dist/__0_1.distcp", named in the reason
    assert damaged in skipped, skipped
    assert any(n.startswith("skipped ") and damaged in n for n in entry["notes"]), entry["notes"]


def test_a_checkpoint_without_checksums_is_still_checked_for_missing_files(outcome):
    entry = _case(outcome, "old_format_missing_common_pt")
    assert "is missing" in entry["skipped"][0]


@pytest.mark.parametrize(
    "case, remark",
    [
        ("garbage_latest", "does not name a checkpoint directory"),
        ("latest_to_missing_dir", "names step_00000009, which does not exist"),
        ("missing_metadata_json", "not a complete checkpoint"),
    ],
)
def test_a_bad_latest_pointer_or_incomplete_directory_is_named(outcome, case, remark):
    entry = _case(outcome, case)
    _resumed_exactly(outcome, entry, 1 if case == "missing_metadata_json" else 2)
    assert entry["skipped"] == []
    assert any(remark in n for n in entry["notes"]), entry["notes"]


def test_nothing_intact_is_a_named_error(outcome):
    entry = outcome["cases"]["all_damaged"]
    assert "NoIntactCheckpointError" in entry["error_types"] and "FileNotFoundError" in entry["error_types"]
    message = entry["error"]
    assert "no intact checkpoint" in message and "step_00000001" in message and "step_00000002" in message
    assert message.count("is truncated") == 2 and "--overwrite" in message


def test_a_damaged_checkpoint_named_directly_is_a_named_error(outcome):
    """No AttributeError from Megatron's missing-common.pt path: the file is named before Megatron runs."""
    missing, corrupt = outcome["direct"]["missing_common"], outcome["direct"]["corrupt"]
    assert corrupt.startswith("CheckpointCorruptError") and "is corrupt" in corrupt and ".distcp" in corrupt
    if missing == "absent":
        pytest.skip("this megatron-core writes no common.pt")
    assert missing.startswith("CheckpointCorruptError") and "dist/common.pt" in missing and "AttributeError" not in missing


def test_a_pickle_planted_in_the_rng_states_is_refused_and_runs_nothing(outcome):
    """Checkpoints usually sit on shared scratch: a pickle written into rng/rank_00000.pt (with the
    checksums edited to match) stops the resume with a named error; its code never runs."""
    entry = outcome["cases"]["planted_rng_pickle"]
    assert entry["error"].startswith("UnsafeCheckpointError: ") and "rng/rank_00000.pt" in entry["error"], entry
    assert "asks to run code while loading" in entry["error"]
    assert "CheckpointCorruptError" not in entry["error_types"]  # no quiet fall-back past it
    assert entry["payload_ran"] is False
