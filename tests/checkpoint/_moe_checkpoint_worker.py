"""Workers for the mixture-of-experts checkpoint tests (run through tests/support/torchrun_utils.py, not by pytest).

`convert_moe` and `export_checkpoints` run in one plain Python process each (conversion is
single-process): HF -> Megatron (recorded for TP=2 x EP=2, checked with the logits check) -> HF,
and saved training checkpoints -> HF. `expert_parallel_layouts` runs under torchrun: per layout it
loads the converted checkpoint (logits vs HF) and saves the HF-loaded model as a training
checkpoint at that layout. `optimizer_state_across_expert_layouts` (torchrun) saves a trained MoE's
optimizer state in both fully reshardable formats and loads each at other expert-parallel layouts.
Raw results go back to pytest.
"""

from __future__ import annotations

from pathlib import Path

import torch

from tests.support.torchrun_utils import reporting, write_rank_result


def convert_moe(hf_dirs: dict, out_root: str) -> None:
    """HF -> Megatron (ep=2, tp=2) -> HF for every architecture, and the refusal of an EP that does not divide."""
    from megatron_dapo.checkpoint.conversion import convert_hf_to_megatron, convert_megatron_to_hf

    out: dict = {"archs": {}}
    with reporting(out, teardown=False):
        for arch, hf_dir in hf_dirs.items():
            megatron_dir = Path(out_root) / arch / "megatron"
            there = convert_hf_to_megatron(hf_dir, megatron_dir, tp=2, ep=2, verify_logits=True, verify_tol=1e-5, progress=False)
            back = convert_megatron_to_hf(megatron_dir, Path(out_root) / arch / "hf", progress=False)
            out["archs"][arch] = {"notes": there.notes, "tensors": back.tensors}
        first = next(iter(hf_dirs.values()))
        try:
            convert_hf_to_megatron(first, Path(out_root) / "ep3", ep=3, progress=False)
            out["ep3"] = "no error"
        except ValueError as err:
            out["ep3"] = f"{type(err).__name__}: {err}"
        out["ep3_output_exists"] = (Path(out_root) / "ep3").exists()



def export_checkpoints(checkpoints: dict, export_root: str) -> None:
    """Every {layout: {arch: checkpoint}} to HF under export_root/layout/arch."""
    from megatron_dapo.checkpoint.conversion import convert_megatron_to_hf

    out: dict = {"exports": {}}
    with reporting(out, teardown=False):
        for layout, by_arch in checkpoints.items():
            for arch, path in by_arch.items():
                target = Path(export_root) / layout / arch
                report = convert_megatron_to_hf(path, target, progress=False)
                out["exports"].setdefault(layout, {})[arch] = {"dir": str(target), "tensors": report.tensors}


def expert_parallel_layouts(checkpoints: dict, hf_dirs: dict, layouts: list, save_root: str) -> None:
    """Per layout {name, tp, pp, ep, dispatcher} and architecture: load the converted checkpoint
    (max |logits - HF logits|) and save the HF-loaded model as a training checkpoint."""
    from tests.support.tiny_models import load_hf_model

    from megatron_dapo.checkpoint.core import load_checkpoint, save_checkpoint
    from megatron_dapo.distributed.layout import ParallelLayout
    from megatron_dapo.distributed import init_distributed, teardown
    from megatron_dapo.model.builder import build_gpt_models, check_against_hf
    from megatron_dapo.model.debug import megatron_logits
    from megatron_dapo.model.hf_config import read_hf_config
    from megatron_dapo.model.load import load_hf_into_megatron

    out: dict = {"layouts": {}}
    input_ids = torch.randint(0, 300, (4, 20), generator=torch.Generator().manual_seed(7))
    reference = {}
    for arch, hf_dir in hf_dirs.items():
        with torch.no_grad():
            reference[arch] = load_hf_model(Path(hf_dir))(input_ids=input_ids).logits
    try:
        for index, spec in enumerate(layouts):
            if index:
                teardown(keep_process_group=True)
            parallel = ParallelLayout(tp=spec.get("tp", 1), pp=spec.get("pp", 1), ep=spec["ep"])
            ctx = init_distributed(parallel, timeout_s=240, seed=3)
            entry = {}
            for arch, checkpoint in checkpoints.items():
                cfg = read_hf_config(hf_dirs[arch])

                def build(init_weights: bool):
                    models = build_gpt_models(cfg, ctx.layout, torch.float32, transformer_engine="off",
                                              init_weights=init_weights, moe_token_dispatcher=spec["dispatcher"])  # fmt: skip
                    check_against_hf(models, cfg)
                    return models

                models = build(init_weights=True)
                load_checkpoint(checkpoint, models)
                logits = megatron_logits(models, input_ids, vocab_size=cfg.vocab_size)
                models = build(init_weights=False)
                load_hf_into_megatron(models, hf_dirs[arch], cfg)
                root = Path(save_root) / spec["name"] / arch
                path = save_checkpoint(root, 1, models, hf_dir=hf_dirs[arch])
                entry[arch] = {"max_abs_diff": float((logits - reference[arch]).abs().max()), "saved": str(path)}
            out["layouts"][spec["name"]] = entry
    finally:
        write_rank_result(out)
        teardown()


