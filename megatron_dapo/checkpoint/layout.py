"""Where checkpoints live on disk, which of them are complete, and the atomic file operations.

Pure Python (no torch): `find_latest` and friends work in any process, before any model exists.

    <root>/
      latest                      one line: the directory name of the newest complete checkpoint
      step_00000040/              a complete checkpoint (see below)
      step_00000050/
      .tmp-step_00000060/         a save in progress, or one that crashed: never read

    step_00000050/
      metadata.json               written LAST: its presence marks the checkpoint complete; holds the
                                  step, layout, optimizer format and every other file's size and
                                  checksum ("files", see integrity.py)
      dist/                       Megatron distributed checkpoint (torch_dist): model, optimizer,
                                  scheduler (dist/metadata.json is Megatron's own format marker)
      rng/rank_00000.pt           per-rank RNG states (python, numpy, torch, CUDA, Megatron tracker)
      trainer_state.json          free-form trainer state (dataloader position, metrics history)
      hf/                         optional: the HF config.json, tokenizer and generation config files

A save writes everything into `.tmp-<name>`, then renames it to `<name>` and replaces `latest`
(write a temporary file, then `os.replace`), so a crash at any point leaves the previous checkpoint
and `latest` as they were. The pointer is the source of truth; scanning the step directories is
the fallback when it is missing, unreadable or names a directory that is gone or incomplete
(`resume_candidates` says which, for the message; `core.load_latest_checkpoint` also passes over
checkpoints whose files fail their checks).
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path
from typing import Optional, Union

__all__ = [
    "CHECKPOINT_FORMAT",
    "DIST_DIR",
    "HF_DIR",
    "LATEST_FILE",
    "METADATA_FILE",
    "RNG_DIR",
    "TMP_PREFIX",
    "TRAINER_STATE_FILE",
    "atomic_write_text",
    "copy_hf_side_files",
    "find_latest",
    "fsync_dir",
    "inspect_latest_pointer",
    "is_complete_checkpoint",
    "list_checkpoints",
    "parse_step_dir",
    "prune_checkpoints",
    "read_latest_pointer",
    "read_metadata",
    "remove_stale_temp_dirs",
    "resolve_checkpoint_dir",
    "resume_candidates",
    "step_dir_name",
    "write_latest_pointer",
]

CHECKPOINT_FORMAT = "megatron-dapo-checkpoint"
METADATA_FILE = "metadata.json"
DIST_DIR = "dist"
RNG_DIR = "rng"
HF_DIR = "hf"
TRAINER_STATE_FILE = "trainer_state.json"
LATEST_FILE = "latest"
TMP_PREFIX = ".tmp-"
_STEP_RE = re.compile(r"^step_(\d+)$")

PathLike = Union[str, os.PathLike]


def step_dir_name(step: int) -> str:
    """`step_00000050`: zero-padded so that names sort like steps."""
    if step < 0:
        raise ValueError(f"checkpoint step must be >= 0, got {step}")
    return f"step_{step:08d}"


def parse_step_dir(name: str) -> Optional[int]:
    """The step of a complete-checkpoint directory name, None for anything else (temp dirs included)."""
    match = _STEP_RE.match(name)
    return int(match.group(1)) if match else None


def read_metadata(checkpoint_dir: PathLike) -> dict:
    """The checkpoint's metadata.json; raises FileNotFoundError / ValueError when absent or not ours."""
    path = Path(checkpoint_dir) / METADATA_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{checkpoint_dir} is not a complete checkpoint: it has no {METADATA_FILE}")
    try:
        meta = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise ValueError(f"{path} is not valid JSON ({err}): the checkpoint is damaged") from None
    if not isinstance(meta, dict) or meta.get("format") != CHECKPOINT_FORMAT:
        raise ValueError(f"{path} is not a megatron-dapo checkpoint (format {meta.get('format') if isinstance(meta, dict) else None!r})")
    return meta


def is_complete_checkpoint(path: PathLike) -> bool:
    """True for a directory holding a readable metadata.json of our format and a dist/ directory."""
    path = Path(path)
    try:
        read_metadata(path)
    except (FileNotFoundError, ValueError):
        return False
    return (path / DIST_DIR).is_dir()


