"""Save and resume training: model chunks, optimizer, LR scheduler, RNG, step and trainer state.

    path = save_checkpoint(root, step, models, optimizer, scheduler,
                           trainer_state={"data_position": 1234}, config=cfg, hf_dir=cfg.model.hf_dir,
                           keep_last=2, optimizer_format="dp_reshardable")   # every rank
    ckpt = load_checkpoint(root, models, optimizer, scheduler)              # every rank
    ckpt = load_latest_checkpoint(root, models, optimizer, scheduler)       # resume: newest intact one
    start_step = ckpt.step + 1

All are collectives: every rank of the job calls them with its own model chunks. The on-disk
layout and the atomic publication are described in `checkpoint/layout.py`, the checksums in
`checkpoint/integrity.py`, the optimizer formats in `checkpoint/optimizer_state.py`.

Writing is spread over the ranks: every rank writes its own files with `write_threads` threads,
tensors replicated over data-parallel ranks (the weights) are shared out among them by Megatron's
fully parallel save, and with `optimizer_format="dp_reshardable"` or `"fully_sharded_model_space"`
each rank writes its own shard of the distributed optimizer's state; each rank then checksums what it wrote. Rank 0 writes the small
shared files and publishes the checkpoint.

What makes a checkpoint loadable at another TP / PP / VPP / DP layout:
- model tensors are Megatron ShardedTensors (global shape + this rank's offsets), so Megatron's
  loader reads whatever slice the new layout needs; the vocabulary padding, which depends on TP,
  is marked `allow_shape_mismatch` by Megatron and padded / trimmed on load; so the weights of
  every checkpoint load at any layout (`load_optimizer=False`), and convert to HF;
- the distributed optimizer's state: at any layout when saved `fully_reshardable` or
  `fully_sharded_model_space` (`ANY_LAYOUT_FORMATS`), at the same TP / PP / VPP when saved
  `dp_reshardable` (a named `CheckpointLayoutError` otherwise); the non-distributed optimizers
  save per-parameter state keyed like the model: any layout;
- the scheduler state and the optimizer's param groups are layout-free (common state);
- RNG states are per rank and only meaningful at the same layout: they are restored when the layout
  is unchanged and otherwise left as `init_distributed` seeded them (reported in the result).
Switching between the distributed and the non-distributed optimizer is refused with a clear
error (their checkpoints hold different tensors).

Before loading, a checkpoint is checked against the manifest in its metadata.json (sizes, then
checksums, the files shared out among the ranks); a damaged one raises `CheckpointCorruptError`
naming the files, and `load_latest_checkpoint` passes over it to the newest intact checkpoint.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import platform
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, Optional, Sequence, Union

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps

from megatron_dapo.checkpoint import integrity
from megatron_dapo.checkpoint.layout import (
    CHECKPOINT_FORMAT,
    DIST_DIR,
    HF_DIR,
    METADATA_FILE,
    RNG_DIR,
    TMP_PREFIX,
    TRAINER_STATE_FILE,
    copy_hf_side_files,
    prune_checkpoints,
    read_metadata,
    remove_stale_temp_dirs,
    resolve_checkpoint_dir,
    resume_candidates,
    step_dir_name,
    fsync_dir,
    write_latest_pointer,
)
from megatron_dapo.checkpoint.model_space import MODEL_SPACE, model_space_sharded_state_dict
from megatron_dapo.checkpoint.optimizer_state import (
    ANY_LAYOUT_FORMATS,
    OPTIMIZER_FORMATS,
    bucket_layout,
    bucket_mismatch,
    layout_change,
    load_optimizer_state,
    materialise_adam_state,
    optimizer_kind,
    sharding_metadata,
)
from megatron_dapo.checkpoint.errors import CheckpointCorruptError, CheckpointError, NoIntactCheckpointError
import megatron_dapo
from megatron_dapo.checkpoint.layout import list_checkpoints
from megatron_dapo.checkpoint.rng import capture_rng_state, read_rng_file, restore_rng_state
from megatron_dapo.checkpoint.torch_dist import (
    CheckpointLayoutError,
    CheckpointMismatchError,
    check_against_checkpoint,
    load_sharded,
    save_sharded,
)
from megatron_dapo.model.builder import unwrap_model

__all__ = [
    "CheckpointCorruptError",
    "CheckpointError",
    "LoadedCheckpoint",
    "NoIntactCheckpointError",
    "OPTIMIZER_FORMATS",
    "current_layout",
    "load_checkpoint",
    "load_latest_checkpoint",
    "make_metadata",
    "model_sharded_state_dict",
    "optimizer_kind",
    "save_checkpoint",
    "verify_checkpoint",
    "versions",
]

FORMAT_VERSION = 2
"""2: per-file checksums (metadata.json "files" / "checksum") and the optimizer format in
contents.optimizer_sharding; version 1 checkpoints (no checksums, fully_reshardable) still load."""

PathLike = Union[str, os.PathLike]


@dataclass
class LoadedCheckpoint:
    """What `load_checkpoint` restored."""

    path: Path
    step: int
    metadata: dict
    trainer_state: dict
    optimizer_loaded: bool
    scheduler_loaded: bool
    rng_restored: bool
    notes: list[str] = field(default_factory=list)
    """Human-readable remarks (e.g. why RNG states were not restored, which checkpoints were skipped)."""
    skipped: list[str] = field(default_factory=list)
    """`load_latest_checkpoint`: the newer checkpoints passed over, each "<path>: <why>"."""


# ---------------------------------------------------------------------------------------------
# Small helpers
# ---------------------------------------------------------------------------------------------


def versions() -> dict[str, str]:
    """Library versions recorded in every checkpoint."""
    try:
        from megatron.core.package_info import __version__ as mcore_version
    except ImportError:  # pragma: no cover - every supported Megatron has package_info
        mcore_version = "unknown"
    return {
        "megatron_dapo": megatron_dapo.__version__,
        "megatron_core": mcore_version,
        "torch": torch.__version__,
        "python": platform.python_version(),
    }


def current_layout(num_chunks: int = 1) -> dict[str, Any]:
    """The parallel layout of this job, from Megatron's parallel state."""
    return {
        "tp": ps.get_tensor_model_parallel_world_size(),
        "pp": ps.get_pipeline_model_parallel_world_size(),
        "vpp": num_chunks if num_chunks > 1 else None,
        "cp": ps.get_context_parallel_world_size(),
        "ep": ps.get_expert_model_parallel_world_size(),
        "dp": ps.get_data_parallel_world_size(),
        "world_size": dist.get_world_size(),
    }


