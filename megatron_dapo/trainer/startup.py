"""Start-up shared by `train` and `sft`: pre-flight checks, process groups, tokenizer, model weights.

Order matters and is the point of this module: every check that can fail without a model (config
against the world size and the model's config.json, data files, output directory) runs before
anything heavy, on every rank, and prints the resolved parallel layout; only then are the process
groups created and the model loaded. The actor's weights and, with a KL loss, the frozen
reference's (a second copy of the same starting weights) load here, through the one `load_models`.
A run that then fills its disk ends with one message (`stop_on_full_disk`), not with the traceback
of every writer it broke.
"""

from __future__ import annotations

import errno
import os
import shutil
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from megatron_dapo.config import Config, ConfigError, read_model_config, validate_model_shape
from megatron_dapo.trainer.output_dir import check_output_dir, clear_previous_run


@dataclass
class Runtime:
    """What a job holds after start-up."""

    cfg: Config
    ctx: Any
    """`distributed.DistributedContext`."""
    tokenizer: Any
    hf_config: Any
    """`model.hf_config.HFModelConfig` of `cfg.model.hf_dir`."""
    models: list
    """This rank's Megatron model chunks of the actor (unwrapped, loaded)."""
    output_dir: Path
    reference_models: Optional[list] = None
    """The same starting weights again for the frozen KL reference (`start(..., reference=True)`)."""


def preflight(
    cfg: Config, world_size: int, *, needs_data: bool = True, resume: Optional[bool] = None, overwrite: bool = False
) -> str:
    """Every check that needs no model, before any process group exists. Returns the layout text.

    `resume` not None: `trainer.output_dir` is checked for a previous run (`check_output_dir`).
    Raises `ConfigError` naming the key (or the file) to change.
    """
    from megatron_dapo.distributed.layout import ParallelLayout

    check_reward_function(cfg)  # user code: the first thing that can fail, so it fails first
    hf_dir = cfg.model.hf_dir
    if not hf_dir:
        raise ConfigError("'model.hf_dir' is empty: point it at a HuggingFace model directory (config.json, weights, tokenizer)")
    config_file = Path(hf_dir) / "config.json"
    if not config_file.is_file():
        raise ConfigError(f"'model.hf_dir'={hf_dir} is not an HF model directory (no config.json there)")
    hf_json = read_model_config(hf_dir)  # bad JSON, unsupported architecture: named here, not after start-up
    validate_model_shape(cfg, hf_json)
    check_model_files(cfg)
    cfg.resolve_world(world_size)
    if cfg.model.megatron_checkpoint and not Path(cfg.model.megatron_checkpoint).exists():
        raise ConfigError(f"'model.megatron_checkpoint'={cfg.model.megatron_checkpoint} does not exist")
    if needs_data:
        if not cfg.data.train_files:
            raise ConfigError("'data.train_files' is empty: give parquet or jsonl files in the verl/DAPO schema")
        for key in ("train_files", "val_files"):
            for path in getattr(cfg.data, key):
                if not Path(path).is_file():
                    raise ConfigError(f"'data.{key}' names {path}, which does not exist")
    if resume is not None:
        check_output_dir(cfg.trainer.output_dir, resume=resume, overwrite=overwrite)
    layout = ParallelLayout(cfg.parallel.tp, cfg.parallel.pp, cfg.parallel.vpp, cfg.parallel.cp, world_size)
    return layout.describe(int(hf_json.get("num_hidden_layers", 0)) or None)


# Files a transformers tokenizer is built from; without any of them `AutoTokenizer` (transformers 5)
# quietly builds an EMPTY tokenizer, and the run failed much later on prompts of zero tokens.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt", "spiece.model", "tokenizer.tiktoken")


def check_model_files(cfg: Config) -> None:
    """The tokenizer files are there, and the weights read at start (`model.hf_dir`'s safetensors,
    unless `model.megatron_checkpoint` replaces them) are complete by their headers."""
    from megatron_dapo.model.hf_config import ModelFileError
    from megatron_dapo.model.hf_weights import check_weight_files

    hf_dir = Path(cfg.model.hf_dir)
    if not any((hf_dir / name).is_file() for name in TOKENIZER_FILES):
        raise ConfigError(
            f"'model.hf_dir'={hf_dir} has no tokenizer (none of {', '.join(TOKENIZER_FILES)}): copy the tokenizer "
            "files of the model there (they come with the model on the HuggingFace hub)"
        )
    if cfg.model.megatron_checkpoint:
        return  # the weights come from the checkpoint; hf_dir gives the config and tokenizer
    try:
        check_weight_files(hf_dir)
    except FileNotFoundError as error:
        raise ConfigError(f"'model.hf_dir'={hf_dir}: {error} (the model's weights are needed at start)") from None
    except ModelFileError as error:
        raise ConfigError(f"'model.hf_dir': {error}") from None


