"""The pure parts of checkpoint integrity and resume, in one process without Megatron.

Checksums against zlib / the CRC-32C check value, dealing files out to ranks, the structural
checks on a real DCP checkpoint written by torch.distributed.checkpoint, the `latest` pointer's
diagnostics and the order resume tries checkpoints in, the optimizer-format layout rules.
"""

from __future__ import annotations

import json
import os
import zlib
from pathlib import Path

import pytest

from megatron_dapo.checkpoint import integrity
from megatron_dapo.checkpoint.layout import (
    CHECKPOINT_FORMAT,
    find_latest,
    inspect_latest_pointer,
    read_latest_pointer,
    resume_candidates,
    step_dir_name,
    write_latest_pointer,
)
from megatron_dapo.checkpoint.optimizer_state import bucket_mismatch, layout_change, sharding_metadata


def test_crc32_of_a_file_larger_than_a_read_chunk_matches_zlib(tmp_path):
    data = os.urandom(integrity._CHUNK + 12345)
    path = tmp_path / "blob"
    path.write_bytes(data)
    assert integrity.file_checksum(path, "crc32") == f"{zlib.crc32(data):08x}"


def test_crc32c_check_value(tmp_path):
    pytest.importorskip("google_crc32c")
    path = tmp_path / "check"
    path.write_bytes(b"123456789")
    assert integrity.file_checksum(path, "crc32c") == "e3069283"  # the CRC-32C (Castagnoli) check value
    assert integrity.checksum_algorithm() == "crc32c"


def test_checksum_files_with_threads_equals_one_thread(tmp_path):
    for i in range(5):
        (tmp_path / f"f{i}").write_bytes(os.urandom(1000 * (i + 1)))
    names = [f"f{i}" for i in range(5)]
    one = integrity.checksum_files(tmp_path, names, "crc32", threads=1)
    assert integrity.checksum_files(tmp_path, names, "crc32", threads=3) == one
    assert one["f2"]["bytes"] == 3000


def test_assign_files_balances_bytes_and_is_the_same_everywhere():
    sizes = {"a": 100, "b": 90, "c": 50, "d": 40, "e": 10, "f": 10}
    shares = integrity.assign_files(sizes, 2)
    assert sorted(sum(shares, [])) == sorted(sizes)  # every file exactly once
    loads = [sum(sizes[n] for n in share) for share in shares]
    assert max(loads) - min(loads) <= 10
    assert integrity.assign_files(dict(reversed(list(sizes.items()))), 2) == shares
    assert integrity.assign_files(sizes, 8)[7] == []  # more ranks than files: some check nothing


def test_files_written_by_rank(tmp_path):
    (tmp_path / "dist").mkdir()
    (tmp_path / "rng").mkdir()
    for name in ("__0_0.distcp", "__0_1.distcp", "__1_0.distcp", "__10_0.distcp", ".metadata", "common.pt"):
        (tmp_path / "dist" / name).write_bytes(b"x")
    (tmp_path / "rng" / "rank_00001.pt").write_bytes(b"x")
    assert integrity.files_written_by_rank(tmp_path, 1, "dist", "rng") == ["dist/__1_0.distcp", "rng/rank_00001.pt"]
    assert integrity.files_written_by_rank(tmp_path, 0, "dist", "rng") == ["dist/__0_0.distcp", "dist/__0_1.distcp"]


