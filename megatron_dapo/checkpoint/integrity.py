"""Per-file checksums of a checkpoint: written at save, checked before a load. Pure Python + files.

Saving: each rank checksums the files it wrote itself (`files_written_by_rank`: its DCP data files
`dist/__<rank>_<i>.distcp` and its RNG file) right after writing them, while they are still in the
page cache, so no rank reads another rank's data and the cost is one memory pass per byte; rank 0
adds the small shared files (DCP's `.metadata`, Megatron's `common.pt` / `metadata.json`,
`trainer_state.json`, `hf/`). The manifest (`relative path -> bytes and checksum`) goes into the
checkpoint's `metadata.json`, which is written last.

Checking: `structural_problems` needs no data pass (every file of the manifest is there with its
size; every file DCP's index points into exists and is long enough; Megatron's common state is
there; trainer_state.json is a JSON object with the keys the caller needs); `content_problems`
recomputes the checksums of a share of the files (`assign_files` deals them out to the ranks by
size). Each problem is one line that names the file and what is wrong with it.

The checksum is CRC-32C (`google-crc32c`, hardware-accelerated, several GB/s) when that package is
installed, else zlib's CRC-32 (~1 GB/s); the algorithm is recorded with the manifest. Checkpoints
written before manifests existed get the structural checks only.
"""

from __future__ import annotations

import json
import os
import re
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Iterable, Optional, Sequence, Union

from torch.distributed.checkpoint import FileSystemReader

__all__ = [
    "MANIFEST_KEY",
    "assign_files",
    "checksum_algorithm",
    "checksum_files",
    "content_problems",
    "file_checksum",
    "files_written_by_rank",
    "structural_problems",
]

MANIFEST_KEY = "files"
"""metadata.json key of the manifest: {relative path: {"bytes": n, <algorithm>: "8 hex digits"}}."""
ALGORITHM_KEY = "checksum"
"""metadata.json key naming the checksum algorithm of the manifest ("crc32c" or "crc32")."""
_CHUNK = 16 << 20

PathLike = Union[str, os.PathLike]


def _crc32c_module():
    try:
        import google_crc32c
    except ImportError:
        return None
    return google_crc32c


def checksum_algorithm() -> str:
    """The algorithm new checkpoints use: "crc32c" when google-crc32c is installed, else "crc32"."""
    return "crc32c" if _crc32c_module() is not None else "crc32"


def available(algorithm: str) -> bool:
    return algorithm == "crc32" or (algorithm == "crc32c" and _crc32c_module() is not None)


def file_checksum(path: PathLike, algorithm: str) -> str:
    """The checksum of a whole file as 8 hex digits (read in 16 MiB chunks)."""
    if algorithm == "crc32c":
        module = _crc32c_module()
        if module is None:
            raise RuntimeError("crc32c needs the google-crc32c package (pip install google-crc32c)")
        update = module.extend
    elif algorithm == "crc32":
        update = lambda crc, chunk: zlib.crc32(chunk, crc)  # noqa: E731
    else:
        raise ValueError(f"unknown checksum algorithm {algorithm!r}")
    crc = 0
    with open(path, "rb") as handle:
        while chunk := handle.read(_CHUNK):
            crc = update(crc, chunk)
    return f"{crc & 0xFFFFFFFF:08x}"


def checksum_files(directory: PathLike, relpaths: Iterable[str], algorithm: str, threads: int = 1) -> dict[str, dict]:
    """{relpath: {"bytes": size, algorithm: checksum}} of files under `directory`, `threads` at a time.

    Both checksum functions release the GIL on large buffers, so threads overlap reads and CRCs.
    """
    directory = Path(directory)
    relpaths = sorted(set(relpaths))

    def one(rel: str) -> tuple[str, dict]:
        path = directory / rel
        return rel, {"bytes": path.stat().st_size, algorithm: file_checksum(path, algorithm)}

    if threads <= 1 or len(relpaths) <= 1:
        return dict(map(one, relpaths))
    with ThreadPoolExecutor(max_workers=threads) as pool:
        return dict(pool.map(one, relpaths))


def files_written_by_rank(checkpoint_dir: PathLike, rank: int, dist_dir: str, rng_dir: str) -> list[str]:
    """The files global rank `rank` wrote into a checkpoint: its DCP data files and its RNG file.

    DCP names a rank's data files `__<rank>_<n>.distcp` (torch.distributed.checkpoint.FileSystemWriter);
    a file that matches no rank (another naming) is left to rank 0, which checksums everything unclaimed.
    """
    root = Path(checkpoint_dir)
    pattern = re.compile(rf"^__{rank}_\d+\.distcp$")
    mine = [f"{dist_dir}/{p.name}" for p in (root / dist_dir).iterdir() if p.is_file() and pattern.match(p.name)]
    rng = root / rng_dir / f"rank_{rank:05d}.pt"
    if rng.is_file():
        mine.append(f"{rng_dir}/{rng.name}")
    return sorted(mine)


def all_files(checkpoint_dir: PathLike, exclude: Sequence[str] = ()) -> list[str]:
    """Every regular file under `checkpoint_dir` as a relative POSIX path, minus `exclude`."""
    root = Path(checkpoint_dir)
    found = (p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file())
    return sorted(f for f in found if f not in set(exclude))


def assign_files(sizes: dict[str, int], world_size: int) -> list[list[str]]:
    """Deal files out to `world_size` ranks with about equal bytes each (largest first onto the
    least-loaded rank); the same on every rank, since it depends only on the manifest."""
    shares: list[list[str]] = [[] for _ in range(max(1, world_size))]
    loads = [0] * len(shares)
    for name in sorted(sizes, key=lambda n: (-sizes[n], n)):
        target = min(range(len(shares)), key=lambda r: (loads[r], r))
        shares[target].append(name)
        loads[target] += sizes[name]
    return [sorted(s) for s in shares]