def _unwrap(models: Sequence[torch.nn.Module]) -> list[torch.nn.Module]:
    chunks = [unwrap_model(m) for m in models]
    if not chunks:
        raise ValueError("no model chunks given")
    return chunks


def _model_keys(num_chunks: int) -> list[str]:
    return ["model"] if num_chunks == 1 else [f"model{i}" for i in range(num_chunks)]


def model_sharded_state_dict(models: Sequence[torch.nn.Module]) -> dict[str, Any]:
    """{"model": ...} or {"model0": ..., "model1": ...} (one entry per virtual-pipeline chunk).

    The nesting keys only group the entries; tensors are matched by their global ShardedTensor keys,
    so a checkpoint saved with 2 chunks per rank loads into 1 and vice versa.
    """
    chunks = _unwrap(models)
    return {key: chunk.sharded_state_dict() for key, chunk in zip(_model_keys(len(chunks)), chunks)}


def _json_default(value: Any) -> Any:
    """numpy / torch numbers and arrays become plain numbers and lists; anything else is refused."""
    if hasattr(value, "tolist") and callable(value.tolist):
        return value.tolist()
    if dataclasses.is_dataclass(value):
        return dataclasses.asdict(value)
    if isinstance(value, Path):
        return str(value)
    raise TypeError(f"{type(value).__name__} is not JSON serialisable")