def _dcp_checkpoint(path: Path, common: bool = True) -> None:
    """A real torch_dist directory: DCP data + index, Megatron's marker and (optionally) common.pt."""
    import warnings

    import torch
    import torch.distributed.checkpoint as dcp

    dist = path / "dist"
    dist.mkdir(parents=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "no process group: saving as a single process"
        dcp.save({"w": torch.arange(4096.0), "b": torch.ones(300)}, storage_writer=dcp.FileSystemWriter(str(dist), thread_count=2))
    (dist / "metadata.json").write_text(json.dumps({"sharded_backend": "torch_dist"}))
    if common:
        torch.save({"step": 1}, dist / "common.pt")


def _manifest(path: Path) -> dict:
    files = integrity.all_files(path, exclude=["metadata.json"])
    return {"checksum": "crc32", "files": integrity.checksum_files(path, files, "crc32"),
            "contents": {"trainer_state": True}}  # fmt: skip


def test_structural_and_content_checks_name_each_damaged_file(tmp_path):
    ckpt = tmp_path / "step_00000001"
    _dcp_checkpoint(ckpt)
    (ckpt / "trainer_state.json").write_text(json.dumps({"step": 1, "sampler": {}}))
    meta = _manifest(ckpt)
    check = lambda: integrity.structural_problems(  # noqa: E731
        ckpt, meta, dist_dir="dist", trainer_state_file="trainer_state.json", required_state=("step", "sampler")
    )
    assert check() == []
    assert integrity.content_problems(ckpt, meta, meta["files"]) == []

    data = sorted((ckpt / "dist").glob("*.distcp"))
    raw = bytearray(data[0].read_bytes())
    raw[len(raw) // 2] ^= 0xFF  # one flipped byte
    data[0].write_bytes(bytes(raw))
    assert check() == []  # same size: only the checksum sees it
    [problem] = integrity.content_problems(ckpt, meta, meta["files"])
    assert problem.startswith(f"dist/{data[0].name} is corrupt: its crc32 is ")

    with open(data[1], "r+b") as handle:
        handle.truncate(10)
    (ckpt / "dist" / "common.pt").unlink()
    problems = check()
    assert f"dist/{data[1].name} is truncated: 10 bytes, " in problems[0] + problems[1]
    assert any(p.startswith("dist/common.pt is missing") for p in problems)
    assert len(problems) == 2, problems  # the index's view of the same two files is not repeated


def test_checks_without_a_manifest_use_the_dcp_index(tmp_path):
    """Checkpoints from before checksums: the files DCP's index points into must exist and be long enough."""
    ckpt = tmp_path / "old"
    _dcp_checkpoint(ckpt, common=False)
    meta = {"contents": {"trainer_state": True}}
    victim = sorted((ckpt / "dist").glob("*.distcp"))[-1]
    with open(victim, "r+b") as handle:
        handle.truncate(3)
    problems = integrity.structural_problems(ckpt, meta, dist_dir="dist", trainer_state_file="trainer_state.json")
    assert any(p.startswith(f"dist/{victim.name} is truncated: 3 bytes, the index needs ") for p in problems), problems
    assert any(p.startswith("dist/common.pt (Megatron's common state") for p in problems)
    assert "trainer_state.json is missing" in problems
    assert integrity.verification_note(meta).startswith("it has no checksums")
    (ckpt / "dist" / ".metadata").write_bytes(b"\x80garbage")
    problems = integrity.structural_problems(ckpt, {}, dist_dir="dist", trainer_state_file="trainer_state.json")
    assert any(p.startswith("dist/.metadata cannot be read") for p in problems), problems


def test_common_state_inside_the_dcp_files_needs_no_common_pt(tmp_path):
    """megatron-core 0.19+ writes the common state as the ShardedObject "common_state" (no common.pt)."""
    import io
    import warnings

    import torch
    import torch.distributed.checkpoint as dcp

    dist = tmp_path / "dist"
    dist.mkdir()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"w": torch.zeros(8), "common_state/shard_0_1": io.BytesIO(b"state")}, storage_writer=dcp.FileSystemWriter(str(dist)))
    (dist / "metadata.json").write_text("{}")
    assert integrity.structural_problems(tmp_path, {}, dist_dir="dist", trainer_state_file="trainer_state.json") == []


@pytest.mark.parametrize(
    "text, problem",
    [
        ("{not json", "trainer_state.json is not valid JSON"),
        ("[1, 2]", "trainer_state.json does not hold a JSON object"),
        ('{"step": 3}', "trainer_state.json lacks sampler"),
    ],
)
def test_trainer_state_problems(tmp_path, text, problem):
    (tmp_path / "trainer_state.json").write_text(text)
    found = integrity._trainer_state_problems(tmp_path / "trainer_state.json", "trainer_state.json", ("step", "sampler"))
    assert found and found[0].startswith(problem)


def _complete(root: Path, step: int) -> Path:
    path = root / step_dir_name(step)
    (path / "dist").mkdir(parents=True)
    (path / "metadata.json").write_text(json.dumps({"format": CHECKPOINT_FORMAT, "step": step}))
    return path


