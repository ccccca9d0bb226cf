"""Supervised warm start (the library of `megatron-dapo sft`): the actor's own update step with a cross-entropy loss.

Same model build, parallel layout, micro-batching, optimizer and checkpoint format as DAPO training;
only the objective differs (`build_actor(..., sft=True)`: the token-mean of ``-log p`` over the
response tokens). Data: the verl/DAPO schema plus a ``response`` field holding the target text; the
prompt is rendered with the chat template exactly as the rollout sees it, and the target ends with
the tokenizer's EOS so that the model learns to stop. The result is a Megatron checkpoint under
``sft.output_dir/checkpoints`` that a DAPO run starts from through ``model.megatron_checkpoint``.
"""

from __future__ import annotations

import copy
import signal
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence


from megatron_dapo.actor import PolicyBatch, build_actor
from megatron_dapo.checkpoint import save_checkpoint
from megatron_dapo.config import Config
from megatron_dapo.errors import ConfigError
from megatron_dapo.data.dataset import DatasetError, encode_prompt, iter_records
from megatron_dapo.data.sampler import PromptSampler, shard_for_rank
from megatron_dapo.distributed.objects import any_rank, data_parallel_rank_and_size, is_logging_rank
from megatron_dapo.distributed.setup import teardown
from megatron_dapo.tracking import MetricsLogger, ProgressBar
from megatron_dapo.trainer.metrics import sft_metrics
from megatron_dapo.trainer.startup import start


@dataclass(frozen=True)
class SFTExample:
    prompt_ids: list[int]
    response_ids: list[int]


def load_sft_examples(
    files: Sequence[str], tokenizer: Any, max_prompt_length: int, max_response_length: int,
    prompt_key: str = "prompt", apply_chat_template: bool = True,
) -> list[SFTExample]:
    """Read (prompt, response) pairs; too-long pairs are dropped with a count, missing fields are errors.

    The prompt is encoded as the rollout sees it (`data.dataset.encode_prompt`)."""
    examples: list[SFTExample] = []
    dropped = 0
    for path in files:
        for where, record in iter_records(path, name="sft"):
            response = record.get("response")
            if not isinstance(response, str):
                raise DatasetError(f"{where}: an SFT record needs a 'response' string (the target); found {sorted(record)}")
            prompt_ids = encode_prompt(record, tokenizer, prompt_key=prompt_key, apply_chat_template=apply_chat_template, where=where)
            response_ids = tokenizer(response, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
            if len(prompt_ids) > max_prompt_length or len(response_ids) > max_response_length:
                dropped += 1
                continue
            examples.append(SFTExample(prompt_ids, list(response_ids)))
    if not examples:
        raise DatasetError(
            f"no usable SFT example in {list(files)} ({dropped} longer than rollout.max_prompt_length / "
            "rollout.max_response_length)"
        )
    if dropped:
        print(f"[sft] dropped {dropped} examples longer than the prompt/response limits")
    return examples


def sft_view(cfg: Config) -> Config:
    """The config the SFT actor is built from: the `sft` section's steps, LR and warm-up."""
    view = copy.deepcopy(cfg)
    view.optimizer.lr = cfg.sft.lr
    view.optimizer.warmup_steps = cfg.sft.warmup_steps
    view.trainer.total_steps = max(1, cfg.sft.total_steps)
    view.trainer.output_dir = cfg.sft.output_dir
    view.rollout.temperature = 1.0
    return view


def run_sft(cfg: Config, say=print, keep_process_group: bool = False) -> Path:
    """Run the warm start (every rank); returns the checkpoint root DAPO should start from.

    `keep_process_group`: leave torch.distributed up for a DAPO run in the same processes (the demo).
    """
    s = cfg.sft
    if not s.train_files:
        raise ConfigError("'sft.train_files' is empty: give parquet/jsonl files with a prompt and a 'response' field")
    if s.total_steps < 1:
        raise ConfigError("'sft.total_steps' is 0: nothing to train (set it to the number of optimizer steps)")
    for path in s.train_files:
        if not Path(path).is_file():
            raise ConfigError(f"'sft.train_files' names {path}, which does not exist")
    view = sft_view(cfg)
    runtime = start(view, needs_data=False, say=say)
    finished = False  # every rank saved: they leave together (distributed.setup.leave_together)
    try:
        dp_rank, dp_size = data_parallel_rank_and_size()
        if s.batch_size % dp_size:
            raise ConfigError(f"'sft.batch_size'={s.batch_size} is not divisible by {dp_size} data-parallel replicas")
        tokenizer = runtime.tokenizer
        examples = load_sft_examples(
            s.train_files, tokenizer, cfg.rollout.max_prompt_length, cfg.rollout.max_response_length,
            prompt_key=cfg.data.prompt_key, apply_chat_template=cfg.data.apply_chat_template,
        )
        actor = build_actor(view, runtime.models, runtime.hf_config.vocab_size, sft=True)
        sampler = PromptSampler(len(examples), s.batch_size, shuffle=True, seed=cfg.data.seed)
        rank0 = is_logging_rank()
        stop = {"requested": False}
        previous = signal.signal(signal.SIGTERM, lambda *_: stop.update(requested=True))
        out = Path(s.output_dir)
        if rank0:
            say(f"[sft] {len(examples)} examples, {s.total_steps} steps of {s.batch_size} sequences")
            (out / "metrics.jsonl").unlink(missing_ok=True)
        step = 0
        try:
            with MetricsLogger(out, [b for b in cfg.trainer.loggers if b != "wandb"], experiment_name=f"{cfg.trainer.experiment_name}-sft",
                               enabled=rank0, console_every=max(1, s.total_steps // 10)) as logger, \
                    ProgressBar(s.total_steps, enabled=rank0, desc="sft") as progress:  # fmt: skip
                for step in range(1, s.total_steps + 1):
                    chosen = [examples[i] for i in shard_for_rank(sampler.next_batch(), dp_rank, dp_size)]
                    batch = PolicyBatch.from_token_lists(
                        [e.prompt_ids for e in chosen], [e.response_ids for e in chosen], pad_token_id=tokenizer.pad_token_id
                    )
                    record = sft_metrics(actor.update([batch]))
                    logger.log(record, step=step)
                    progress.update(step, record)
                    if any_rank(stop["requested"]):
                        break
        finally:
            signal.signal(signal.SIGTERM, previous)
        root = out / "checkpoints"
        save_checkpoint(root, step, actor.models, actor.optimizer, actor.scheduler, trainer_state={"step": step, "phase": "sft"},
                        config=view, hf_dir=cfg.model.hf_dir, keep_last=1)  # fmt: skip
        if rank0:
            say(f"[sft] done: checkpoint of step {step} under {root} (start DAPO from it with model.megatron_checkpoint={root})")
        finished = True
        return root
    finally:
        teardown(keep_process_group=keep_process_group, together=finished)