def _config_dict(config: Any) -> Any:
    if config is None:
        return None
    if dataclasses.is_dataclass(config):
        config = dataclasses.asdict(config)
    return json.loads(json.dumps(config, default=str))  # stored as JSON: make sure it is


def _rank() -> int:
    return dist.get_rank()


def _rank0_then_share(fn, what: str) -> Any:
    """Run `fn` on rank 0; every rank returns its (picklable) result or raises its failure."""
    result, error, exc = None, None, None
    if dist.get_rank() == 0:
        try:
            result = fn()
        except Exception as err:  # shared with the other ranks, then re-raised here
            error, exc = f"{type(err).__name__}: {err}", err
    payload = [(result, error)]
    dist.broadcast_object_list(payload, src=0)
    result, error = payload[0]
    if error is not None:
        if exc is not None:
            raise exc
        raise CheckpointError(f"{what} failed on rank 0: {error}")
    return result


def _all_ranks_ok(local_error: Optional[BaseException], what: str) -> None:
    """Agree on success: if any rank failed, every rank raises (the failing one with its own error)."""
    # NCCL reduces CUDA tensors only; gloo (CPU runs) CPU tensors.
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    flag = torch.tensor([0 if local_error is None else 1], dtype=torch.int64, device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    if local_error is not None:
        raise local_error
    if int(flag.item()):
        raise CheckpointError(f"{what} failed on another rank (see its log)")


# ---------------------------------------------------------------------------------------------
# Save
# ---------------------------------------------------------------------------------------------


def _sharded_state(models, optimizer, scheduler, is_loading: bool, optimizer_format: Optional[str]) -> dict[str, Any]:
    """Model (and optimizer in `optimizer_format`, scheduler) sharded state; no optimizer when the format is None."""
    state = model_sharded_state_dict(models)
    if optimizer_format is not None:
        model_state = dict(state)
        materialise_adam_state(optimizer)
        kind = optimizer_kind(optimizer)
        if kind == "local":
            # Per-parameter state keyed like the model, whatever the format: saved and loaded (which
            # asks for the version-1 default, fully_reshardable) without a ChainedOptimizer's
            # "chained_<i>." key prefix, which Megatron adds for the formats it does not count as
            # fully reshardable (a MoE at EP > 1 chains two optimizers).
            optimizer_format = "fully_reshardable"
        if optimizer_format == MODEL_SPACE and kind == "distributed":
            state["optimizer"] = model_space_sharded_state_dict(optimizer, model_state, is_loading=is_loading)
        else:
            state["optimizer"] = optimizer.sharded_state_dict(
                model_state, is_loading=is_loading, metadata=sharding_metadata(optimizer_format)
            )
    if scheduler is not None and not is_loading:
        state["scheduler"] = scheduler.state_dict()  # plain values: Megatron saves them once (common.pt)
    return state


def make_metadata(step: int, contents: dict, layout: dict, model: dict, config: Any = None, **extra: Any) -> dict:
    """The metadata.json of a checkpoint (also written by the HF -> Megatron converter)."""
    return {
        "format": CHECKPOINT_FORMAT,
        "format_version": FORMAT_VERSION,
        "step": int(step),
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "contents": contents,
        "layout": layout,
        "model": model,
        "config": _config_dict(config),
        "versions": versions(),
        **extra,
    }


def _write_checkpoint_metadata(directory: Path, metadata: dict) -> None:
    """Write metadata.json, the file whose presence marks a checkpoint complete (so: written last)."""
    path = directory / METADATA_FILE
    with open(path, "w") as handle:
        json.dump(metadata, handle, indent=2, sort_keys=True)
        handle.flush()
        os.fsync(handle.fileno())


def _publish(root: Path, tmp: Path, final: Path, metadata: dict, trainer_state: Optional[dict],
             hf_dir: Optional[PathLike], keep_last: int, checksummed: Optional[dict], threads: int) -> str:
    """Rank 0: finish the temp directory, rename it into place, move `latest`, prune old ones.

    `checksummed`: the manifest entries the ranks computed for their own files; rank 0 adds every
    other file (the small shared ones) before metadata.json is written, so the manifest is complete.
    """
    if trainer_state is not None:
        (tmp / TRAINER_STATE_FILE).write_text(json.dumps(trainer_state, default=_json_default, indent=1))
    if hf_dir is not None:
        copy_hf_side_files(hf_dir, tmp / HF_DIR)
    if checksummed is not None:
        algorithm = metadata[integrity.ALGORITHM_KEY]
        rest = integrity.all_files(tmp, exclude=[METADATA_FILE, *checksummed])
        metadata[integrity.MANIFEST_KEY] = {**checksummed, **integrity.checksum_files(tmp, rest, algorithm, threads)}
    fsync_dir(tmp)
    _write_checkpoint_metadata(tmp, metadata)
    if final.exists():  # the same step saved again (e.g. a final save right after a periodic one)
        aside = root / f"{TMP_PREFIX}replaced-{final.name}"
        os.replace(final, aside)
        os.replace(tmp, final)
        shutil.rmtree(aside, ignore_errors=True)
    else:
        os.replace(tmp, final)
    fsync_dir(root)
    write_latest_pointer(root, final.name)
    prune_checkpoints(root, keep_last, protect=final)
    return str(final)


def _data_parallel_group() -> Any:
    """The group Megatron shards the distributed optimizer over (DP x CP): the save is spread over it."""
    return ps.get_data_parallel_group(with_context_parallel=True)


def save_checkpoint(
    root: PathLike,
    step: int,
    models: Sequence[torch.nn.Module],
    optimizer: Any = None,
    scheduler: Any = None,
    *,
    trainer_state: Optional[dict] = None,
    config: Any = None,
    hf_dir: Optional[PathLike] = None,
    keep_last: int = 0,
    extra_metadata: Optional[dict] = None,
    optimizer_format: str = "dp_reshardable",
    write_threads: int = 2,
    parallel_save: bool = True,
    checksums: bool = True,
    rank0_files: Optional[Mapping[str, Callable[[Path], None]]] = None,
) -> Path:
    """Write checkpoint `<root>/step_<step>` atomically; collective over all ranks. Returns its path.

    `models`: this rank's model chunks (wrapped or not). `optimizer`: a Megatron optimizer
    (`get_megatron_optimizer`), `scheduler`: an `OptimizerParamScheduler` (both optional).
    `trainer_state`: JSON-serialisable dict saved by rank 0 (dataloader position, metrics).
    `config`: the run's config (dataclass or dict), recorded in metadata.json. `hf_dir`: the HF
    model directory whose config / tokenizer files are copied in, which lets
    `convert_megatron_to_hf` export this checkpoint. `keep_last` > 0 prunes older checkpoints.
    `optimizer_format`: "dp_reshardable" (every rank writes its shard; resumes at the same TP / PP /
    VPP), "fully_reshardable" (gathered to DP rank 0; resumes at any layout) or
    "fully_sharded_model_space" (every rank writes its part in model space; resumes at any layout),
    see `optimizer_state`. `write_threads`: writer threads (files) per rank. `parallel_save`: share the
    writing of DP-replicated tensors out among the DP ranks (else DP rank 0 writes them).
    `checksums`: record per-file checksums in metadata.json (checked before every load).
    `rank0_files`: files rank 0 writes into the checkpoint besides (name relative to it -> a function
    writing that path), e.g. the asynchronous trainer's samples still in flight; checksummed and
    published atomically with the rest.
    """
    if trainer_state is not None:
        json.dumps(trainer_state, default=_json_default)  # fail before any collective if it cannot be saved
    if optimizer_format not in OPTIMIZER_FORMATS:
        raise ValueError(f"optimizer_format={optimizer_format!r} is not one of {', '.join(OPTIMIZER_FORMATS)}")
    root = Path(root)
    name = step_dir_name(step)
    tmp, final = root / f"{TMP_PREFIX}{name}", root / name
    chunks = _unwrap(models)
    with_optimizer = optimizer is not None
    kind = optimizer_kind(optimizer) if with_optimizer else None
    sharding = optimizer_format if kind == "distributed" else None

    def prepare() -> None:
        root.mkdir(parents=True, exist_ok=True)
        remove_stale_temp_dirs(root)  # crashed saves; nothing else writes .tmp-* under our root
        (tmp / DIST_DIR).mkdir(parents=True)
        (tmp / RNG_DIR).mkdir()

    _rank0_then_share(prepare, "preparing the checkpoint directory")

    state = _sharded_state(chunks, optimizer, scheduler, is_loading=False, optimizer_format=optimizer_format if with_optimizer else None)
    # Collective: every rank writes its share of the tensors.
    save_sharded(state, tmp / DIST_DIR, threads=write_threads, parallel_group=_data_parallel_group() if parallel_save else None)
    error = None
    try:
        torch.save(capture_rng_state(), tmp / RNG_DIR / f"rank_{_rank():05d}.pt")
    except Exception as err:
        error = err
    _all_ranks_ok(error, "saving RNG states")
    error = None
    if rank0_files and _rank() == 0:
        try:
            for relative, write in rank0_files.items():
                write(tmp / relative)
        except Exception as err:
            error = err
    _all_ranks_ok(error, "writing the trainer's files")

    algorithm = integrity.checksum_algorithm() if checksums else None
    checksummed = None
    if checksums:  # each rank reads back its own files, from the page cache
        mine, error = {}, None
        try:
            own = integrity.files_written_by_rank(tmp, _rank(), DIST_DIR, RNG_DIR)
            mine = integrity.checksum_files(tmp, own, algorithm, write_threads)
        except Exception as err:
            error = err
        _all_ranks_ok(error, "checksumming the checkpoint files")
        gathered: list = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, mine)
        checksummed = {k: v for part in gathered for k, v in part.items()}
    buckets = _gather_bucket_layouts(optimizer) if sharding == "dp_reshardable" else None

    hf_config = None
    if hf_dir is not None and (Path(hf_dir) / "config.json").is_file():
        hf_config = json.loads((Path(hf_dir) / "config.json").read_text())
    extra = dict(extra_metadata or {})
    if checksums:
        extra[integrity.ALGORITHM_KEY] = algorithm
    metadata = make_metadata(
        step,
        contents={
            "model": True,
            "optimizer": kind,
            "optimizer_sharding": sharding,
            "optimizer_buckets": buckets,
            "scheduler": scheduler is not None,
            "rng": True,
            "trainer_state": trainer_state is not None,
            "hf_files": hf_dir is not None,
        },
        layout=current_layout(len(chunks)),
        model={
            "num_chunks": len(chunks),
            "dtype": str(next(chunks[0].parameters()).dtype).replace("torch.", ""),
            "hf_config": hf_config,
        },
        config=config,
        **extra,
    )
    path = _rank0_then_share(
        lambda: _publish(root, tmp, final, metadata, trainer_state, hf_dir, keep_last, checksummed, write_threads),
        "publishing the checkpoint",
    )
    dist.barrier()
    return Path(path)


