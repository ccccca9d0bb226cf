"""Worker for the checkpoint resume tests (run through tests/support/torchrun_utils.py, not by pytest).

A deliberately small training loop on real Megatron parts: GPTModel chunks wrapped in Megatron DDP,
`get_megatron_optimizer` (Adam; the distributed optimizer unless told otherwise), Megatron's
`OptimizerParamScheduler` (warm-up then linear decay, so the learning rate differs every step) and
the pipeline schedule from `get_forward_backward_func`. The loss is the mean next-token cross
entropy over a fixed global batch of 4 sequences per step, split over data-parallel ranks and
micro-batches so that every layout computes the same global loss. Dropout is 0, so the losses are
a deterministic function of weights, optimizer state, scheduler state and step.

Steps are numbered from 1: "step k" runs forward/backward on batch k (its reported loss comes from
the weights before update k), then updates. The assertions live in the pytest files.
"""

from __future__ import annotations

import os
import random
from pathlib import Path

import torch

from tests.support.torchrun_utils import reporting

GLOBAL_BATCH = 4
SEQ_LEN = 16
VOCAB = 300
LR = 3e-3


def _batch(step: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ_LEN + 1), generator=torch.Generator().manual_seed(1000 + step))


def setup(model_dir: str, layout_spec: dict, distributed_optimizer: bool = True, load_hf: bool = True):
    """(ctx, models, optimizer, scheduler) for one layout, weights from the HF checkpoint."""
    from megatron_dapo.distributed import ParallelLayout, init_distributed

    layout = ParallelLayout(tp=layout_spec["tp"], pp=layout_spec["pp"], vpp=layout_spec.get("vpp"))
    ctx = init_distributed(layout, timeout_s=240, seed=5)
    models, optimizer, scheduler = build_training(model_dir, ctx.layout, distributed_optimizer, load_hf)
    return ctx, models, optimizer, scheduler


def build_training(model_dir: str, layout, distributed_optimizer: bool = True, load_hf: bool = True):
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    from megatron_dapo.model.builder import build_gpt_models
    from megatron_dapo.model.hf_config import read_hf_config
    from megatron_dapo.model.load import load_hf_into_megatron

    cfg = read_hf_config(model_dir)
    models = build_gpt_models(cfg, layout, torch.float32, transformer_engine="off", init_weights=not load_hf)
    if load_hf:
        load_hf_into_megatron(models, model_dir, cfg)
    config = models[0].config
    config.finalize_model_grads_func = finalize_model_grads
    ddp_config = DistributedDataParallelConfig(use_distributed_optimizer=distributed_optimizer)
    models = [DistributedDataParallel(config, ddp_config, m, disable_bucketing=i > 0) for i, m in enumerate(models)]
    optimizer = get_megatron_optimizer(
        OptimizerConfig(
            optimizer="adam", lr=LR, min_lr=LR / 10, weight_decay=0.01, clip_grad=1.0,
            use_distributed_optimizer=distributed_optimizer, params_dtype=torch.float32, bf16=False, fp16=False,
        ),
        models,
    )  # fmt: skip
    scheduler = OptimizerParamScheduler(
        optimizer, init_lr=0.0, max_lr=LR, min_lr=LR / 10, lr_warmup_steps=2, lr_decay_steps=10,
        lr_decay_style="linear", start_wd=0.01, end_wd=0.01, wd_incr_steps=10, wd_incr_style="constant",
    )  # fmt: skip
    return models, optimizer, scheduler


