"""Worker for tests/actor/test_offload.py (run through tests/support/torchrun_utils.py, not collected by pytest).

`run_round_trips` (2 processes, gloo, real Megatron-Core): for each case {tp, dist_opt, dtype} two
identical actors A and B are built from the same tiny HF model. Both run the same updates; A's
state goes through `ActorOffload` round trips between them, B's never does. Per rank it reports:

* bytes moved per kind against what Megatron holds (DDP param / grad buffers, optimizer state);
* whether every storage of every offloaded kind had 0 bytes while offloaded (memory really freed);
* whether every tensor came back bit-identical (params, main grads, optimizer tensors, state);
* whether A's state after updates that follow round trips is bit-identical to B's;
* the no-op behaviour of a second offload / an onload of resident state, host-buffer reuse;
* rounds 1-3 copy the grads too (``keep_grads=True``); round 4 uses the trainer's default, which
  drops them: no host copy, zeros on return, the rest bit-exact, the next update equal to B's.
"""

from __future__ import annotations

from pathlib import Path

import torch

HOST_CHUNK = 1 << 12  # 4 KiB chunks: storages span chunk boundaries


def _build(model_dir: str, layout, cfg, dtype: torch.dtype):
    from megatron_dapo.actor import build_actor
    from megatron_dapo.model.builder import build_gpt_models
    from megatron_dapo.model.hf_config import read_hf_config
    from megatron_dapo.model.load import load_hf_into_megatron

    hf_cfg = read_hf_config(model_dir)
    models = build_gpt_models(hf_cfg, layout, dtype, transformer_engine="off", init_weights=False)
    load_hf_into_megatron(models, model_dir, hf_cfg)
    return build_actor(cfg, models, vocab_size=hf_cfg.vocab_size)


def _state(actor) -> dict[str, torch.Tensor]:
    """Every tensor of the actor's training state, by a stable name (copies, as raw bytes)."""
    from megatron_dapo.actor.offload import optimizer_tensors

    out = {}
    for c, model in enumerate(actor.models):
        for name, p in model.named_parameters():
            out[f"param/{c}/{name}"] = p.detach()
            if getattr(p, "main_grad", None) is not None:
                out[f"main_grad/{c}/{name}"] = p.main_grad
        for b, buffer in enumerate(model.buffers + model.expert_parallel_buffers):
            if buffer.param_data is not None:
                out[f"param_data/{c}/{b}"] = buffer.param_data
            out[f"grad_data/{c}/{b}"] = buffer.grad_data
    for i, t in enumerate(optimizer_tensors(actor.optimizer)):
        out[f"optimizer/{i}"] = t
    return {k: v.detach().reshape(-1).view(torch.uint8).clone() for k, v in out.items()}


def _differences(a: dict, b: dict) -> list[str]:
    if sorted(a) != sorted(b):
        return [f"keys differ: {sorted(set(a) ^ set(b))[:5]}"]
    return [k for k in a if a[k].dtype != b[k].dtype or a[k].shape != b[k].shape or not torch.equal(a[k], b[k])]


def _all_freed(offload, kinds, each_kind_holds_something: bool = True) -> bool:
    """Every kind offloaded with all its storages at 0 bytes (and, if asked, at least one storage each)."""
    regions = [offload._regions[k] for k in kinds]
    if each_kind_holds_something and not all(r.storages for r in regions):
        return False
    return all(r.offloaded and all(s.nbytes() == 0 for s in r.storages) for r in regions)


def _expected_bytes(actor) -> dict[str, int]:
    """What Megatron holds per kind on this rank, counted from its own objects."""
    params = grads = 0
    for model in actor.models:
        buffers = model.buffers + model.expert_parallel_buffers
        if all(b.param_data is not None for b in buffers):
            params += sum(b.param_data.numel() * b.param_data.element_size() for b in buffers)
        else:
            params += sum(p.numel() * p.element_size() for p in model.parameters())
        grads += sum(b.grad_data.numel() * b.grad_data.element_size() for b in buffers)
    optimizer = 0
    inners = getattr(actor.optimizer, "chained_optimizers", [actor.optimizer])
    for opt in inners:
        main = [p for g in opt.optimizer.param_groups for p in g["params"]]
        if main and main[0].dtype == torch.float32 and actor.config.params_dtype != torch.float32:
            optimizer += sum(p.numel() * 4 for p in main)  # fp32 main copies of bf16 params
        for state in opt.optimizer.state.values():
            optimizer += sum(v.numel() * v.element_size() for v in state.values() if isinstance(v, torch.Tensor))
    return {"params": params, "grads": grads, "optimizer": optimizer}