@pytest.mark.parametrize(
    "content, remark",
    [
        (b"\x00\xff\xfe garbage \x13", "does not name a checkpoint directory"),
        (b"../../etc\n", "does not name a checkpoint directory"),
        (b"step_00000009\n", "names step_00000009, which does not exist"),
        (b"step_00000003\n", "names step_00000003, which is not a complete checkpoint"),
    ],
)
def test_a_latest_pointer_that_cannot_be_followed_is_reported(tmp_path, content, remark):
    _complete(tmp_path, 1)
    _complete(tmp_path, 2)
    (tmp_path / "step_00000003").mkdir()  # renamed without metadata.json: damaged
    (tmp_path / "latest").write_bytes(content)
    name, problem = inspect_latest_pointer(tmp_path)
    assert remark in problem
    candidates, remarks = resume_candidates(tmp_path)
    assert [p.name for p in candidates] == ["step_00000002", "step_00000001"]
    assert remarks[0] == problem
    assert find_latest(tmp_path) == tmp_path / "step_00000002"
    assert read_latest_pointer(tmp_path) == (None if b"step" not in content else content.decode().strip())
    incomplete = [r for r in remarks if "step_00000003" in r and "has no metadata.json" in r]
    assert len(incomplete) == 1, remarks  # named once, by the pointer's remark or on its own


def test_resume_tries_the_pointer_target_first_then_newest_first(tmp_path):
    for step in (1, 2, 3):
        _complete(tmp_path, step)
    write_latest_pointer(tmp_path, "step_00000002")
    candidates, remarks = resume_candidates(tmp_path)
    assert [p.name for p in candidates] == ["step_00000002", "step_00000003", "step_00000001"]
    assert remarks == []
    assert resume_candidates(tmp_path / "missing") == ([], [])


def test_dp_reshardable_layout_rules():
    saved = {"tp": 1, "pp": 2, "vpp": None, "cp": 1, "dp": 2, "world_size": 4}
    assert layout_change(saved, {**saved, "dp": 4, "world_size": 8}) is None  # DP may change
    assert layout_change(saved, {**saved, "cp": 2, "world_size": 8}) is None  # so may CP (the DP x CP group)
    assert layout_change(saved, {**saved, "tp": 2, "pp": 1}) == "tp 1 -> 2, pp 2 -> 1"
    assert layout_change(saved, {**saved, "vpp": 2}) == "vpp None -> 2"
    assert layout_change(saved, {**saved, "ep": 1}) is None  # saved before EP was recorded: EP 1
    assert layout_change(saved, {**saved, "ep": 2}) == "ep 1 -> 2"
    buckets = {"0:0": [[["(fp32, fp32)"], [1024, 512]]]}
    assert bucket_mismatch(buckets, buckets) is None
    assert "bucket sizes" in bucket_mismatch(buckets, {"0:0": [[["(fp32, fp32)"], [1536]]]})
    assert "not in the checkpoint" in bucket_mismatch(buckets, {"0:3": []})


def test_sharding_metadata():
    assert sharding_metadata("dp_reshardable")["distrib_optim_sharding_type"] == "dp_reshardable"
    assert sharding_metadata("fully_reshardable")["distrib_optim_fully_reshardable_mem_efficient"] is True
    assert sharding_metadata("fully_sharded_model_space")["distrib_optim_sharding_type"] == "fully_sharded_model_space"
    with pytest.raises(ValueError, match="unknown optimizer checkpoint format"):
        sharding_metadata("fully_sharded_bucket_space")


def test_optimizer_state_of_another_number_of_optimizers_is_refused_by_name():
    """A MoE's optimizer is a chain of two at EP > 1 (dense, experts) and one at EP = 1: the saved
    common state says how many there were (the launch test refuses EP 2 -> 1; here EP 1 -> 2)."""
    import types

    from megatron_dapo.checkpoint.optimizer_state import load_optimizer_state
    from megatron_dapo.checkpoint.torch_dist import CheckpointMismatchError

    single = {"optimizer": {"param_groups": []}, "param_state": {}, "param_state_sharding_type": "fully_reshardable"}
    chain = types.SimpleNamespace(chained_optimizers=[object(), object()])
    with pytest.raises(CheckpointMismatchError, match=r"holds the state of 1 optimizer\(s\), this run has 2"):
        load_optimizer_state(chain, {**single, 0: {"param_state": {}}, 1: {"param_state": {}}})
    with pytest.raises(CheckpointMismatchError, match=r"holds the state of 2 optimizer\(s\), this run has 1.*parallel.ep > 1"):
        load_optimizer_state(types.SimpleNamespace(), {0: single, 1: single, "param_state": {}})
