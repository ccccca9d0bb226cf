"""Worker for test_gradient_options.py (2 processes, DP=2): the actor's update with Megatron DDP's
``overlap_grad_reduce`` forced on (the GPU default) against off (the CPU default), same data.

For each optimizer kind (plain, distributed): build the actor twice from the same HF weights, run
`actor_steps.run_steps` (log-probs, one step by hand with the gradients exported, one `update`) on
this rank's uneven share of the batch with a token budget that gives several micro-batches, and
save gradients and weights on rank 0.
"""

from __future__ import annotations

from pathlib import Path

import torch

from tests.support.actor_steps import DP_SHARES, LAYOUT_BUDGET, global_batch, make_config, run_steps
from tests.support.torchrun_utils import reporting


def run(model_dir: str, out_dir: str) -> None:
    from tests.support.tiny_models import load_hf_model

    from megatron_dapo.actor import build_actor
    from megatron_dapo.distributed import ParallelLayout, init_distributed, teardown
    from megatron_dapo.model.builder import build_gpt_models
    from megatron_dapo.model.hf_config import read_hf_config
    from megatron_dapo.model.load import load_hf_into_megatron

    out: dict = {"runs": {}}
    ctx = None
    with reporting(out):
        batch = global_batch(load_hf_model(Path(model_dir)))
        hf_cfg = read_hf_config(model_dir)
        for dist_opt in (False, True):
            for overlap in (False, True):
                if ctx is not None:
                    teardown(keep_process_group=True)
                ctx = init_distributed(ParallelLayout(tp=1, pp=1), timeout_s=240, seed=3)
                from megatron.core import parallel_state as ps

                share = batch.select(DP_SHARES[2][ps.get_data_parallel_rank()])
                cfg = make_config(
                    trainer={"max_tokens_per_micro_batch": LAYOUT_BUDGET},
                    parallel={"use_distributed_optimizer": dist_opt},
                )
                models = build_gpt_models(hf_cfg, ctx.layout, torch.float32, transformer_engine="off", init_weights=False)
                load_hf_into_megatron(models, model_dir, hf_cfg)
                actor = build_actor(cfg, models, vocab_size=hf_cfg.vocab_size, overlap_grad_reduce=overlap)
                config = actor.config
                name = f"{'dist' if dist_opt else 'plain'}_{'overlap' if overlap else 'sync'}"
                result, saved = run_steps(actor, hf_cfg, share, save_grads=not dist_opt)
                result.update(
                    ddp_overlap=bool(actor.models[0].ddp_config.overlap_grad_reduce),
                    no_sync_func=config.no_sync_func is not None,
                    grad_sync_func=config.grad_sync_func is not None,
                )
                out["runs"][name] = result
                if ctx.rank == 0:
                    torch.save(saved, Path(out_dir) / f"{name}.pt")
    return None
