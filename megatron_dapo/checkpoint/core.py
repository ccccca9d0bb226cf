"""Save and resume training: model chunks, optimizer, LR scheduler, RNG, step and trainer state.

    path = save_checkpoint(root, step, models, optimizer, scheduler,
                           trainer_state={"data_position": 1234}, config=cfg, hf_dir=cfg.model.hf_dir,
                           keep_last=2)                                  # every rank
    ckpt = load_checkpoint(root, models, optimizer, scheduler)          # every rank, any layout
    start_step = ckpt.step + 1

Both are collectives: every rank of the job calls them with its own model chunks. The on-disk
layout and the atomic publication are described in `checkpoint/layout.py`.

What makes a checkpoint loadable at another TP / PP / VPP / DP layout:
- model tensors are Megatron ShardedTensors (global shape + this rank's offsets), so Megatron's
  loader reads whatever slice the new layout needs; the vocabulary padding, which depends on TP,
  is marked `allow_shape_mismatch` by Megatron and padded / trimmed on load;
- the distributed optimizer is saved in Megatron's `fully_reshardable` format (optimizer state
  laid out like the model parameters; the `fully_sharded_model_space` default of 0.16 relies on
  `flattened_range`, which 0.16's ShardedTensor refuses), in its memory-efficient variant (the
  DP shards are gathered over gloo into CPU memory of DP rank 0 only, which writes them); the
  non-distributed optimizers save per-parameter state keyed like the model: both reshard over
  TP, PP and DP;
- the scheduler state and the optimizer's param groups are layout-free (common state);
- RNG states are per rank and only meaningful at the same layout: they are restored when the layout
  is unchanged and otherwise left as `init_distributed` seeded them (reported in the result).
Switching between the distributed and the non-distributed optimizer is refused with a clear
error (their checkpoints hold different tensors).
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
from typing import Any, Optional, Sequence, Union

import torch

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
    step_dir_name,
    fsync_dir,
    write_latest_pointer,
)

__all__ = [
    "CheckpointError",
    "LoadedCheckpoint",
    "OPTIMIZER_SHARDING",
    "current_layout",
    "load_checkpoint",
    "make_metadata",
    "model_sharded_state_dict",
    "optimizer_kind",
    "save_checkpoint",
    "versions",
]

FORMAT_VERSION = 1
OPTIMIZER_SHARDING = {
    "distrib_optim_sharding_type": "fully_reshardable",
    "distrib_optim_fully_reshardable_mem_efficient": True,
    "chained_optim_avoid_prefix": True,
}
"""Metadata given to `optimizer.sharded_state_dict` (see the module doc for the choice)."""

PathLike = Union[str, os.PathLike]


class CheckpointError(RuntimeError):
    """A save or load step failed (on this rank or another one)."""


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
    """Human-readable remarks (e.g. why RNG states were not restored)."""


# ---------------------------------------------------------------------------------------------
# Small helpers
# ---------------------------------------------------------------------------------------------


def versions() -> dict[str, str]:
    """Library versions recorded in every checkpoint."""
    import megatron_dapo

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
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    return {
        "tp": ps.get_tensor_model_parallel_world_size(),
        "pp": ps.get_pipeline_model_parallel_world_size(),
        "vpp": num_chunks if num_chunks > 1 else None,
        "cp": ps.get_context_parallel_world_size(),
        "dp": ps.get_data_parallel_world_size(),
        "world_size": dist.get_world_size(),
    }


def _unwrap(models: Sequence[torch.nn.Module]) -> list[torch.nn.Module]:
    from megatron_dapo.model.builder import unwrap_model

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


def optimizer_kind(optimizer: Any) -> str:
    """"distributed" (ZeRO-1 DistributedOptimizer) or "local" (each DP rank holds the full state)."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    inner = _inner_optimizers(optimizer)
    kinds = {"distributed" if isinstance(o, DistributedOptimizer) else "local" for o in inner}
    if len(kinds) != 1:
        raise CheckpointError(f"mixed optimizer kinds {sorted(kinds)} are not supported by checkpointing")
    kind = kinds.pop()
    if kind == "distributed":
        formats = getattr(DistributedOptimizer, "checkpoint_fully_reshardable_formats", set())
        if OPTIMIZER_SHARDING["distrib_optim_sharding_type"] not in formats:
            raise CheckpointError(
                "this Megatron-Core's DistributedOptimizer has no 'fully_reshardable' checkpoint format "
                f"(it offers {sorted(formats)}): install megatron-core 0.16 - 0.19"
            )
    return kind


