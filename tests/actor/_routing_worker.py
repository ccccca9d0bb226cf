"""Worker for test_router_replay.py (run through tests/support/torchrun_utils.py, not collected by pytest).

On the tiny Qwen3-MoE / Qwen2-MoE (4 experts, top-2, 2 layers) and the 7-sequence batch of the actor
tests, per layout (each rank its data-parallel share):

* replay: a random routing (any k distinct experts per token and layer, far from what the routers
  would choose) is given as `PolicyBatch.routed_experts`; the actor's log-probs are compared with HF
  transformers' with its routers forced to the same experts (an independent forward: the HF model,
  its own gate-weight formula, one sequence at a time, no padding, no parallelism);
* record: `compute_log_probs_and_routing` without replay returns what Megatron's routers chose;
  compared with what HF's routers choose on the same sequences (`model.hf_routing.RoutingRecorder`);
* recompute: the update's gradients with the random routing replayed, with full activation
  recompute (the backward's re-run takes Megatron's REPLAY_BACKWARD queue) and without it.
"""

from __future__ import annotations

from pathlib import Path

import torch

from tests.support.actor_steps import DP_SHARES, LAYOUT_BUDGET, export_grads, global_batch, make_config
from tests.support.torchrun_utils import reporting

SEED = 11


def random_routing(batch, num_layers: int, num_experts: int, topk: int) -> torch.Tensor:
    """[n, T, L, k]: k distinct experts per (sequence, position, layer), uniformly at random."""
    g = torch.Generator().manual_seed(SEED)
    scores = torch.rand(batch.num_sequences, batch.sequence_width, num_layers, num_experts, generator=g)
    return scores.argsort(dim=-1)[..., :topk].to(torch.int32)


def _force(hf_model, forced: list):
    """Forward hooks making each HF router return `forced[layer]` [tokens, k] as its choice, with HF's
    weights for those experts: softmax over all experts, renormalised over the k when norm_topk_prob."""
    from megatron_dapo.model.hf_routing import hf_moe_routers

    hooks = []
    for layer, router in enumerate(hf_moe_routers(hf_model)):
        def hook(module, inputs, outputs, layer=layer):
            logits = outputs[0]
            indices = forced[layer].to(torch.long)
            probs = torch.softmax(logits, dim=-1, dtype=torch.float).gather(-1, indices)
            if module.norm_topk_prob:
                probs = probs / probs.sum(dim=-1, keepdim=True)
            return logits, probs.to(logits.dtype), indices

        hooks.append(router.register_forward_hook(hook))
    return hooks


def hf_log_probs_with_routing(hf_model, batch, routing: torch.Tensor) -> torch.Tensor:
    """[n, R] response log-probs of HF with token t of sequence i routed as routing[i, t]."""
    out = torch.zeros(batch.num_sequences, batch.response_width)
    for i in range(batch.num_sequences):
        tokens = batch.tokens_of(i)
        p, r = int(batch.prompt_lengths[i]), int(batch.response_lengths[i])
        read = tokens.numel() - 1
        # The last token is fed too (HF reads the whole sequence); its routing affects nothing before it.
        per_layer = [torch.cat([routing[i, :read, layer], routing[i, :1, layer]]) for layer in range(routing.shape[2])]
        hooks = _force(hf_model, per_layer)
        try:
            with torch.no_grad():
                log_softmax = hf_model(input_ids=tokens[None]).logits[0].float().log_softmax(-1)
        finally:
            for hook in hooks:
                hook.remove()
        out[i, :r] = log_softmax[p - 1 : p - 1 + r].gather(-1, tokens[p : p + r, None])[:, 0]
    return out


def hf_natural_routing(hf_model, batch) -> torch.Tensor:
    """[n, T, L, k] int32: the experts HF's routers choose for the tokens the actor reads (-1 elsewhere)."""
    from megatron_dapo.model.hf_routing import RoutingRecorder

    recorder = RoutingRecorder(hf_model)
    topk = hf_model.config.num_experts_per_tok
    out = torch.full((batch.num_sequences, batch.sequence_width, recorder.num_layers, topk), -1, dtype=torch.int32)
    for i in range(batch.num_sequences):
        tokens = batch.tokens_of(i)
        read = max(tokens.numel() - 1, 1)
        with recorder, torch.no_grad():
            hf_model(input_ids=tokens[None, :read])
        out[i, :read] = recorder.take(1, read)[0]
    return out