def _gather_bucket_layouts(optimizer: Any) -> dict:
    """Every model-parallel rank's gradient-bucket sizes (the layout of dp_reshardable state)."""
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, bucket_layout(optimizer))
    merged: dict = {}
    for part in gathered:
        merged.update(part)  # DP replicas of one model-parallel rank have the same buckets
    return merged


# ---------------------------------------------------------------------------------------------
# Verify
# ---------------------------------------------------------------------------------------------


@dataclass
class Verification:
    """What `verify_checkpoint` found: `problems` (the checkpoint must not be loaded) and `notes`."""

    problems: list[str]
    notes: list[str]


def verify_checkpoint(
    directory: PathLike, metadata: Optional[dict] = None, *, contents: bool = True, required_state: Sequence[str] = (),
    threads: int = 2,
) -> Verification:
    """Check a checkpoint before loading it; collective, the same answer on every rank.

    Rank 0 checks that every file is there with its size (manifest, DCP index, Megatron's common
    state, trainer_state.json with `required_state` keys); then, with `contents`, the files are
    shared out among the ranks by size and each recomputes the checksums of its share.
    """
    directory = Path(directory)
    metadata = read_metadata(directory) if metadata is None else metadata
    problems = _rank0_then_share(
        lambda: integrity.structural_problems(
            directory, metadata, dist_dir=DIST_DIR, trainer_state_file=TRAINER_STATE_FILE, required_state=required_state
        ),
        f"checking {directory}",
    )
    notes = []
    note = integrity.verification_note(metadata)
    if note:
        notes.append(f"{directory.name}: {note}")
    if problems or not contents or note:
        return Verification(problems, notes)
    manifest = metadata[integrity.MANIFEST_KEY]
    share = integrity.assign_files({k: int(v.get("bytes", 0)) for k, v in manifest.items()}, dist.get_world_size())
    mine, error = [], None
    try:
        mine = integrity.content_problems(directory, metadata, share[_rank()], threads)
    except Exception as err:  # an unreadable file is a problem of the checkpoint, not of this rank
        mine = [f"reading {directory} failed on rank {_rank()}: {type(err).__name__}: {err}"]
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    return Verification(sorted(p for part in gathered for p in part), notes)