def _inner_optimizers(optimizer: Any) -> list:
    return list(getattr(optimizer, "chained_optimizers", None) or [optimizer])


def _materialise_adam_state(optimizer: Any) -> None:
    """Create the Adam state PyTorch would create at the first step, where it is missing.

    Megatron 0.16's DistributedOptimizer.state_dict() on the PyTorch-Adam path (no Apex / TE: CPU
    machines) reads state["step"] of every parameter, which PyTorch creates lazily at the first
    step, so a never-stepped optimizer cannot describe what to load. Zeros and step 0 are exactly
    PyTorch's initial state, and loading overwrites them.
    """
    for inner in _inner_optimizers(optimizer):
        torch_optimizer = getattr(inner, "optimizer", None)
        if not isinstance(torch_optimizer, (torch.optim.Adam, torch.optim.AdamW)):
            continue
        for group in torch_optimizer.param_groups:
            for param in group["params"]:
                state = torch_optimizer.state[param]
                if "step" in state:
                    continue
                # Where PyTorch keeps it: on the parameter's device only for capturable / fused Adam.
                on_param = group.get("capturable") or group.get("fused")
                state["step"] = torch.tensor(0.0, device=param.device if on_param else "cpu")
                state.setdefault("exp_avg", torch.zeros_like(param, memory_format=torch.preserve_format))
                state.setdefault("exp_avg_sq", torch.zeros_like(param, memory_format=torch.preserve_format))
                if group.get("amsgrad"):
                    state.setdefault("max_exp_avg_sq", torch.zeros_like(param, memory_format=torch.preserve_format))


def _load_optimizer_state(optimizer: Any, state_dict: Any) -> None:
    """`optimizer.load_state_dict`, working around a Megatron 0.16 bug on the PyTorch-Adam path.

    For the fully-reshardable format, DistributedOptimizer.load_state_dict first rebuilds the
    inner optimizer's state (adding a per-parameter "step" on the PyTorch path), then copies the
    loaded tensors into every key of that state, "step" included, which the loaded tensors do not
    have (KeyError). We split the two halves and hide "step" during the copy; with Apex / TE
    optimizers there is no per-parameter step and this is the plain call.
    """
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    inner = _inner_optimizers(optimizer)
    parts = [state_dict] if len(inner) == 1 else [state_dict[k] for k in sorted(state_dict)]
    if len(parts) != len(inner):
        raise CheckpointError(f"the checkpoint holds {len(parts)} optimizer(s), this run has {len(inner)}")
    for opt, part in zip(inner, parts):
        if not isinstance(opt, DistributedOptimizer) or part.get("param_state_sharding_type") != "fully_reshardable":
            opt.load_state_dict(part)
            continue
        part = dict(part)
        param_state = part.pop("param_state")
        part.pop("param_state_sharding_type")
        opt.load_state_dict(part)  # param groups, step, grad scaler
        hidden = {param: state.pop("step") for param, state in opt.optimizer.state.items() if "step" in state}
        try:
            opt.load_parameter_state_from_fully_reshardable(param_state)
        finally:
            for param, step in hidden.items():
                opt.optimizer.state[param]["step"] = step
    if len(inner) > 1 and hasattr(optimizer, "_synchronize_steps"):
        optimizer._synchronize_steps()
    _unshare_step_tensors(optimizer)


