"""Worker for the mixture-of-experts model tests (run through tests/support/torchrun_utils.py, not by pytest).

`run_layouts` builds every tiny MoE architecture under each requested layout {name, tp, pp, ep,
dispatcher} in ONE launch, loads the HF weights, compares Megatron's logits with HF transformers'
and exports the weights back to HF names (compared with the saved safetensors: transformers holds
the experts fused in memory, its files name them one by one). It writes the raw numbers per rank;
the assertions live in the pytest file.
"""

from __future__ import annotations

import hashlib
import traceback
from pathlib import Path

import torch


def _saved_tensors(model_dir: str) -> dict:
    from safetensors.torch import load_file

    tensors: dict = {}
    for file in sorted(Path(model_dir).glob("*.safetensors")):
        tensors.update(load_file(str(file)))
    return tensors


def _group_ranks(getter) -> list[int]:
    import torch.distributed as dist

    return sorted(dist.get_process_group_ranks(getter()))


def _check_export(models, cfg, saved: dict) -> dict:
    from megatron_dapo.model.load import export_megatron_to_hf

    names, mismatched = [], []
    for name, tensor in export_megatron_to_hf(models, cfg):
        names.append(name)
        ref = saved.get(name)
        if ref is None or ref.dtype != tensor.dtype or not torch.equal(tensor.cpu(), ref):
            mismatched.append(name)
    return {
        "export_names_equal_saved": sorted(names) == sorted(saved),
        "export_duplicates": len(names) - len(set(names)),
        "export_mismatched": mismatched,
        "export_order_sha": hashlib.sha1("\n".join(names).encode()).hexdigest(),
    }


def _run_arch(model_dir: str, layout, dispatcher: str, input_ids, reference: dict) -> dict:
    from megatron_dapo.model.builder import build_gpt_models, check_against_hf
    from megatron_dapo.model.debug import megatron_logits
    from megatron_dapo.model.hf_config import read_hf_config
    from megatron_dapo.model.load import load_hf_into_megatron

    cfg = read_hf_config(model_dir)
    hf_logits, saved = reference[model_dir]
    models = build_gpt_models(
        cfg, layout, torch.float32, transformer_engine="off", init_weights=False, moe_token_dispatcher=dispatcher
    )
    check_against_hf(models, cfg)
    written = load_hf_into_megatron(models, model_dir, cfg)
    params = {n: p for m in models for n, p in m.named_parameters()}
    local_experts = sorted({n.split("local_experts.")[1].split(".")[0] for n in params if "local_experts." in n})
    logits = megatron_logits(models, input_ids, vocab_size=cfg.vocab_size)
    result = {
        "params_written": written,
        "num_params_local": len(params),
        "local_expert_ids": [int(e) for e in local_experts],
        "dispatcher": models[0].config.moe_token_dispatcher_type,
        "logits_shape": list(logits.shape),
        "max_abs_diff": float((logits - hf_logits).abs().max()),
        "hf_logits_absmax": float(hf_logits.abs().max()),
    }
    result.update(_check_export(models, cfg, saved))
    return result


def run_layouts(model_dirs: dict, layouts: list, batch: int = 4, seq_len: int = 22) -> None:
    """For each layout {name, tp, pp, ep, dispatcher}: every architecture in `model_dirs`; writes this rank's results."""
    from tests.support.tiny_models import load_hf_model

    from megatron_dapo.distributed import init_distributed, teardown
    from megatron_dapo.distributed.layout import ParallelLayout

    out: dict = {"layouts": {}}
    input_ids = torch.randint(0, 300, (batch, seq_len), generator=torch.Generator().manual_seed(1234))
    reference: dict = {}
    for model_dir in model_dirs.values():
        hf_model = load_hf_model(Path(model_dir))
        with torch.no_grad():
            reference[model_dir] = (hf_model(input_ids=input_ids).logits, _saved_tensors(model_dir))
        del hf_model
    ctx = None
    try:
        for spec in layouts:
            parallel = ParallelLayout(tp=spec.get("tp", 1), pp=spec.get("pp", 1), ep=spec.get("ep", 1))
            if ctx is not None:
                teardown(keep_process_group=True)
            ctx = init_distributed(parallel, timeout_s=240, seed=5)
            from megatron.core import parallel_state as ps  # after init_distributed enabled the CPU layer

            entry = {
                "rank": ctx.rank,
                "ep": ctx.layout.ep,
                "groups": {
                    "ep": _group_ranks(ps.get_expert_model_parallel_group),
                    "expert_tp": _group_ranks(ps.get_expert_tensor_parallel_group),
                    "expert_dp": _group_ranks(ps.get_expert_data_parallel_group),
                },
                "described": {
                    kind: next(g for g in ctx.layout.groups(kind) if ctx.rank in g)
                    for kind in ("ep", "expert_tp", "expert_dp")
                },
                "archs": {},
            }
            for arch, model_dir in model_dirs.items():
                try:
                    entry["archs"][arch] = _run_arch(model_dir, ctx.layout, spec["dispatcher"], input_ids, reference)
                except Exception:
                    entry["archs"][arch] = {"error": traceback.format_exc()}
                    raise
            out["layouts"][spec["name"]] = entry
    finally:
        from tests.support.torchrun_utils import write_rank_result

        write_rank_result(out)
        teardown()