def _damage_report(directory: Path, problems: Sequence[str]) -> str:
    shown = list(problems[:6]) + ([f"... ({len(problems) - 6} more)"] if len(problems) > 6 else [])
    return f"{directory}: " + "; ".join(shown)


# ---------------------------------------------------------------------------------------------
# Load
# ---------------------------------------------------------------------------------------------


def _same_layout(saved: dict, now: dict) -> bool:
    keys = ("tp", "pp", "vpp", "cp", "dp", "world_size")
    # Expert parallelism shards the experts' optimizer state over other groups; a checkpoint
    # without the entry was saved before EP existed, at EP=1.
    return all(saved.get(k) == now.get(k) for k in keys) and saved.get("ep", 1) == now.get("ep", 1)


def _describe_layout(layout: dict) -> str:
    described = ", ".join(f"{k}={layout.get(k)}" for k in ("tp", "pp", "vpp", "dp", "world_size"))
    return described if layout.get("ep", 1) == 1 else f"{described}, ep={layout['ep']}"


def _check_optimizer_fits(directory: Path, metadata: dict, optimizer: Any, num_chunks: int) -> str:
    """The optimizer format to load with; raises CheckpointMismatchError / CheckpointLayoutError
    (collectively) when the checkpoint's optimizer state cannot be loaded into `optimizer` here."""
    contents = metadata.get("contents", {})
    saved_kind = contents.get("optimizer")
    if not saved_kind:
        raise CheckpointMismatchError(
            f"{directory} holds no optimizer state (saved without one, e.g. converted from HF): "
            "load it with load_optimizer=False"
        )
    kind = optimizer_kind(optimizer)
    if saved_kind != kind:
        raise CheckpointMismatchError(
            f"{directory} holds the state of a {saved_kind} optimizer but this run uses a {kind} one "
            f"(parallel.use_distributed_optimizer={kind == 'distributed'}): resume with "
            f"parallel.use_distributed_optimizer={saved_kind == 'distributed'}, or load the weights only "
            "(load_optimizer=False)"
        )
    # Version 1 checkpoints did not record a format for local optimizers and used fully_reshardable.
    sharding = contents.get("optimizer_sharding") or "fully_reshardable"
    if sharding not in OPTIMIZER_FORMATS:
        raise CheckpointMismatchError(
            f"{directory} holds distributed-optimizer state in the {sharding!r} format; this version reads "
            f"{' and '.join(OPTIMIZER_FORMATS)}: load the weights only (load_optimizer=False)"
        )
    if kind != "distributed" or sharding != "dp_reshardable":
        return sharding
    saved_layout, now = metadata.get("layout", {}), current_layout(num_chunks)
    change = layout_change(saved_layout, now)
    if change is None:
        mismatch = bucket_mismatch(contents.get("optimizer_buckets") or {}, bucket_layout(optimizer))
        change = _first_on_any_rank(mismatch)
    if change is not None:
        raise CheckpointLayoutError(
            f"{directory} holds optimizer state in the dp_reshardable format (trainer.checkpoint_format), which "
            f"loads only at the layout it was saved at ({_describe_layout(saved_layout)}; DP may change) and with the "
            f"same gradient buckets; this run differs: {change}. Resume at the saved layout (parallel.tp, parallel.pp, "
            "parallel.vpp as saved), or from a fully reshardable checkpoint (the one after the last step with "
            "trainer.final_checkpoint_reshardable=true, or any with trainer.checkpoint_format=fully_reshardable "
            "or fully_sharded_model_space)"
            + _reshardable_hint(directory.parent)
            + ", or load the weights only (model.megatron_checkpoint) with a fresh optimizer"
        )
    return sharding


