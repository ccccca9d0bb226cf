"""The DAPO run's checkpoint: the actor (model, optimizer, LR schedule, RNGs) and the trainer state.

The trainer state is the step and the prompt sampler's position: with them a resumed run takes the
same prompts in the same order (`data.sampler`), and with the generation seeds of `seeds.py` its
steps equal the uninterrupted run's. The checkpoint format itself (atomic, checksummed, damaged
ones passed over on resume) is `megatron_dapo.checkpoint`'s.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

from megatron_dapo.checkpoint import load_latest_checkpoint, save_checkpoint
from megatron_dapo.config import Config

TRAINER_STATE_KEYS = ("step", "sampler")


def save_run_checkpoint(root: Path, step: int, actor, sampler, cfg: Config, rank0_files: Optional[dict] = None) -> Path:
    """Checkpoint `root/step_<step>` (collective). Periodic (and SIGTERM) saves are in
    `trainer.checkpoint_format`; the one after the last step is fully reshardable
    (`trainer.final_checkpoint_reshardable`, `final_optimizer_format`), so that a finished run
    continues at any layout. `rank0_files`: files the trainer's rank 0 adds (`checkpoint.save_checkpoint`;
    the asynchronous run's `async_state`)."""
    t = cfg.trainer
    optimizer_format = t.checkpoint_format
    if step >= t.total_steps and t.final_checkpoint_reshardable:
        optimizer_format = final_optimizer_format(actor, cfg)
    return save_checkpoint(
        root, step, actor.models, actor.optimizer, actor.scheduler,
        trainer_state={"step": step, "sampler": sampler.state_dict()},
        config=cfg, hf_dir=cfg.model.hf_dir, keep_last=t.keep_last,
        optimizer_format=optimizer_format,
        write_threads=t.checkpoint_write_threads,
        rank0_files=rank0_files,
    )  # fmt: skip


def final_optimizer_format(actor, cfg: Config, say=print) -> str:
    """The final save's optimizer format, said on the logging rank with why: "fully_reshardable" when
    the nodes of the ranks that would gather the optimizer state can hold it (`checkpoint.final_save`),
    else "fully_sharded_model_space" (every rank writes its own part, nothing is gathered); both load
    at any layout. A collective: every rank reports its node, its share and the node's available memory."""
    if not cfg.parallel.use_distributed_optimizer:
        return "fully_reshardable"  # every rank holds its full state already: nothing is gathered
    import socket

    from megatron_dapo.checkpoint.final_save import RankShare, available_host_memory, final_save_fits, gathered_parameters
    from megatron_dapo.distributed.objects import gather_objects, is_logging_rank

    dense, expert = _parameter_counts(actor.models)
    mine = RankShare(
        host=socket.gethostname(),
        gathered=gathered_parameters(dense, expert, *_data_parallel_ranks()),
        available=available_host_memory(),
    )
    fits, why = final_save_fits(gather_objects(mine))
    chosen = "fully_reshardable" if fits else "fully_sharded_model_space"
    if is_logging_rank():
        if fits:
            say(f"[megatron-dapo] final checkpoint: fully_reshardable (Megatron's format, the optimizer state gathered "
                f"on each data-parallel group's rank 0; {why})", flush=True)  # fmt: skip
        else:
            say(f"[megatron-dapo] final checkpoint: fully_sharded_model_space, not fully_reshardable: {why}. Every rank "
                "writes its own part of the optimizer state instead, nothing is gathered; it resumes at any layout "
                "as well", flush=True)  # fmt: skip
    return chosen


def _parameter_counts(models) -> tuple[int, int]:
    """(dense, expert) parameters of this rank's model chunks; Megatron marks the experts, which the
    distributed optimizer shards over the expert data-parallel group, with `allreduce = False`."""
    dense = expert = 0
    for model in models:
        for param in model.parameters():
            if getattr(param, "allreduce", True):
                dense += param.numel()
            else:
                expert += param.numel()
    return dense, expert


def _data_parallel_ranks() -> tuple[int, int]:
    """This rank's place in the groups the distributed optimizers gather over: data parallel x
    context parallel (the dense parameters) and expert data parallel (the experts)."""
    from megatron.core import parallel_state as ps

    if not ps.model_parallel_is_initialized():
        return 0, 0
    return ps.get_data_parallel_rank(with_context_parallel=True), ps.get_expert_data_parallel_rank()


def resume_run(root: Path, actor, sampler) -> Optional[tuple[int, str, Path]]:
    """Load the newest intact checkpoint under `root` into the actor and the sampler (collective).

    Returns (its step, a line saying where it came from and what was passed over, its path), or None when
    `root` holds no checkpoint. Damaged ones (checksums, missing or cut files, a bad
    trainer_state.json) are passed over and named; none intact at all is a named error."""
    loaded = load_latest_checkpoint(root, actor.models, actor.optimizer, actor.scheduler, required_state=TRAINER_STATE_KEYS)
    if loaded is None:
        return None
    step = int(loaded.trainer_state["step"])
    sampler.load_state_dict(loaded.trainer_state["sampler"])
    return step, f"resumed from {loaded.path} at step {step}" + "".join(f"\n  note: {n}" for n in loaded.notes), loaded.path