def train_step(models, optimizer, scheduler, step: int) -> float:
    """One optimizer step on batch `step`; returns the global mean loss (same on every rank)."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    from megatron_dapo.model.builder import causal_attention_mask

    dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    per_rank = GLOBAL_BATCH // dp
    tokens = _batch(step)[dp_rank * per_rank : (dp_rank + 1) * per_rank]
    micro = [(tokens[i : i + 1, :-1], tokens[i : i + 1, 1:]) for i in range(per_rank)]
    mask = causal_attention_mask(SEQ_LEN)
    position_ids = torch.arange(SEQ_LEN).unsqueeze(0)

    def forward_step(data_iterator, model):
        inputs, labels = next(data_iterator)
        output = model(inputs, position_ids, mask)

        def loss_func(logits):
            # Cross entropy over the real vocabulary only: Megatron's own loss also normalises over
            # the TP-dependent padding rows, which would make the loss differ between layouts.
            full = gather_from_tensor_model_parallel_region(logits)[..., :VOCAB].float()
            loss = torch.nn.functional.cross_entropy(full.reshape(-1, VOCAB), labels.t().reshape(-1))
            return loss, {"loss": loss.detach().clone()}  # clone: the schedule rescales `loss` in place

        return output, loss_func

    for model in models:
        model.zero_grad_buffer()
    optimizer.zero_grad()
    iterators = [iter(micro) for _ in models]
    results = get_forward_backward_func()(
        forward_step_func=forward_step,
        data_iterator=iterators if len(models) > 1 else iterators[0],
        model=models if len(models) > 1 else models[0],
        num_microbatches=per_rank,
        seq_length=SEQ_LEN,
        micro_batch_size=1,
        forward_only=False,
    )
    ok, _, _ = optimizer.step()
    assert ok, "optimizer step skipped"
    scheduler.step(increment=1)
    # Mean over micro-batches on the last stage, then over the whole world (last-stage ranks only).
    local = torch.stack([r["loss"] for r in results]).mean() if ps.is_pipeline_last_stage(ignore_virtual=True) else torch.zeros(())
    contributors = ps.get_tensor_model_parallel_world_size() * dp
    total = local.double().reshape(1)
    dist.all_reduce(total)
    return float(total.item() / contributors)


def _rng_draw() -> list[float]:
    import numpy as np

    return [random.random(), float(np.random.rand()), float(torch.rand(()).item())]


def train_and_save(model_dir: str, root: str, layout: dict, weights_root: str, local_root: str, dp_root: str,
                   dp4_root: str, ms_root: str) -> dict:
    """Steps 1-2 (saving after each, keep_last=1), steps 3-4 (reference), then a save that fails mid-way.

    `root` gets fully_reshardable checkpoints (resumable at any layout), `dp_root` dp_reshardable ones
    of the same steps (keep_last=0: the corruption test falls back to step 1), `ms_root` step 2 in
    fully_sharded_model_space (every rank writes its part, resumable at any layout). Before training, a
    model-only checkpoint (no optimizer / scheduler) goes to `weights_root`. Afterwards the same run
    with the non-distributed optimizer saves step 2 to `local_root`; then a run at TP=PP=1 (DP=4)
    saves step 2 dp_reshardable to `dp4_root` (resumed at DP=1 by `resume_then_crash`).
    """
    from megatron.core import parallel_state as ps

    from megatron_dapo.checkpoint import core
    from megatron_dapo.checkpoint.core import CheckpointError, save_checkpoint
    from megatron_dapo.distributed import teardown

    out = {}
    with reporting(out):
        ctx, models, optimizer, scheduler = setup(model_dir, layout)
        out["dp_rank"] = ps.get_data_parallel_rank()
        save_checkpoint(weights_root, 0, models)
        losses = {}
        for step in (1, 2):
            losses[step] = train_step(models, optimizer, scheduler, step)
            save_checkpoint(root, step, models, optimizer, scheduler, keep_last=1, hf_dir=model_dir,
                            trainer_state={"next_step": step + 1, "losses": dict(losses)},
                            config={"layout": layout, "lr": LR}, optimizer_format="fully_reshardable")  # fmt: skip
            save_checkpoint(dp_root, step, models, optimizer, scheduler, hf_dir=model_dir,
                            trainer_state={"next_step": step + 1, "losses": dict(losses)},
                            config={"layout": layout, "lr": LR}, optimizer_format="dp_reshardable")  # fmt: skip
        save_checkpoint(ms_root, 2, models, optimizer, scheduler, hf_dir=model_dir,
                        trainer_state={"next_step": 3, "losses": dict(losses)},
                        config={"layout": layout, "lr": LR}, optimizer_format="fully_sharded_model_space")  # fmt: skip
        out["rng_after_save"] = _rng_draw()
        for step in (3, 4):
            losses[step] = train_step(models, optimizer, scheduler, step)
        out["losses"] = losses

        def failing_metadata(directory, metadata):
            raise RuntimeError("injected failure while writing metadata.json")

        original = core._write_checkpoint_metadata
        core._write_checkpoint_metadata = failing_metadata
        try:
            save_checkpoint(root, 4, models, optimizer, scheduler, keep_last=1)
            out["failed_save"] = "no error"
        except (RuntimeError, CheckpointError) as err:
            out["failed_save"] = f"{type(err).__name__}: {err}"
        finally:
            core._write_checkpoint_metadata = original

        models, optimizer, scheduler = build_training(model_dir, ctx.layout, distributed_optimizer=False)
        local_losses = {}
        for step in (1, 2, 3, 4):
            local_losses[step] = train_step(models, optimizer, scheduler, step)
            if step == 2:
                save_checkpoint(local_root, step, models, optimizer, scheduler)
        out["local_losses"] = local_losses
        out["rank"] = ctx.rank

        teardown(keep_process_group=True)
        _, models, optimizer, scheduler = setup(model_dir, {"tp": 1, "pp": 1})
        dp4_losses = {}
        for step in (1, 2, 3, 4):
            dp4_losses[step] = train_step(models, optimizer, scheduler, step)
            if step == 2:
                save_checkpoint(dp4_root, step, models, optimizer, scheduler, optimizer_format="dp_reshardable")
        out["dp4_losses"] = dp4_losses


def resume_then_crash(model_dir: str, root: str, dp4_root: str) -> None:
    """Single process (TP=PP=DP=1): resume from `root`, one step; resume the DP=4 dp_reshardable
    checkpoint in `dp4_root` (a DP-only change), two steps; then die half-way through saving step 3."""
    from megatron_dapo.checkpoint import core
    from megatron_dapo.checkpoint.core import load_checkpoint, save_checkpoint
    from tests.support.torchrun_utils import write_rank_result

    ctx, models, optimizer, scheduler = setup(model_dir, {"tp": 1, "pp": 1})
    loaded = load_checkpoint(root, models, optimizer, scheduler)
    loss3 = train_step(models, optimizer, scheduler, 3)
    dp_models, dp_optimizer, dp_scheduler = build_training(model_dir, ctx.layout, load_hf=False)
    dp_loaded = load_checkpoint(dp4_root, dp_models, dp_optimizer, dp_scheduler)
    dp_losses = {step: train_step(dp_models, dp_optimizer, dp_scheduler, step) for step in (3, 4)}
    write_rank_result({"step": loaded.step, "loss3": loss3, "notes": loaded.notes, "rng_restored": loaded.rng_restored,
                       "dp4_step": dp_loaded.step, "dp4_losses": dp_losses, "dp4_optimizer_loaded": dp_loaded.optimizer_loaded})  # fmt: skip

    def die(directory, metadata):
        os._exit(17)  # the process vanishes: no exception handler, no clean-up

    core._write_checkpoint_metadata = die
    save_checkpoint(root, 3, models, optimizer, scheduler, keep_last=1)


def _corrupt_copy(source: str, target: str) -> str:
    """Rank 0: copy the checkpoint root `source` to `target` and write 4 KiB of garbage into the middle
    of one data file of its newest checkpoint (rank 1's); every rank returns the file's name."""
    import shutil

    import torch.distributed as dist

    from megatron_dapo.checkpoint.layout import find_latest

    if dist.get_rank() == 0:
        shutil.copytree(source, target)
        victim = sorted((find_latest(target) / "dist").glob("__1_*.distcp"), key=lambda p: p.stat().st_size)[-1]
        with open(victim, "r+b") as handle:
            handle.seek(victim.stat().st_size // 2)
            handle.write(random.Random(0).randbytes(4096))
        name = f"{victim.parent.parent.name}/dist/{victim.name}"
    else:
        name = None
    box = [name]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _optimizer_digest(optimizer) -> str:
    """SHA-256 of this rank's optimizer state in its own order: fp32 main parameters and Adam's moments."""
    import hashlib

    digest = hashlib.sha256()
    for inner in getattr(optimizer, "chained_optimizers", None) or [optimizer]:
        for group in inner.optimizer.param_groups:
            for param in group["params"]:
                state = inner.optimizer.state.get(param, {})
                for tensor in (param, state.get("exp_avg"), state.get("exp_avg_sq")):
                    if tensor is not None:
                        digest.update(tensor.detach().float().cpu().contiguous().numpy().tobytes())
    return digest.hexdigest()


def resume_layouts(model_dir: str, root: str, layouts: list, qwen3_dir: str, weights_only_dir: str, local_root: str,
                   dp_root: str, ms_root: str) -> None:
    """For each layout: fresh model + optimizer, load the latest checkpoint, the steps after it up to 4.
    Then error cases.

    A layout's "source": "root" (fully_reshardable, the default), "local" (the non-distributed run in
    `local_root`), "dp" (dp_reshardable, `dp_root`), "ms" (fully_sharded_model_space, `ms_root`) or
    "dp_corrupt" (a copy of `dp_root` whose newest checkpoint has garbage in one file:
    `load_latest_checkpoint` must fall back to the one before). Each entry records a digest of the
    optimizer state as loaded.
    """
    from megatron_dapo.checkpoint.core import load_checkpoint, load_latest_checkpoint
    from megatron_dapo.checkpoint.torch_dist import CheckpointLayoutError, CheckpointMismatchError
    from megatron_dapo.distributed import teardown

    out: dict = {"layouts": {}}
    with reporting(out):
        for index, spec in enumerate(layouts):
            if index:
                teardown(keep_process_group=True)
            ctx, models, optimizer, scheduler = setup(
                model_dir, spec, distributed_optimizer=spec.get("source") != "local", load_hf=False
            )
            source = {"local": local_root, "dp": dp_root, "ms": ms_root}.get(spec.get("source"), root)
            corrupted = None
            if spec.get("source") == "dp_corrupt":
                source = str(Path(dp_root).parent / "dp_corrupt")
                corrupted = _corrupt_copy(dp_root, source)
                loaded = load_latest_checkpoint(source, models, optimizer, scheduler)
            else:
                loaded = load_checkpoint(source, models, optimizer, scheduler, load_optimizer=spec.get("load_optimizer", True))
            entry = {
                "corrupted": corrupted,
                "skipped": loaded.skipped,
                "step": loaded.step,
                "path": str(loaded.path),
                "rng_restored": loaded.rng_restored,
                "rng_draw": _rng_draw(),
                "scheduler_loaded": loaded.scheduler_loaded,
                "optimizer_loaded": loaded.optimizer_loaded,
                "notes": loaded.notes,
                "trainer_state": loaded.trainer_state,
                "config": loaded.metadata.get("config"),
                "optimizer_sharding": loaded.metadata["contents"].get("optimizer_sharding"),
                "optimizer_digest": _optimizer_digest(optimizer),
                "losses": {},
            }
            for step in range(loaded.step + 1, 5):
                entry["losses"][step] = train_step(models, optimizer, scheduler, step)
            out["layouts"][spec["name"]] = entry

        # Error cases at the last layout.
        errors = {}
        models, optimizer, _ = build_training(qwen3_dir, ctx.layout, load_hf=False)
        try:
            load_checkpoint(root, models, optimizer)
        except CheckpointMismatchError as err:
            errors["other_model"] = str(err)
        models, optimizer, _ = build_training(model_dir, ctx.layout, distributed_optimizer=True, load_hf=False)
        try:
            load_checkpoint(weights_only_dir, models, optimizer)
        except CheckpointMismatchError as err:
            errors["no_optimizer_state"] = str(err)
        loaded = load_checkpoint(weights_only_dir, models, optimizer, load_optimizer=False)
        errors["weights_only_step"] = loaded.step
        models, optimizer, _ = build_training(model_dir, ctx.layout, distributed_optimizer=False, load_hf=False)
        try:
            load_checkpoint(root, models, optimizer)
        except CheckpointMismatchError as err:
            errors["optimizer_kind"] = str(err)
        # dp_reshardable state saved at TP=1 x PP=2 asked for at this layout (TP=2 x PP=1).
        models, optimizer, _ = build_training(model_dir, ctx.layout, load_hf=False)
        try:
            load_checkpoint(dp_root, models, optimizer)
        except CheckpointLayoutError as err:
            errors["dp_layout"] = str(err)
        errors["dp_weights_only_step"] = load_checkpoint(dp_root, models, optimizer, load_optimizer=False).step
        out["errors"] = errors


# ------------------------------------------------------------------ damaged checkpoints (one process)


def _largest_distcp(checkpoint: Path) -> Path:
    return max((checkpoint / "dist").glob("*.distcp"), key=lambda p: (p.stat().st_size, p.name))


def _garbage_inside(path: Path) -> None:
    with open(path, "r+b") as handle:
        handle.seek(path.stat().st_size // 2)
        handle.write(random.Random(1).randbytes(4096))


def _truncate(path: Path) -> None:
    with open(path, "r+b") as handle:
        handle.truncate(path.stat().st_size // 2)


def _strip_checksums(checkpoint: Path) -> None:
    import json

    meta_file = checkpoint / "metadata.json"
    meta = json.loads(meta_file.read_text())
    meta.pop("files"), meta.pop("checksum")
    meta["format_version"] = 1
    meta_file.write_text(json.dumps(meta))


class _Payload:
    """A pickle that runs code when loaded: it creates `marker`."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (open, (str(self.marker), "w"))