def _first_on_any_rank(message: Optional[str]) -> Optional[str]:
    """The first non-None message of any rank (so that every rank raises together)."""
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, message)
    return next((m for m in gathered if m is not None), None)


def _reshardable_hint(root: Path) -> str:
    found = []
    for step, path in list_checkpoints(root):
        try:
            if read_metadata(path).get("contents", {}).get("optimizer_sharding") in ANY_LAYOUT_FORMATS:
                found.append(path.name)
        except (FileNotFoundError, ValueError):
            continue
    return f" (here: {', '.join(found)})" if found else ""


def load_checkpoint(
    path: PathLike,
    models: Sequence[torch.nn.Module],
    optimizer: Any = None,
    scheduler: Any = None,
    *,
    load_optimizer: bool = True,
    load_scheduler: Optional[bool] = None,
    load_rng: bool = True,
    verify: bool = True,
    required_state: Sequence[str] = (),
) -> LoadedCheckpoint:
    """Load a checkpoint into this rank's `models` (and optimizer / scheduler); collective.

    `path`: a checkpoint directory or a root of step directories (its `latest` one is loaded;
    incomplete saves are ignored). Weights load at any TP / PP / VPP / DP, optimizer state as its
    format allows (module doc). With `load_optimizer=False` only the weights are loaded and the
    optimizer's main parameters are re-copied from them. `load_scheduler` defaults to
    `load_optimizer`. `verify`: recompute the checksums first (the file and size checks always run).
    `required_state`: keys trainer_state.json must hold.

    Raises FileNotFoundError (nothing complete to load), CheckpointCorruptError (files missing, cut
    short or not matching their checksums: the message names them), CheckpointMismatchError (the
    checkpoint does not fit these models or this optimizer: the message lists what differs),
    CheckpointLayoutError (dp_reshardable optimizer state asked for at another layout).
    """
    directory = resolve_checkpoint_dir(path)  # fails fast, before Megatron is even imported
    metadata = read_metadata(directory)

    contents = metadata.get("contents", {})
    chunks = _unwrap(models)
    notes: list[str] = []

    checked = verify_checkpoint(directory, metadata, contents=verify, required_state=required_state)
    if checked.problems:
        raise CheckpointCorruptError(f"checkpoint {_damage_report(directory, checked.problems)}")
    notes += checked.notes

    with_optimizer = optimizer is not None and load_optimizer
    sharding = _check_optimizer_fits(directory, metadata, optimizer, len(chunks)) if with_optimizer else None
    state = _sharded_state(chunks, optimizer, None, is_loading=True, optimizer_format=sharding)
    replaced = check_against_checkpoint(state, directory / DIST_DIR)
    if replaced:
        notes.append(f"{len(replaced)} _extra_state object(s) absent from the checkpoint were left empty")
    loaded = load_sharded(state, directory / DIST_DIR)

    for key, chunk in zip(_model_keys(len(chunks)), chunks):
        chunk.load_state_dict(loaded[key], strict=True)
    if with_optimizer:
        load_optimizer_state(optimizer, loaded["optimizer"])
    elif optimizer is not None:
        optimizer.reload_model_params()  # its fp32 main copies were taken from the weights before loading

    scheduler_loaded = False
    if scheduler is not None and (load_optimizer if load_scheduler is None else load_scheduler):
        if "scheduler" in loaded:
            scheduler.load_state_dict(loaded["scheduler"])
            scheduler_loaded = True
        else:
            notes.append("the checkpoint has no LR scheduler state: the scheduler starts fresh")

    rng_restored = False
    if load_rng:
        now = current_layout(len(chunks))
        saved = metadata.get("layout", {})
        rng_file = directory / RNG_DIR / f"rank_{_rank():05d}.pt"
        if not contents.get("rng"):
            notes.append("the checkpoint has no RNG states")
        elif not _same_layout(saved, now):
            notes.append(
                f"RNG states not restored: saved at {_describe_layout(saved)}, loading at {_describe_layout(now)} "
                "(per-rank streams do not map across layouts; the run's seed applies)"
            )
        elif not rng_file.is_file():
            raise CheckpointCorruptError(f"{rng_file} is missing: the checkpoint is damaged")
        else:
            restore_rng_state(read_rng_file(rng_file))  # weights_only: a planted pickle runs nothing
            rng_restored = True

    trainer_state = {}
    state_file = directory / TRAINER_STATE_FILE
    if state_file.is_file():
        trainer_state = json.loads(state_file.read_text())
    return LoadedCheckpoint(
        path=directory,
        step=int(metadata["step"]),
        metadata=metadata,
        trainer_state=trainer_state,
        optimizer_loaded=with_optimizer,
        scheduler_loaded=scheduler_loaded,
        rng_restored=rng_restored,
        notes=notes,
    )