def check_tokenizer(tokenizer: Any, hf_dir: str) -> None:
    """A tokenizer that turns text into no tokens was built from nothing: name the files, not the prompts."""
    if len(tokenizer) <= 1 or not tokenizer("1 + 1 = 2", add_special_tokens=False)["input_ids"]:
        raise ConfigError(
            f"the tokenizer loaded from 'model.hf_dir'={hf_dir} is empty ({len(tokenizer)} token(s)): its tokenizer "
            f"files ({', '.join(TOKENIZER_FILES[:3])}, ...) are missing or broken; copy them from the model's source"
        )


def check_reward_function(cfg: Config) -> None:
    """Import `reward.custom_function` now (ConfigError naming the key, the file and the error), so that a
    wrong path, an import error or a syntax error stops the job before the model loads."""
    custom = cfg.reward.custom_function
    if custom.path is None:
        return
    from megatron_dapo.reward.loader import load_reward_function

    try:
        load_reward_function(custom.path, custom.name)
    except (ValueError, ImportError) as error:
        raise ConfigError(str(error)) from None


def launch_world_size() -> int:
    """The number of processes this job was launched with (torchrun, srun or a single process)."""
    from megatron_dapo.distributed.setup import resolve_launch_env

    return resolve_launch_env(os.environ, free_port=0).world_size


def start(
    cfg: Config, *, needs_data: bool = True, reference: bool = False, say=print, resume: Optional[bool] = None,
    overwrite: bool = False,
) -> Runtime:
    """Pre-flight, then process groups, tokenizer and the loaded model chunks.

    `reference`: also load a second copy of the starting weights, for the frozen KL reference.
    `resume` / `overwrite`: the policy for a previous run in `trainer.output_dir` (`check_output_dir`;
    None: no check); with `overwrite` rank 0 deletes that run's files once every rank passed the checks.
    """
    from transformers import AutoTokenizer

    from megatron_dapo.distributed.objects import is_logging_rank
    from megatron_dapo.distributed.setup import init_distributed
    from megatron_dapo.model.hf_config import read_hf_config

    world_size = launch_world_size()
    layout_text = preflight(cfg, world_size, needs_data=needs_data, resume=resume, overwrite=overwrite)
    ctx = init_distributed(
        cfg.parallel, timeout_s=cfg.trainer.collective_timeout_s, seed=cfg.trainer.seed, gather_timeout_s=cfg.rollout.gather_timeout_s
    )
    if is_logging_rank():
        say(f"[megatron-dapo] {world_size} process(es), backend {ctx.backend}, device {ctx.device.type}\n{layout_text}")
        if overwrite:  # after init_distributed: every rank has checked the directory before it changes
            removed = clear_previous_run(cfg.trainer.output_dir)
            if removed:
                say(f"--overwrite: removed {', '.join(removed)} of the previous run in {cfg.trainer.output_dir}")
    tokenizer = AutoTokenizer.from_pretrained(cfg.model.hf_dir)
    check_tokenizer(tokenizer, cfg.model.hf_dir)
    if tokenizer.pad_token_id is None:  # Llama-style tokenizers: pad with EOS (padding never enters a loss)
        tokenizer.pad_token = tokenizer.eos_token
    hf_config = read_hf_config(cfg.model.hf_dir)
    models = load_models(cfg, hf_config, ctx.layout)
    reference_models = load_models(cfg, hf_config, ctx.layout) if reference else None
    output_dir = Path(cfg.trainer.output_dir)
    if is_logging_rank():
        output_dir.mkdir(parents=True, exist_ok=True)
    return Runtime(
        cfg=cfg, ctx=ctx, tokenizer=tokenizer, hf_config=hf_config, models=models, output_dir=output_dir,
        reference_models=reference_models,
    )  # fmt: skip