def _case(model_dir: str, spec: dict, batch) -> dict:
    from megatron.core import parallel_state as ps

    from megatron_dapo.actor.offload import KINDS, ActorOffload
    from megatron_dapo.distributed import ParallelLayout, init_distributed
    from tests.support.actor_steps import make_config

    ctx = init_distributed(ParallelLayout(tp=spec["tp"]), timeout_s=240, seed=3)
    dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    share = batch.select([0, 1, 2, 3, 4] if dp_rank == 0 else [5, 6]) if dp == 2 else batch
    cfg = make_config(parallel={"use_distributed_optimizer": spec["dist_opt"]}, optimizer={"lr": 1e-2})
    cfg.model.dtype = spec["dtype"]
    dtype = getattr(torch, spec["dtype"])
    a, b = _build(model_dir, ctx.layout, cfg, dtype), _build(model_dir, ctx.layout, cfg, dtype)
    inners = getattr(a.optimizer, "chained_optimizers", [a.optimizer])
    result: dict = {"dp": dp, "optimizer_classes": sorted({type(o).__name__ for o in inners})}
    result["a_equals_b_at_start"] = not _differences(_state(a), _state(b))
    offload = ActorOffload(a.models, a.optimizer, KINDS, host_chunk_bytes=HOST_CHUNK, keep_grads=True)

    def both_update():
        a.update([share])
        b.update([share])

    # 1. Before any step, as the trainer does at start: offload all, bring back. (No Adam state yet:
    #    an fp32 model under the distributed optimizer has no optimizer storage of its own then.)
    before = _state(a)
    stats = offload.offload()
    result["freed_at_start"] = _all_freed(offload, KINDS, each_kind_holds_something=False) and stats.bytes > 0
    offload.onload()
    result["start_round_trip_differences"] = _differences(before, _state(a))
    both_update()

    # 2. The trainer's order after an update: grads + optimizer, then params; then everything back.
    before, expected = _state(a), _expected_bytes(a)
    moved = {kind: offload.offload(kind).bytes for kind in ("grads", "optimizer")}
    result["params_resident_while_grads_away"] = all(s.nbytes() > 0 for s in offload.storages("params"))
    moved["params"] = offload.offload("params").bytes
    result["freed"] = _all_freed(offload, KINDS)
    result["second_offload_moves"] = offload.offload().bytes  # already offloaded: no-op
    back = offload.onload()
    result["onload_bytes"], result["onload_when_resident_moves"] = back.bytes, offload.onload().bytes
    result["moved"], result["expected"] = moved, expected
    result["round_trip_differences"] = _differences(before, _state(a))
    host = {k: offload._regions[k].host for k in KINDS}
    both_update()
    result["update_after_round_trip_differences"] = _differences(_state(a), _state(b))

    # 3. Again (the host buffers are reused now that Adam's state exists), one kind at a time.
    before = _state(a)
    offload.offload("params")
    offload.onload("params")
    offload.offload("optimizer")
    offload.offload("grads")
    offload.onload()
    result["host_buffers_reused"] = all(offload._regions[k].host is host[k] for k in KINDS)
    result["second_round_trip_differences"] = _differences(before, _state(a))
    both_update()
    result["third_update_differences"] = _differences(_state(a), _state(b))

    # 4. The trainer's offloader (grads dropped, not copied): no host copy of the grads, which come
    #    back as zeros; params and optimizer state bit-exact; the next update still equals B's.
    dropping = ActorOffload(a.models, a.optimizer, KINDS, host_chunk_bytes=HOST_CHUNK)
    before, expected = _state(a), _expected_bytes(a)
    stats = dropping.offload("grads", "optimizer")
    stats += dropping.offload("params")
    result["drop_freed"] = _all_freed(dropping, KINDS)
    result["drop_bytes"] = {"copied": stats.bytes, "dropped": stats.dropped, "host_grads": dropping.host_bytes("grads")}
    result["drop_expected"] = {"copied": expected["params"] + expected["optimizer"], "dropped": expected["grads"], "host_grads": 0}
    dropping.onload()
    after = _state(a)
    grads = [k for k in after if k.startswith(("main_grad/", "grad_data/"))]
    result["drop_grads_nonzero"] = [k for k in grads if torch.count_nonzero(after[k])]
    # optimizer tensors that are views of the grad buffer (main params' .grad) come back zero too
    result["drop_other_differences"] = [
        k for k in _differences(before, after) if k not in grads and not (k.startswith("optimizer/") and not torch.count_nonzero(after[k]))
    ]
    both_update()
    result["update_after_drop_differences"] = _differences(_state(a), _state(b))
    result["state_tensors"] = len(before)
    result["moved_total"] = stats.bytes
    return result


def run_round_trips(model_dir: str, cases: list) -> None:
    from tests.support.tiny_models import load_hf_model
    from tests.support.torchrun_utils import reporting

    from megatron_dapo.distributed import teardown
    from tests.support.actor_steps import global_batch

    with reporting({"cases": {}}) as out:
        batch = global_batch(load_hf_model(Path(model_dir)))
        for index, spec in enumerate(cases):
            if index:
                teardown(keep_process_group=True)
            out["cases"][spec["name"]] = _case(model_dir, spec, batch)