def _build(model_dir: str, layout, cfg, spec: dict, recompute: bool):
    from megatron_dapo.actor import build_actor
    from megatron_dapo.model.builder import build_gpt_models
    from megatron_dapo.model.hf_config import read_hf_config
    from megatron_dapo.model.load import load_hf_into_megatron

    hf_cfg = read_hf_config(model_dir)
    models = build_gpt_models(
        hf_cfg, layout, torch.float32, transformer_engine="off", init_weights=False,
        sequence_parallel=spec.get("sp", False), recompute_activations=recompute,
    )  # fmt: skip
    load_hf_into_megatron(models, model_dir, hf_cfg)
    return build_actor(cfg, models, vocab_size=hf_cfg.vocab_size), hf_cfg


def _sets_equal(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return (a.sort(dim=-1).values == b.sort(dim=-1).values).all(dim=-1)


def run_layouts(model_dirs: dict, out_dir: str, layouts: list) -> None:
    """For each layout {name, tp, sp, cp, pp, ep, recompute_check} and architecture: replay, record,
    and (recompute_check) gradients with and without recompute, on this rank's data-parallel share."""
    from tests.support.tiny_models import load_hf_model

    from megatron_dapo.distributed import ParallelLayout, init_distributed, teardown

    out: dict = {"layouts": {}}
    ctx = None
    with reporting(out):
        for spec in layouts:
            if ctx is not None:
                teardown(keep_process_group=True)
            parallel = ParallelLayout(tp=spec.get("tp", 1), pp=spec.get("pp", 1), cp=spec.get("cp", 1), ep=spec.get("ep", 1))
            ctx = init_distributed(parallel, timeout_s=240, seed=3)
            from megatron.core import parallel_state as ps

            dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
            results = out["layouts"][spec["name"]] = {}
            for arch, model_dir in model_dirs.items():
                hf_model = load_hf_model(Path(model_dir))
                batch = global_batch(hf_model)
                routing = random_routing(batch, hf_model.config.num_hidden_layers, hf_model.config.num_experts,
                                         hf_model.config.num_experts_per_tok)  # fmt: skip
                share = batch.select(DP_SHARES[dp][dp_rank])
                share_routing = routing[DP_SHARES[dp][dp_rank]]
                cfg = make_config(parallel={"ep": parallel.ep, "use_distributed_optimizer": False},
                                  trainer={"max_tokens_per_micro_batch": LAYOUT_BUDGET})  # fmt: skip
                actor, hf_cfg = _build(model_dir, ctx.layout, cfg, spec, recompute=False)
                result = results[arch] = {"sequences": share.num_sequences, "stage": ps.get_pipeline_model_parallel_rank()}

                # Replay: the actor routes as told.
                replayed = share.select(range(share.num_sequences))
                replayed.routed_experts = share_routing
                actor_lp = actor.compute_log_probs(replayed)
                hf_lp = hf_log_probs_with_routing(hf_model, share, share_routing)
                natural_lp = actor.compute_log_probs(share)
                valid = share.response_valid_mask()
                result["replay_max_abs_diff"] = float((actor_lp - hf_lp).abs()[valid].max()) if valid.any() else 0.0
                result["replay_changes_log_probs"] = float((actor_lp - natural_lp).abs()[valid].max()) if valid.any() else 0.0

                # Record: what the routers chose, complete on this stage's layers.
                recorded_lp, recorded = actor.compute_log_probs_and_routing(share)
                reference = hf_natural_routing(hf_model, share)
                read = share.read_mask()
                from megatron_dapo.actor.moe import find_routers

                layers_here = sorted(router.layer_number - 1 for router in find_routers(actor.models))
                layer_mask = torch.zeros(recorded.shape[2], dtype=torch.bool)
                layer_mask[layers_here] = True
                compared = read[..., None] & layer_mask
                equal = _sets_equal(recorded, reference) & compared
                result["record_layers"] = layers_here
                result["record_compared"] = int(compared.sum())
                result["record_equal"] = int(equal.sum())
                result["record_unwritten"] = int((compared & (recorded < 0).any(dim=-1)).sum())
                result["record_log_probs_equal_plain"] = bool(torch.equal(recorded_lp, natural_lp))

                # Replay under full recompute: the backward's re-run takes the same routing.
                if spec.get("recompute_check"):
                    grads = {}
                    for recompute in (False, True):
                        trainer_actor, _ = _build(model_dir, ctx.layout, cfg, spec, recompute=recompute)
                        trainer_actor.compute_gradients(replayed)
                        grads[recompute] = export_grads(trainer_actor, hf_cfg)
                    plain_actor, _ = _build(model_dir, ctx.layout, cfg, spec, recompute=True)
                    plain_actor.compute_gradients(share)
                    natural = export_grads(plain_actor, hf_cfg)
                    result["recompute_grad_max_abs_diff"] = max(float((grads[True][k] - grads[False][k]).abs().max()) for k in grads[False])
                    result["replay_changes_grads"] = max(float((natural[k] - grads[True][k]).abs().max()) for k in natural)
                    result["micro_batches"] = len(actor.synchronised_plan(share))