def load_models(cfg: Config, hf_config: Any, layout: Any) -> list:
    """This rank's model chunks with the starting weights: `model.megatron_checkpoint` when set, else
    `model.hf_dir`. The one load path of the actor and of the frozen reference."""
    import torch

    from megatron_dapo.model.builder import build_gpt_models
    from megatron_dapo.model.load import load_hf_into_megatron

    models = build_gpt_models(
        hf_config,
        layout,
        getattr(torch, cfg.model.dtype),
        transformer_engine=cfg.model.transformer_engine,
        sequence_parallel=cfg.parallel.sequence_parallel,
        init_weights=False,
        recompute_activations=cfg.model.recompute_activations,
    )
    if cfg.model.megatron_checkpoint:
        from megatron_dapo.checkpoint import load_checkpoint

        load_checkpoint(cfg.model.megatron_checkpoint, models, load_optimizer=False, load_scheduler=False, load_rng=False)
    else:
        load_hf_into_megatron(models, cfg.model.hf_dir, hf_config)
    return models


# ---------------------------------------------------------------------------------------------
# A full disk: one message instead of every writer's traceback
# ---------------------------------------------------------------------------------------------

_NO_SPACE_ERRNOS = (errno.ENOSPC, errno.EDQUOT)
# PyTorch's zip writer (torch.save) reports a short write as "[enforce fail at inline_container.cc:...]
# unexpected pos N vs M" and loses the errno: a full disk or a quota.
_SHORT_WRITE_MARKERS = ("unexpected pos",)


class DiskFullError(OSError):
    """Writing the run's output failed for lack of space (ENOSPC, a quota, PyTorch's short write)."""


def _exception_chain(error: BaseException) -> list[BaseException]:
    """`error`, its causes and contexts, and the per-rank errors a torch.distributed.checkpoint
    `CheckpointException` carries (its `failures`: rank -> exception or (exception, traceback))."""
    seen: list[BaseException] = []
    pending = [error]
    while pending:
        current = pending.pop()
        if current is None or any(current is s for s in seen):
            continue
        seen.append(current)
        pending += [current.__cause__, current.__context__]
        failures = getattr(current, "failures", None)
        if isinstance(failures, dict):
            for value in failures.values():
                pending.append(value[0] if isinstance(value, tuple) and value else value)
    return [e for e in seen if isinstance(e, BaseException)]


def _free_bytes(directory: Path) -> Optional[int]:
    for candidate in (directory, *directory.parents):
        try:
            return shutil.disk_usage(candidate).free
        except OSError:
            continue
    return None


RESUME_ADVICE = "then continue with --resume: it starts from the last complete checkpoint (an interrupted save is never used)"


def disk_full_error(
    error: BaseException, output_dir: os.PathLike | str, key: str = "trainer.output_dir", then: str = RESUME_ADVICE
) -> Optional[DiskFullError]:
    """A `DiskFullError` saying what to do when `error` (or anything it carries) is a write that
    failed for lack of space under `output_dir`, else None.

    Looks for ENOSPC / EDQUOT anywhere in the chain (the metrics file, a checkpoint writer on another
    thread, the plot) and for PyTorch's short-write error: the first failure and everything it broke
    on the way out are one problem."""
    directory = Path(output_dir)
    chain = _exception_chain(error)
    no_space = next((e for e in chain if isinstance(e, OSError) and e.errno in _NO_SPACE_ERRNOS), None)
    if no_space is None and not any(marker in str(e) for e in chain for marker in _SHORT_WRITE_MARKERS):
        return None
    free = _free_bytes(directory)
    what = "no space left" if no_space is None or no_space.errno == errno.ENOSPC else "disk quota exceeded"
    where = f" (writing {no_space.filename})" if no_space is not None and no_space.filename else ""
    left = "" if free is None else f"; {free / 2**20:.1f} MiB free now"
    return DiskFullError(
        errno.ENOSPC,
        f"{what} on the disk of {key}={directory}{where}{left}. Free some space or set "
        f"{key} to a larger disk (moving the directory there), {then}",
    )


@contextmanager
def stop_on_full_disk(output_dir: os.PathLike | str, key: str = "trainer.output_dir", then: str = RESUME_ADVICE):
    """Turn a failure caused by a full disk under `output_dir` (the config's `key`) into one
    `DiskFullError` (see `disk_full_error`) whose advice ends with `then`; any other error passes unchanged."""
    try:
        yield
    except (KeyboardInterrupt, SystemExit, GeneratorExit):
        raise
    except BaseException as error:  # torch.distributed.checkpoint's CheckpointException is a BaseException
        full = disk_full_error(error, output_dir, key, then)
        if full is None:
            raise
        raise full from None