def _size_problem(rel: str, actual: int, expected: int) -> str:
    if actual < expected:
        return f"{rel} is truncated: {actual} bytes, {expected} written at save"
    return f"{rel} has {actual} bytes, {expected} written at save"


def structural_problems(
    checkpoint_dir: PathLike,
    metadata: dict,
    *,
    dist_dir: str,
    trainer_state_file: str,
    required_state: Sequence[str] = (),
) -> list[str]:
    """What is missing or cut short in a checkpoint, without reading its data (one stat per file)."""
    root = Path(checkpoint_dir)
    problems: list[str] = []
    manifest = metadata.get(MANIFEST_KEY)
    if isinstance(manifest, dict):
        for rel in sorted(manifest):
            path = root / rel
            if not path.is_file():
                problems.append(f"{rel} is missing")
                continue
            expected = int(manifest[rel].get("bytes", -1))
            actual = path.stat().st_size
            if expected >= 0 and actual != expected:
                problems.append(_size_problem(rel, actual, expected))
    problems += _dcp_problems(root, dist_dir, skip=set(problems))
    if (metadata.get("contents") or {}).get("trainer_state"):
        problems += _trainer_state_problems(root / trainer_state_file, trainer_state_file, required_state)
    return _dedupe(problems)


def _dedupe(problems: list[str]) -> list[str]:
    seen, out = set(), []
    for p in problems:
        if p not in seen:
            seen.add(p)
            out.append(p)
    return out


def _dcp_problems(root: Path, dist_dir: str, skip: set) -> list[str]:
    """The DCP index (`dist/.metadata`) is readable, the files it points into are long enough, and
    Megatron's common state exists (in `common.pt`, or as the `common_state` object of 0.19+)."""
    dist = root / dist_dir
    index = dist / ".metadata"
    problems = []
    if not (dist / "metadata.json").is_file():
        problems.append(f"{dist_dir}/metadata.json (Megatron's format marker) is missing")
    if not index.is_file():
        return problems + [f"{dist_dir}/.metadata (the index of the tensors) is missing"]
    try:
        meta = FileSystemReader(str(dist)).read_metadata()
        storage = dict(meta.storage_data or {})
        keys = set(meta.state_dict_metadata)
    except Exception as err:  # a damaged pickle raises anything
        return problems + [f"{dist_dir}/.metadata cannot be read ({type(err).__name__}: {err})"]
    needed: dict[str, int] = {}
    for info in storage.values():
        rel = getattr(info, "relative_path", None)
        if rel is None:
            continue
        end = int(getattr(info, "offset", 0)) + int(getattr(info, "length", 0))
        needed[rel] = max(needed.get(rel, 0), end)
    for rel, end in sorted(needed.items()):
        path = dist / rel
        name = f"{dist_dir}/{rel}"
        if not path.is_file():
            problem = f"{name} is missing"
        elif path.stat().st_size < end:
            problem = f"{name} is truncated: {path.stat().st_size} bytes, the index needs {end}"
        else:
            continue
        if problem not in skip and not any(s.startswith(f"{name} ") for s in skip):
            problems.append(problem)
    common = f"{dist_dir}/common.pt"
    # 0.19+ stores the common state as the ShardedObject "common_state" (DCP key "common_state/shard_0_1").
    in_dcp = any(k == "common_state" or k.startswith("common_state/") for k in keys)
    if not in_dcp and not (dist / "common.pt").is_file() and not any(s.startswith(f"{common} ") for s in skip):
        problems.append(f"{common} (Megatron's common state: step, scheduler, param groups) is missing")
    return problems


def _trainer_state_problems(path: Path, rel: str, required: Sequence[str]) -> list[str]:
    if not path.is_file():
        return [f"{rel} is missing"]
    try:
        state = json.loads(path.read_bytes().decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        return [f"{rel} is not valid JSON ({err})"]
    if not isinstance(state, dict):
        return [f"{rel} does not hold a JSON object"]
    absent = [k for k in required if k not in state]
    return [f"{rel} lacks {', '.join(absent)}"] if absent else []


def content_problems(checkpoint_dir: PathLike, metadata: dict, relpaths: Iterable[str], threads: int = 1) -> list[str]:
    """Recompute the checksums of `relpaths` (entries of the manifest) and name every file that differs."""
    manifest = metadata.get(MANIFEST_KEY) or {}
    algorithm = metadata.get(ALGORITHM_KEY)
    relpaths = [r for r in relpaths if r in manifest and (Path(checkpoint_dir) / r).is_file()]
    if not relpaths or not available(algorithm or ""):
        return []
    actual = checksum_files(checkpoint_dir, relpaths, algorithm, threads)
    problems = []
    for rel in sorted(actual):
        expected = manifest[rel].get(algorithm)
        if expected is not None and actual[rel][algorithm] != expected:
            problems.append(
                f"{rel} is corrupt: its {algorithm} is {actual[rel][algorithm]}, {expected} was written at save"
            )
    return problems


def verification_note(metadata: dict) -> Optional[str]:
    """Why a checkpoint's contents cannot be checked, if they cannot (else None)."""
    if not isinstance(metadata.get(MANIFEST_KEY), dict):
        return "it has no checksums (written by an older version): only its file sizes were checked"
    algorithm = metadata.get(ALGORITHM_KEY)
    if not available(algorithm or ""):
        return f"its {algorithm} checksums cannot be checked here (pip install google-crc32c): only file sizes were checked"
    return None
