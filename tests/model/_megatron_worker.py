"""Worker for the multi-process model tests (run through tests/support/torchrun_utils.py, not by pytest).

`run_layouts` builds every tiny architecture under each requested parallel layout in ONE launch
(start-up of torch + Megatron + transformers dominates on a 2-core machine), loads the HF weights,
compares Megatron's logits with HF transformers' and exports the weights back to HF names. It
writes the raw numbers per rank; the assertions live in the pytest file.
"""

from __future__ import annotations

import hashlib
import traceback
from pathlib import Path

import torch


def _group_ranks(getter) -> list[int]:
    import torch.distributed as dist

    return sorted(dist.get_process_group_ranks(getter()))


def _check_export(models, cfg, model_dir: str, hf_model) -> dict:
    from safetensors import safe_open

    from megatron_dapo.model.load import export_megatron_to_hf

    saved_names = set()
    for file in Path(model_dir).glob("*.safetensors"):
        with safe_open(str(file), framework="pt") as handle:
            saved_names.update(handle.keys())
    reference = hf_model.state_dict()
    names, mismatched = [], []
    for name, tensor in export_megatron_to_hf(models, cfg):
        names.append(name)
        ref = reference.get(name)
        if ref is None or ref.dtype != tensor.dtype or not torch.equal(tensor.cpu(), ref):
            mismatched.append(name)
    return {
        "export_count": len(names),
        "export_names_equal_saved": sorted(names) == sorted(saved_names),
        "export_duplicates": len(names) - len(set(names)),
        "export_mismatched": mismatched,
        "export_order_sha": hashlib.sha1("\n".join(names).encode()).hexdigest(),
    }


def _run_arch(arch: str, model_dir: str, layout, input_ids, hf_cache: dict) -> dict:
    from tests.support.tiny_models import load_hf_model

    from megatron_dapo.model.builder import build_gpt_models, check_against_hf
    from megatron_dapo.model.debug import megatron_logits
    from megatron_dapo.model.hf_config import read_hf_config
    from megatron_dapo.model.load import load_hf_into_megatron

    cfg = read_hf_config(model_dir)
    if arch not in hf_cache:
        hf_model = load_hf_model(Path(model_dir))
        with torch.no_grad():
            hf_cache[arch] = (hf_model, hf_model(input_ids=input_ids).logits)
    hf_model, hf_logits = hf_cache[arch]
    models = build_gpt_models(cfg, layout, torch.float32, transformer_engine="off", init_weights=False)
    check_against_hf(models, cfg)
    written = load_hf_into_megatron(models, model_dir, cfg)
    logits = megatron_logits(models, input_ids, vocab_size=cfg.vocab_size)
    result = {
        "params_written": written,
        "num_params_local": sum(len(dict(m.named_parameters())) for m in models),
        "logits_shape": list(logits.shape),
        "max_abs_diff": float((logits - hf_logits).abs().max()),
        "hf_logits_absmax": float(hf_logits.abs().max()),
    }
    result.update(_check_export(models, cfg, model_dir, hf_model))
    return result


def _corrupted_layer_report(model_dir: str, layout, input_ids, hf_cache: dict, layer: int, arch: str) -> dict:
    """Load a model, perturb one global layer's MLP output weights where it lives, run debug.compare_with_hf."""
    from megatron_dapo.model.builder import build_gpt_models
    from megatron_dapo.model.debug import compare_with_hf
    from megatron_dapo.model.hf_config import read_hf_config
    from megatron_dapo.model.load import load_hf_into_megatron

    cfg = read_hf_config(model_dir)
    models = build_gpt_models(cfg, layout, torch.float32, transformer_engine="off", init_weights=False)
    load_hf_into_megatron(models, model_dir, cfg)
    for chunk in models:
        for block in chunk.decoder.layers:
            if block.layer_number - 1 == layer:
                with torch.no_grad():
                    block.mlp.linear_fc2.weight.add_(0.05)
    report = compare_with_hf(models, hf_cache[arch][0], input_ids, tol=1e-5)
    return {
        "summary": report.summary(),
        "first": None if report.first_divergence is None else report.first_divergence.label,
        "blocks": [[b.label, b.megatron_name, b.max_abs_diff] for b in report.blocks],
    }


def run_layouts(model_dirs: dict, layouts: list, batch: int = 4, seq_len: int = 24, corrupt: dict | None = None) -> dict:
    """For each layout {name, tp, pp, vpp}: every architecture in `model_dirs`; returns this rank's results.

    `corrupt` = {"layout": name, "arch": arch, "layer": i} also runs the divergence report with
    that layer perturbed (under that layout).
    """
    from megatron_dapo.distributed import ParallelLayout, init_distributed, teardown

    out: dict = {"layouts": {}}
    input_ids = torch.randint(0, 300, (batch, seq_len), generator=torch.Generator().manual_seed(1234))
    hf_cache: dict = {}
    ctx = None
    try:
        for spec in layouts:
            layout = ParallelLayout(tp=spec["tp"], pp=spec["pp"], vpp=spec.get("vpp"), cp=spec.get("cp", 1))
            if ctx is not None:
                teardown(keep_process_group=True)
            ctx = init_distributed(layout, timeout_s=240, seed=5)
            from megatron.core import parallel_state as ps  # after init_distributed enabled the CPU layer

            entry = {
                "rank": ctx.rank,
                "world_size": ctx.world_size,
                "launch": ctx.launch.source,
                "cpu_compat": ctx.cpu_compat,
                "groups": {
                    "tp": _group_ranks(ps.get_tensor_model_parallel_group),
                    "pp": _group_ranks(ps.get_pipeline_model_parallel_group),
                    "dp": _group_ranks(ps.get_data_parallel_group),
                    "cp": _group_ranks(ps.get_context_parallel_group),
                },
                "archs": {},
            }
            for arch, model_dir in model_dirs.items():
                try:
                    entry["archs"][arch] = _run_arch(arch, model_dir, ctx.layout, input_ids, hf_cache)
                except Exception:
                    entry["archs"][arch] = {"error": traceback.format_exc()}
                    raise
            if corrupt and corrupt["layout"] == spec["name"]:
                entry["corrupt"] = _corrupted_layer_report(
                    model_dirs[corrupt["arch"]], ctx.layout, input_ids, hf_cache, corrupt["layer"], corrupt["arch"]
                )
            out["layouts"][spec["name"]] = entry
    finally:
        from tests.support.torchrun_utils import write_rank_result

        write_rank_result(out)
        teardown()
    return None