def _try_read_metadata(path: Path) -> tuple[Optional[dict], Optional[str]]:
    try:
        return read_metadata(path), None
    except (FileNotFoundError, ValueError) as err:
        return None, str(err)


def load_latest_checkpoint(
    root: PathLike,
    models: Sequence[torch.nn.Module],
    optimizer: Any = None,
    scheduler: Any = None,
    *,
    required_state: Sequence[str] = (),
) -> Optional[LoadedCheckpoint]:
    """Resume: load the newest intact checkpoint under `root`; collective. None when there is none at all.

    Candidates are tried in `layout.resume_candidates` order (the target of `latest`, then newest
    first); a damaged one (see `verify_checkpoint`) is passed over, and why goes into the result's
    `skipped` and `notes`, as do a `latest` that cannot be followed and step directories that are
    not complete. Raises NoIntactCheckpointError, listing every checkpoint and what is wrong with
    it, when checkpoints exist but none is intact. Errors that are not damage (the checkpoint does
    not fit this model, optimizer or layout) are raised, not passed over: an older checkpoint would
    silently lose the progress since.
    """
    root = Path(root)
    candidates, remarks = _rank0_then_share(lambda: resume_candidates(root), f"listing checkpoints in {root}")
    skipped: list[str] = []
    for path in candidates:
        metadata, unreadable = _rank0_then_share(lambda: _try_read_metadata(path), f"reading {path / METADATA_FILE}")
        if unreadable is not None:  # vanished or damaged since it was listed
            skipped.append(f"{path}: {unreadable}")
            continue
        checked = verify_checkpoint(path, metadata, required_state=required_state)
        if checked.problems:
            skipped.append(_damage_report(path, checked.problems))
            continue
        loaded = load_checkpoint(path, models, optimizer, scheduler, verify=False, required_state=required_state)
        loaded.skipped = skipped
        loaded.notes = remarks + [f"skipped {s}" for s in skipped] + checked.notes + loaded.notes
        return loaded
    if not candidates and not remarks:
        return None
    raise NoIntactCheckpointError(
        f"no intact checkpoint to resume from in {root}:\n  "
        + "\n  ".join(remarks + skipped)
        + "\nRemove the damaged directories (or restore them from a copy), or start afresh with --overwrite"
    )