def list_checkpoints(root: PathLike) -> list[tuple[int, Path]]:
    """(step, path) of every complete checkpoint under `root`, oldest first. Temp dirs are ignored."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = []
    for child in root.iterdir():
        step = parse_step_dir(child.name)
        if step is not None and child.is_dir() and is_complete_checkpoint(child):
            found.append((step, child))
    return sorted(found)


def read_latest_pointer(root: PathLike) -> Optional[str]:
    """The step directory name in `<root>/latest`; None when there is no pointer file or it holds
    anything but a step directory name (`inspect_latest_pointer` says what)."""
    name, _ = inspect_latest_pointer(root)
    return name


def inspect_latest_pointer(root: PathLike) -> tuple[Optional[str], Optional[str]]:
    """(name, problem) of `<root>/latest`: the step directory it names, or None, and why it cannot be
    followed (None when it can, or when there is no pointer at all)."""
    path = Path(root) / LATEST_FILE
    if not path.is_file():
        return None, None
    raw = path.read_bytes()[:200]
    text = raw.decode("utf-8", errors="replace").strip()
    if parse_step_dir(text) is None:
        return None, f"{path} does not name a checkpoint directory (it holds {raw[:40]!r}): ignored"
    target = Path(root) / text
    if not target.is_dir():
        return text, f"{path} names {text}, which does not exist: ignored"
    if not is_complete_checkpoint(target):
        return text, f"{path} names {text}, which is not a complete checkpoint ({_why_incomplete(target)}): ignored"
    return text, None


def _why_incomplete(path: Path) -> str:
    try:
        read_metadata(path)
    except (FileNotFoundError, ValueError) as err:
        return str(err)
    return f"it has no {DIST_DIR}/ directory"


def find_latest(root: PathLike) -> Optional[Path]:
    """The newest complete checkpoint under `root`, or None.

    The `latest` pointer wins when it names a complete checkpoint; otherwise (no pointer, or it
    names a pruned / damaged directory) the complete step directory with the highest step.
    Incomplete `.tmp-*` directories are never returned.
    """
    candidates, _ = resume_candidates(root)
    return candidates[0] if candidates else None


def resume_candidates(root: PathLike) -> tuple[list[Path], list[str]]:
    """The complete checkpoints under `root` in the order to try them, and remarks on what was passed over.

    Order: the target of `latest` when it is complete, then the other complete step directories,
    newest first. Remarks name a `latest` that cannot be followed (garbage, a missing or incomplete
    directory) and every `step_*` directory that is not a complete checkpoint (its metadata.json is
    missing or damaged). Temp directories of saves in progress or crashed are passed over silently.
    """
    root = Path(root)
    if not root.is_dir():
        return [], []
    name, problem = inspect_latest_pointer(root)
    remarks = [problem] if problem else []
    complete = list_checkpoints(root)
    ordered = [path for _, path in reversed(complete)]
    if name is not None and problem is None:
        ordered.remove(root / name)
        ordered.insert(0, root / name)
    listed = {path.name for path in ordered}
    for child in sorted(root.iterdir(), reverse=True):
        if parse_step_dir(child.name) is not None and child.is_dir() and child.name not in listed:
            if child.name != name:  # already named in the pointer's remark
                remarks.append(f"{child} is not a complete checkpoint ({_why_incomplete(child)}): skipped")
    return ordered, remarks


def resolve_checkpoint_dir(path: PathLike) -> Path:
    """A checkpoint directory from either a checkpoint directory or a root holding step directories.

    Raises FileNotFoundError with what was found when there is nothing complete to load.
    """
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"checkpoint path {path} does not exist")
    if not path.is_dir():
        raise FileNotFoundError(f"checkpoint path {path} is not a directory")
    if (path / METADATA_FILE).is_file():
        read_metadata(path)  # raises if damaged / foreign
        if not (path / DIST_DIR).is_dir():
            raise FileNotFoundError(f"checkpoint {path} has no {DIST_DIR}/ directory: it is damaged")
        return path
    latest = find_latest(path)
    if latest is None:
        temps = sorted(c.name for c in path.iterdir() if c.name.startswith(TMP_PREFIX))
        hint = f" (incomplete saves, ignored: {', '.join(temps)})" if temps else ""
        raise FileNotFoundError(f"no complete checkpoint in {path}{hint}")
    return latest


# ---------------------------------------------------------------------------------------------
# Atomic writes and housekeeping (called on one rank)
# ---------------------------------------------------------------------------------------------


def fsync_dir(directory: Path) -> None:
    """Make a rename in `directory` durable (no-op where directories cannot be opened)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def atomic_write_text(path: PathLike, text: str) -> None:
    """Write `text` to `path` so that readers see the old or the new content, never a mix."""
    path = Path(path)
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
    with open(tmp, "w") as handle:
        handle.write(text)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


def write_latest_pointer(root: PathLike, name: str) -> None:
    """Point `<root>/latest` at checkpoint directory `name` atomically."""
    atomic_write_text(Path(root) / LATEST_FILE, name + "\n")


def remove_stale_temp_dirs(root: PathLike) -> list[Path]:
    """Delete `.tmp-*` directories left by crashed saves (call before starting a new save)."""
    root = Path(root)
    removed = []
    if root.is_dir():
        for child in root.iterdir():
            if child.name.startswith(TMP_PREFIX) and child.is_dir():
                shutil.rmtree(child, ignore_errors=True)
                removed.append(child)
    return removed


def prune_checkpoints(root: PathLike, keep_last: int, protect: Optional[PathLike] = None) -> list[Path]:
    """Delete all but the newest `keep_last` complete checkpoints (never `protect` nor `latest`'s target).

    `keep_last` <= 0 keeps everything. Returns the deleted directories.
    """
    if keep_last <= 0:
        return []
    root = Path(root)
    keep = {Path(protect).resolve()} if protect is not None else set()
    pointer = read_latest_pointer(root)
    if pointer:
        keep.add((root / pointer).resolve())
    found = list_checkpoints(root)
    removed = []
    for _, path in found[: max(0, len(found) - keep_last)]:
        if path.resolve() in keep:
            continue
        # Rename first so that a crash half-way through rmtree never leaves a damaged step_* dir.
        doomed = path.with_name(f"{TMP_PREFIX}deleting-{path.name}")
        os.replace(path, doomed)
        shutil.rmtree(doomed, ignore_errors=True)
        removed.append(path)
    return removed


# Weight files and their indexes are what conversion rewrites; everything else at the top of an HF
# model directory (config.json, generation_config.json, tokenizer files, chat template, README,
# license) is carried over byte for byte.
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack", ".gguf")
_WEIGHT_INDEXES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")


def copy_hf_side_files(hf_dir: PathLike, dest: PathLike) -> list[str]:
    """Copy the non-weight files at the top of an HF model directory into `dest`; returns their names."""
    hf_dir, dest = Path(hf_dir), Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    copied = []
    for child in sorted(hf_dir.iterdir()):
        if not child.is_file() or child.name in _WEIGHT_INDEXES or child.name.endswith(_WEIGHT_SUFFIXES):
            continue
        shutil.copy2(child, dest / child.name)
        copied.append(child.name)
    return copied
