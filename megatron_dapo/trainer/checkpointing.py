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


def save_run_checkpoint(root: Path, step: int, actor, sampler, cfg: Config) -> Path:
    """Checkpoint `root/step_<step>` (collective). Periodic (and SIGTERM) saves are in
    `trainer.checkpoint_format`; the one after the last step can be fully reshardable
    (`trainer.final_checkpoint_reshardable`), so that a finished run continues at any layout."""
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
    )  # fmt: skip


def final_optimizer_format(actor, cfg: Config, say=print) -> str:
    """"fully_reshardable" when the nodes that gather the optimizer state can hold it
    (`checkpoint.final_save`), else `trainer.checkpoint_format`, said on the logging rank (a
    collective: every rank reports its node, share and available memory)."""
    if not cfg.parallel.use_distributed_optimizer:
        return "fully_reshardable"  # every rank holds its full state already: nothing is gathered
    import socket

    from megatron_dapo.checkpoint.final_save import RankShare, available_host_memory, final_save_fits
    from megatron_dapo.distributed.objects import data_parallel_rank_and_size, gather_objects, is_logging_rank

    mine = RankShare(
        host=socket.gethostname(),
        gathers=data_parallel_rank_and_size()[0] == 0,
        parameters=sum(p.numel() for model in actor.models for p in model.parameters()),
        available=available_host_memory(),
    )
    fits, why = final_save_fits(gather_objects(mine))
    if fits:
        return "fully_reshardable"
    if is_logging_rank():
        say(f"[megatron-dapo] {why}: the final checkpoint keeps trainer.checkpoint_format={cfg.trainer.checkpoint_format} "
            "(it resumes at the same TP / PP / VPP; its weights convert to HF at any layout)", flush=True)  # fmt: skip
    return cfg.trainer.checkpoint_format


def resume_run(root: Path, actor, sampler) -> Optional[tuple[int, str]]:
    """Load the newest intact checkpoint under `root` into the actor and the sampler (collective).

    Returns (its step, a line saying where it came from and what was passed over), or None when
    `root` holds no checkpoint. Damaged ones (checksums, missing or cut files, a bad
    trainer_state.json) are passed over and named; none intact at all is a named error."""
    loaded = load_latest_checkpoint(root, actor.models, actor.optimizer, actor.scheduler, required_state=TRAINER_STATE_KEYS)
    if loaded is None:
        return None
    step = int(loaded.trainer_state["step"])
    sampler.load_state_dict(loaded.trainer_state["sampler"])
    return step, f"resumed from {loaded.path} at step {step}" + "".join(f"\n  note: {n}" for n in loaded.notes)