def _damage(case: str, root: Path) -> str:
    """Damage the copy `root` (steps 1 and 2) as `case` says; returns what was damaged."""
    step1, step2 = root / "step_00000001", root / "step_00000002"
    if case == "garbage_in_distcp":
        victim = _largest_distcp(step2)
        _garbage_inside(victim)
    elif case == "truncated_distcp":
        victim = _largest_distcp(step2)
        _truncate(victim)
    elif case == "garbage_latest":
        victim = root / "latest"
        victim.write_bytes(random.Random(2).randbytes(64))
    elif case == "bad_trainer_state":
        victim = step2 / "trainer_state.json"
        victim.write_text('{"step": 2, "sampler": ')
    elif case == "missing_common_pt":
        victim = step2 / "dist" / "common.pt"
        if not victim.exists():
            return "absent"  # megatron-core 0.19 keeps the common state inside the .distcp files
        victim.unlink()
    elif case == "latest_to_missing_dir":
        victim = root / "latest"
        victim.write_text("step_00000009\n")
    elif case == "missing_metadata_json":
        victim = step2 / "metadata.json"
        victim.unlink()
    elif case == "old_format_missing_common_pt":  # a checkpoint written before checksums existed
        _strip_checksums(step2)
        victim = step2 / "dist" / "common.pt"
        if not victim.exists():
            return "absent"
        victim.unlink()
    elif case == "planted_rng_pickle":  # someone with write access to the scratch directory, manifest edited too
        _strip_checksums(step2)
        victim = step2 / "rng" / "rank_00000.pt"
        torch.save({"payload": _Payload(root / "PAYLOAD_RAN")}, victim)
    elif case == "all_damaged":
        for step in (step1, step2):
            _truncate(_largest_distcp(step))
        return "both"
    elif case == "intact":
        return "nothing"
    else:
        raise ValueError(case)
    return victim.relative_to(root).as_posix()


