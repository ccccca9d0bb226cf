"""Workers for the conversion tests (run through tests/support/torchrun_utils.py, not by pytest).

`convert_all` runs in one plain Python process (conversion is single-process by design and
initialises Megatron's parallel state in the process that calls it, which the pytest process must
not do). `load_layouts` runs under torchrun: it loads converted checkpoints at several layouts in
one launch and compares Megatron's logits with HF transformers'. Raw numbers go back to pytest.
"""

from __future__ import annotations

from pathlib import Path

import torch

from tests.support.torchrun_utils import reporting


def convert_all(hf_dirs: dict, out_root: str, shard_sizes: dict, tampered: dict) -> dict:
    """HF -> Megatron (--tp 2 --pp 2) -> HF for every architecture; then a tampered-weights logits check."""
    from megatron_dapo.checkpoint.conversion import ConversionError, convert_hf_to_megatron, convert_megatron_to_hf, verify_logits_against_hf

    out: dict = {"archs": {}}
    with reporting(out, teardown=False):
        for arch, hf_dir in hf_dirs.items():
            megatron_dir = Path(out_root) / arch / "megatron"
            megatron_dir.mkdir(parents=True)
            (megatron_dir / "stale_file").write_text("left from an earlier run")  # --overwrite removes it
            there = convert_hf_to_megatron(hf_dir, megatron_dir, tp=2, pp=2, overwrite=True, progress=False)
            back = convert_megatron_to_hf(megatron_dir, Path(out_root) / arch / "hf", max_shard_size=shard_sizes[arch], progress=False)
            out["archs"][arch] = {"megatron_files": there.files, "hf_files": back.files, "tensors": back.tensors}
        # --dtype casts on the way in; the way back keeps the stored dtype.
        first = next(iter(hf_dirs))
        cast_dir = Path(out_root) / "bf16" / "megatron"
        convert_hf_to_megatron(hf_dirs[first], cast_dir, dtype="bfloat16", progress=False)
        convert_megatron_to_hf(cast_dir, Path(out_root) / "bf16" / "hf", progress=False)
        out["bf16_arch"] = first
        # A checkpoint converted from weights with one layer changed, checked against the original model.
        bad_dir = Path(out_root) / "tampered" / "megatron"
        convert_hf_to_megatron(tampered["hf_dir"], bad_dir, progress=False)
        try:
            verify_logits_against_hf(bad_dir, tampered["reference_dir"])
            out["tampered"] = "no error"
        except ConversionError as err:
            out["tampered"] = str(err)


def _stored(directory: Path) -> dict:
    from megatron_dapo.checkpoint.torch_dist import stored_entries

    result = {}
    for key, meta in stored_entries(directory).items():
        size = getattr(meta, "size", None)
        result[key] = None if size is None else [list(size), str(meta.properties.dtype)]
    return result


def load_layouts(checkpoints: dict, hf_dirs: dict, layouts: list, megatron_save_root: str) -> None:
    """Per layout and architecture: load the converted checkpoint, max |logits - HF logits|.

    In the first layout, also save the HF-loaded model with Megatron's own sharded state dict and
    report both checkpoints' key -> (global shape, dtype) maps (rank 0) for comparison.
    """
    from tests.support.tiny_models import load_hf_model

    from megatron_dapo.checkpoint.core import load_checkpoint, model_sharded_state_dict
    from megatron_dapo.checkpoint.layout import DIST_DIR
    from megatron_dapo.checkpoint.torch_dist import save_sharded
    from megatron_dapo.distributed import ParallelLayout, init_distributed, teardown
    from megatron_dapo.model.builder import build_gpt_models, check_against_hf
    from megatron_dapo.model.debug import megatron_logits
    from megatron_dapo.model.hf_config import read_hf_config
    from megatron_dapo.model.load import load_hf_into_megatron

    out: dict = {"layouts": {}, "formats": {}}
    input_ids = torch.randint(0, 300, (4, 20), generator=torch.Generator().manual_seed(7))
    reference = {}
    with reporting(out):
        for index, spec in enumerate(layouts):
            if index:
                teardown(keep_process_group=True)
            ctx = init_distributed(ParallelLayout(spec["tp"], spec["pp"], spec.get("vpp")), timeout_s=240, seed=3)
            entry = {}
            for arch, checkpoint in checkpoints.items():
                cfg = read_hf_config(hf_dirs[arch])
                if arch not in reference:
                    with torch.no_grad():
                        reference[arch] = load_hf_model(Path(hf_dirs[arch]))(input_ids=input_ids).logits
                models = build_gpt_models(cfg, ctx.layout, torch.float32, transformer_engine="off", init_weights=True)
                check_against_hf(models, cfg)
                loaded = load_checkpoint(checkpoint, models)
                logits = megatron_logits(models, input_ids, vocab_size=cfg.vocab_size)
                entry[arch] = {
                    "max_abs_diff": float((logits - reference[arch]).abs().max()),
                    "step": loaded.step,
                    "notes": loaded.notes,
                }
                if index == 0:  # Megatron's own save of the same weights, for the format comparison
                    models = build_gpt_models(cfg, ctx.layout, torch.float32, transformer_engine="off", init_weights=False)
                    load_hf_into_megatron(models, hf_dirs[arch], cfg)
                    target = Path(megatron_save_root) / arch
                    if ctx.rank == 0:
                        target.mkdir(parents=True)
                    torch.distributed.barrier()
                    save_sharded(model_sharded_state_dict(models), target)
                    if ctx.rank == 0:
                        out["formats"][arch] = {"megatron": _stored(target), "converted": _stored(Path(checkpoint) / DIST_DIR)}
            out["layouts"][spec["name"]] = entry