def optimizer_state_across_expert_layouts(model_dir: str, root: str, save: dict, loads: list) -> None:
    """Train a MoE 2 steps at `save` {tp, pp, ep} with the distributed optimizer, save step 2 in both
    fully reshardable formats (`root`/<format>), train step 3 (the reference); then per layout of
    `loads` and per format: fresh models and optimizer, load, digest of the optimizer state as loaded,
    step 3's loss (a layout with "refused": the CheckpointMismatchError's message). Before that, the
    non-distributed optimizer at `save`: step 1, saved, step 2 (reference), then resumed into fresh
    models and step 2 again."""
    from megatron_dapo.checkpoint.core import load_checkpoint, save_checkpoint
    from megatron_dapo.checkpoint.torch_dist import CheckpointMismatchError
    from megatron_dapo.distributed import init_distributed, teardown
    from megatron_dapo.distributed.layout import ParallelLayout
    from tests.checkpoint._train_worker import _optimizer_digest, build_training, train_step

    formats = ("fully_reshardable", "fully_sharded_model_space")

    def layout(spec: dict):
        parallel = ParallelLayout(tp=spec.get("tp", 1), pp=spec.get("pp", 1), ep=spec["ep"])
        return init_distributed(parallel, timeout_s=240, seed=5).layout

    out: dict = {"loads": {}}
    with reporting(out):
        ctx_layout = [layout(save)]
        models, optimizer, scheduler = build_training(model_dir, ctx_layout[0])
        out["losses"] = {step: train_step(models, optimizer, scheduler, step) for step in (1, 2)}
        for fmt in formats:
            save_checkpoint(Path(root) / fmt, 2, models, optimizer, scheduler, optimizer_format=fmt)
        out["losses"][3] = train_step(models, optimizer, scheduler, 3)
        # The non-distributed optimizer (a chain of two at EP > 1): resumes at the same layout.
        models, optimizer, scheduler = build_training(model_dir, ctx_layout[0], distributed_optimizer=False)
        train_step(models, optimizer, scheduler, 1)
        save_checkpoint(Path(root) / "local", 1, models, optimizer, scheduler)
        out["local"] = {"reference": train_step(models, optimizer, scheduler, 2)}
        models, optimizer, scheduler = build_training(model_dir, ctx_layout[0], distributed_optimizer=False, load_hf=False)
        out["local"]["optimizer_loaded"] = load_checkpoint(Path(root) / "local", models, optimizer, scheduler).optimizer_loaded
        out["local"]["resumed"] = train_step(models, optimizer, scheduler, 2)
        for spec in loads:
            teardown(keep_process_group=True)
            parallel = layout(spec)
            entry = {}
            for fmt in formats:
                models, optimizer, scheduler = build_training(model_dir, parallel, load_hf=False)
                if spec.get("refused"):
                    try:
                        load_checkpoint(Path(root) / fmt, models, optimizer, scheduler)
                        entry[fmt] = {"error": None}
                    except CheckpointMismatchError as err:
                        entry[fmt] = {"error": str(err)}
                    continue
                loaded = load_checkpoint(Path(root) / fmt, models, optimizer, scheduler)
                entry[fmt] = {"step": loaded.step, "sharding": loaded.metadata["contents"]["optimizer_sharding"],
                              "digest": _optimizer_digest(optimizer), "loss3": train_step(models, optimizer, scheduler, 3)}  # fmt: skip
            out["loads"][spec["name"]] = entry