def _unshare_step_tensors(optimizer: Any) -> None:
    """Give every parameter its own Adam "step" tensor.

    DistributedOptimizer.load_state_dict (PyTorch path) puts ONE step tensor in every parameter's
    state; PyTorch's foreach Adam then increments that shared tensor once per parameter, so after
    one update the bias correction uses step 2 + number of parameters instead of 3. Found by the
    resume test: the loss after the first resumed update differed from the uninterrupted run.
    """
    for inner in _inner_optimizers(optimizer):
        torch_optimizer = getattr(inner, "optimizer", None)
        if not isinstance(torch_optimizer, torch.optim.Optimizer):
            continue
        seen: set[int] = set()
        for state in torch_optimizer.state.values():
            step = state.get("step")
            if isinstance(step, torch.Tensor):
                if id(step) in seen:
                    state["step"] = step.clone()
                seen.add(id(step))


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
    import torch.distributed as dist

    return dist.get_rank()


def _rank0_then_share(fn, what: str) -> Any:
    """Run `fn` on rank 0; every rank returns its (picklable) result or raises its failure."""
    import torch.distributed as dist

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
    import torch.distributed as dist

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


def _sharded_state(models, optimizer, scheduler, is_loading: bool, with_optimizer: bool) -> dict[str, Any]:
    state = model_sharded_state_dict(models)
    if with_optimizer:
        model_state = dict(state)
        _materialise_adam_state(optimizer)
        state["optimizer"] = optimizer.sharded_state_dict(model_state, is_loading=is_loading, metadata=OPTIMIZER_SHARDING)
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
             hf_dir: Optional[PathLike], keep_last: int) -> str:
    """Rank 0: finish the temp directory, rename it into place, move `latest`, prune old ones."""
    if trainer_state is not None:
        (tmp / TRAINER_STATE_FILE).write_text(json.dumps(trainer_state, default=_json_default, indent=1))
    if hf_dir is not None:
        copy_hf_side_files(hf_dir, tmp / HF_DIR)
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
) -> Path:
    """Write checkpoint `<root>/step_<step>` atomically; collective over all ranks. Returns its path.

    `models`: this rank's model chunks (wrapped or not). `optimizer`: a Megatron optimizer
    (`get_megatron_optimizer`), `scheduler`: an `OptimizerParamScheduler` (both optional).
    `trainer_state`: JSON-serialisable dict saved by rank 0 (dataloader position, metrics).
    `config`: the run's config (dataclass or dict), recorded in metadata.json. `hf_dir`: the HF
    model directory whose config / tokenizer files are copied in, which lets
    `convert_megatron_to_hf` export this checkpoint. `keep_last` > 0 prunes older checkpoints.
    """
    import torch.distributed as dist

    from megatron_dapo.checkpoint.rng import capture_rng_state
    from megatron_dapo.checkpoint.torch_dist import save_sharded

    if trainer_state is not None:
        json.dumps(trainer_state, default=_json_default)  # fail before any collective if it cannot be saved
    root = Path(root)
    name = step_dir_name(step)
    tmp, final = root / f"{TMP_PREFIX}{name}", root / name
    chunks = _unwrap(models)
    with_optimizer = optimizer is not None
    kind = optimizer_kind(optimizer) if with_optimizer else None

    def prepare() -> None:
        root.mkdir(parents=True, exist_ok=True)
        remove_stale_temp_dirs(root)  # crashed saves; nothing else writes .tmp-* under our root
        (tmp / DIST_DIR).mkdir(parents=True)
        (tmp / RNG_DIR).mkdir()

    _rank0_then_share(prepare, "preparing the checkpoint directory")

    state = _sharded_state(chunks, optimizer, scheduler, is_loading=False, with_optimizer=with_optimizer)
    save_sharded(state, tmp / DIST_DIR)  # collective: every rank writes its main-replica shards
    error = None
    try:
        torch.save(capture_rng_state(), tmp / RNG_DIR / f"rank_{_rank():05d}.pt")
    except Exception as err:
        error = err
    _all_ranks_ok(error, "saving RNG states")

    hf_config = None
    if hf_dir is not None and (Path(hf_dir) / "config.json").is_file():
        hf_config = json.loads((Path(hf_dir) / "config.json").read_text())
    metadata = make_metadata(
        step,
        contents={
            "model": True,
            "optimizer": kind,
            "optimizer_sharding": OPTIMIZER_SHARDING["distrib_optim_sharding_type"] if kind == "distributed" else None,
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
        **(extra_metadata or {}),
    )
    path = _rank0_then_share(
        lambda: _publish(root, tmp, final, metadata, trainer_state, hf_dir, keep_last), "publishing the checkpoint"
    )
    dist.barrier()
    return Path(path)


# ---------------------------------------------------------------------------------------------
# Load
# ---------------------------------------------------------------------------------------------


def _same_layout(saved: dict, now: dict) -> bool:
    keys = ("tp", "pp", "vpp", "cp", "dp", "world_size")
    return all(saved.get(k) == now.get(k) for k in keys)


def _describe_layout(layout: dict) -> str:
    return ", ".join(f"{k}={layout.get(k)}" for k in ("tp", "pp", "vpp", "dp", "world_size"))


def load_checkpoint(
    path: PathLike,
    models: Sequence[torch.nn.Module],
    optimizer: Any = None,
    scheduler: Any = None,
    *,
    load_optimizer: bool = True,
    load_scheduler: Optional[bool] = None,
    load_rng: bool = True,
) -> LoadedCheckpoint:
    """Load a checkpoint into this rank's `models` (and optimizer / scheduler); collective.

    `path`: a checkpoint directory or a root of step directories (its `latest` one is loaded;
    incomplete saves are ignored). Works at any TP / PP / VPP / DP (module doc). With
    `load_optimizer=False` only the weights are loaded and the optimizer's main parameters are
    re-copied from them. `load_scheduler` defaults to `load_optimizer`.

    Raises FileNotFoundError (nothing complete to load), CheckpointMismatchError (the checkpoint does
    not fit these models or this optimizer: the message lists what differs).
    """
    directory = resolve_checkpoint_dir(path)  # fails fast, before Megatron is even imported
    metadata = read_metadata(directory)

    from megatron_dapo.checkpoint.rng import restore_rng_state
    from megatron_dapo.checkpoint.torch_dist import CheckpointMismatchError, check_against_checkpoint, load_sharded

    contents = metadata.get("contents", {})
    chunks = _unwrap(models)
    notes: list[str] = []

    with_optimizer = optimizer is not None and load_optimizer
    if with_optimizer:
        saved_kind = contents.get("optimizer")
        if not saved_kind:
            raise CheckpointMismatchError(
                f"{directory} holds no optimizer state (saved without one, e.g. converted from HF): "
                "load it with load_optimizer=False"
            )
        kind = optimizer_kind(optimizer)
        sharding = contents.get("optimizer_sharding")
        if saved_kind == "distributed" and sharding != OPTIMIZER_SHARDING["distrib_optim_sharding_type"]:
            raise CheckpointMismatchError(
                f"{directory} holds distributed-optimizer state in the {sharding!r} format; this version reads the "
                f"{OPTIMIZER_SHARDING['distrib_optim_sharding_type']!r} format (loadable at any layout): load the "
                "weights only (load_optimizer=False)"
            )
        if saved_kind != kind:
            raise CheckpointMismatchError(
                f"{directory} holds the state of a {saved_kind} optimizer but this run uses a {kind} one "
                f"(parallel.use_distributed_optimizer={kind == 'distributed'}): resume with "
                f"parallel.use_distributed_optimizer={saved_kind == 'distributed'}, or load the weights only "
                "(load_optimizer=False)"
            )
    state = _sharded_state(chunks, optimizer, None, is_loading=True, with_optimizer=with_optimizer)
    replaced = check_against_checkpoint(state, directory / DIST_DIR)
    if replaced:
        notes.append(f"{len(replaced)} _extra_state object(s) absent from the checkpoint were left empty")
    loaded = load_sharded(state, directory / DIST_DIR)

    for key, chunk in zip(_model_keys(len(chunks)), chunks):
        chunk.load_state_dict(loaded[key], strict=True)
    if with_optimizer:
        _load_optimizer_state(optimizer, loaded["optimizer"])
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
            raise CheckpointError(f"{rng_file} is missing: the checkpoint is damaged")
        else:
            restore_rng_state(torch.load(rng_file, weights_only=False))
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