def damaged_checkpoints(model_dir: str, root: str, work: str, cases: list) -> dict:
    """One process: steps 1-2 saved dp_reshardable (trainer state with step and sampler), step 3 the
    reference; then for each case a copy of `root` damaged that way, resumed into fresh models with
    `load_latest_checkpoint`, and the step after the loaded one trained (its loss proves what loaded).
    Then a damaged checkpoint named directly (`load_checkpoint`, with and without `verify`)."""
    import shutil

    from megatron_dapo.checkpoint.core import load_checkpoint, load_latest_checkpoint, save_checkpoint

    ctx, models, optimizer, scheduler = setup(model_dir, {"tp": 1, "pp": 1})
    out: dict = {"losses": {}, "cases": {}, "direct": {}}
    for step in (1, 2, 3):
        out["losses"][step] = train_step(models, optimizer, scheduler, step)
        if step < 3:
            save_checkpoint(root, step, models, optimizer, scheduler, trainer_state={"step": step, "sampler": {"at": step}})
    for case in cases:
        target = Path(work) / case
        shutil.copytree(root, target)
        entry: dict = {"damaged": _damage(case, target)}
        fresh = build_training(model_dir, ctx.layout, load_hf=False)
        try:
            loaded = load_latest_checkpoint(target, *fresh, required_state=("step", "sampler"))
            entry.update(step=loaded.step, skipped=loaded.skipped, notes=loaded.notes)
            entry["next_loss"] = train_step(*fresh, loaded.step + 1)
        except Exception as err:  # what the test asserts on: the type and the message
            entry["error"] = f"{type(err).__name__}: {err}"
            entry["error_types"] = [c.__name__ for c in type(err).__mro__]
        entry["payload_ran"] = (target / "PAYLOAD_RAN").exists()
        out["cases"][case] = entry

    target = Path(work) / "direct"
    shutil.copytree(root, target)
    common = target / "step_00000002" / "dist" / "common.pt"
    if common.exists():
        common.unlink()
    else:
        out["direct"]["missing_common"] = "absent"
    _garbage_inside(_largest_distcp(target / "step_00000001"))
    for name, path, verify in (("missing_common", target / "step_00000002", False), ("corrupt", target / "step_00000001", True)):
        if name in out["direct"]:
            continue
        fresh = build_training(model_dir, ctx.layout, load_hf=False)
        try:
            load_checkpoint(path, fresh[0], fresh[1], fresh[2], verify=verify)
            out["direct"][name] = "loaded"
        except Exception as err:
            out["direct"][name] = f"{type(err).__name__}: {err}"
    return out
