"""Start-up shared by `train` and `sft`: pre-flight checks, process groups, tokenizer, model weights.

Order matters and is the point of this module: every check that can fail without a model (config
against the world size and the model's config.json, data files, output directory) runs before
anything heavy, on every rank, and prints the resolved parallel layout; only then are the process
groups created and the model loaded. The actor's weights and, with a KL loss, the frozen
reference's (a second copy of the same starting weights) load here, through the one `load_models`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from megatron_dapo.config import Config, engine_returns_routing, read_model_config
from megatron_dapo.errors import ConfigError
from megatron_dapo.trainer.output_dir import check_output_dir, clear_previous_run
from megatron_dapo.distributed.launch import resolve_launch_env
from megatron_dapo.distributed.layout import ParallelLayout
from megatron_dapo.reward.loader import load_reward_function
from megatron_dapo.rollout.engines.vllm.limits import ROUTED_EXPERTS_KEYS, routed_experts_on_cpu_error


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
) -> ParallelLayout:
    """Every check that needs no model, before any process group exists. Returns the run's layout
    (`Config.parallel_layout`): built here, once, and passed down.

    `resume` not None: `trainer.output_dir` is checked for a previous run (`check_output_dir`).
    Raises `ConfigError` naming the key (or the file) to change.
    """
    check_reward_function(cfg)  # user code: the first thing that can fail, so it fails first
    hf_dir = cfg.model.hf_dir
    if not hf_dir:
        raise ConfigError("'model.hf_dir' is empty: point it at a HuggingFace model directory (config.json, weights, tokenizer)")
    config_file = Path(hf_dir) / "config.json"
    if not config_file.is_file():
        raise ConfigError(f"'model.hf_dir'={hf_dir} is not an HF model directory (no config.json there)")
    model_config = read_model_config(hf_dir)  # bad JSON, unsupported architecture: named here, not after start-up
    check_model_files(cfg)
    layout = cfg.parallel_layout(world_size)
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
    if needs_data:  # a DAPO run, whose rollout engine will start (the SFT warm start has none)
        # Last: it imports torch (to see the GPUs), which the trainer imports next anyway.
        check_engine_device(cfg, _is_moe(model_config), _cuda_available())
    return layout


def check_engine_device(cfg: Config, is_moe: bool, cuda_available: bool) -> None:
    """Refuse an engine setting this machine cannot run, before the model loads (pure). vLLM without
    a GPU is its CPU build, which cannot return routed experts (`rollout.engines.vllm.limits`): a
    `ConfigError` naming the settings that ask for them on a mixture-of-experts model."""
    if cfg.rollout.engine != "vllm" or not engine_returns_routing(cfg, is_moe) or cuda_available:
        return
    asked = (cfg.actor.router_replay == "r3", cfg.rollout.return_routed_experts)
    raise routed_experts_on_cpu_error([key for key, on in zip(ROUTED_EXPERTS_KEYS, asked) if on])


def _is_moe(model_config: dict) -> bool:
    from megatron_dapo.model.hf_config import read_hf_config

    return read_hf_config(model_config).is_moe


def _cuda_available() -> bool:
    """Whether the run will compute on GPUs (`distributed.setup.init_distributed`'s rule)."""
    import torch

    return torch.cuda.is_available()


# Files a transformers tokenizer is built from; without any of them `AutoTokenizer` (transformers 5)
# quietly builds an EMPTY tokenizer, and the run failed much later on prompts of zero tokens.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt", "spiece.model", "tokenizer.tiktoken")


def check_model_files(cfg: Config) -> None:
    """The tokenizer files are there, and the weights read at start (`model.hf_dir`'s safetensors,
    unless `model.megatron_checkpoint` replaces them) are complete by their headers."""
    # `megatron-dapo config` runs these checks and must not load torch: megatron_dapo.model,
    # distributed.setup / objects, checkpoint.core and transformers do, so they load on first use here.
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

    try:
        load_reward_function(custom.path, custom.name)
    except (ValueError, ImportError) as error:
        raise ConfigError(str(error)) from None


def launch_world_size() -> int:
    """The number of processes this job was launched with (torchrun, srun or a single process)."""
    return resolve_launch_env(os.environ, free_port=0).world_size


def start(
    cfg: Config, *, needs_data: bool = True, reference: bool = False, say=print, resume: Optional[bool] = None,
    overwrite: bool = False, layout: Optional[ParallelLayout] = None,
) -> Runtime:
    """Pre-flight, then process groups, tokenizer and the loaded model chunks.

    `reference`: also load a second copy of the starting weights, for the frozen KL reference.
    `resume` / `overwrite`: the policy for a previous run in `trainer.output_dir` (`check_output_dir`;
    None: no check); with `overwrite` rank 0 deletes that run's files once every rank passed the checks.
    `layout`: what `preflight` returned when the caller already ran it with these arguments
    (`megatron-dapo train` does, before it imports the trainer); None runs it here.
    """
    from transformers import AutoTokenizer

    from megatron_dapo.distributed.objects import is_logging_rank
    from megatron_dapo.distributed.setup import init_distributed
    from megatron_dapo.model.hf_config import read_hf_config

    world_size = launch_world_size()
    if layout is None:
        layout = preflight(cfg, world_size, needs_data=needs_data, resume=resume, overwrite=overwrite)
    ctx = init_distributed(
        layout, timeout_s=cfg.trainer.collective_timeout_s, seed=cfg.trainer.seed, gather_timeout_s=cfg.rollout.gather_timeout_s
    )
    hf_config = read_hf_config(cfg.model.hf_dir)
    if is_logging_rank():
        say(
            f"[megatron-dapo] {world_size} process(es), backend {ctx.backend}, device {ctx.device.type}\n"
            + ctx.layout.describe(hf_config.num_layers)
        )
        if overwrite:  # after init_distributed: every rank has checked the directory before it changes
            removed = clear_previous_run(cfg.trainer.output_dir)
            if removed:
                say(f"--overwrite: removed {', '.join(removed)} of the previous run in {cfg.trainer.output_dir}")
    tokenizer = AutoTokenizer.from_pretrained(cfg.model.hf_dir)
    check_tokenizer(tokenizer, cfg.model.hf_dir)
    if tokenizer.pad_token_id is None:  # Llama-style tokenizers: pad with EOS (padding never enters a loss)
        tokenizer.pad_token = tokenizer.eos_token
    if ctx.role == "rollout":  # the separate placement's engine ranks hold no actor (`rollout_worker`)
        return Runtime(cfg=cfg, ctx=ctx, tokenizer=tokenizer, hf_config=hf_config, models=[], output_dir=Path(cfg.trainer.output_dir))
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
        moe_token_dispatcher=cfg.moe.token_dispatcher,
        moe_aux_loss_coeff=cfg.moe.aux_loss_coeff,
        moe_z_loss_coeff=cfg.moe.z_loss_coeff,
    )
    if cfg.model.megatron_checkpoint:
        from megatron_dapo.checkpoint import load_checkpoint

        load_checkpoint(cfg.model.megatron_checkpoint, models, load_optimizer=False, load_scheduler=False, load_rng=False)
    else:
        load_hf_into_megatron(models, cfg.model.hf_dir, hf_config)
    return models
