"""The actor tests' shared pieces (tests/actor's torchrun workers): the test Config, the global batch
of 7 sequences with old / ref / rollout log-probs and advantages (and its uneven data-parallel
shares), the actor built on a tiny HF model, the HF-named exports of its weights and gradients,
and the two training steps every layout runs (`run_steps`).
"""

from __future__ import annotations

import math
import time

import torch

NUM_SEQUENCES = 7
PROMPT_RANGE = (2, 9)
RESPONSE_RANGE = (1, 15)
# Uneven data-parallel shares of the 7 sequences (a rank with none at DP=4).
DP_SHARES = {1: [list(range(7))], 2: [[0, 1, 2, 3, 4], [5, 6]], 4: [[0, 1, 2, 3], [], [4, 5], [6]]}
LAYOUT_BUDGET = 24  # tokens per training micro-batch in the layouts: several, different per rank


# ---------------------------------------------------------------------------------------------
# Data and configuration
# ---------------------------------------------------------------------------------------------


def make_config(**sections):
    """A Config for the tests: float32 tiny model, every loss term on, no warm-up unless asked."""
    from megatron_dapo.config import Config

    cfg = Config()
    cfg.optimizer.lr = 1e-3
    cfg.optimizer.warmup_steps = 0
    cfg.optimizer.grad_clip = 1.0
    # Adam's first steps are ~lr * sign(grad): an element whose gradient is ~0 flips by 2 * lr under
    # a 1e-7 change of summation order. A larger epsilon keeps the update smooth in the gradient so
    # that weights of different layouts can be compared tightly (the optimizer code is unchanged).
    cfg.optimizer.adam_eps = 1e-4
    cfg.algorithm.entropy_coeff = 0.01
    cfg.algorithm.kl.use_kl_loss = True
    cfg.algorithm.kl.coef = 0.05
    cfg.algorithm.kl.type = "low_var_kl"
    cfg.algorithm.tis_cap = 1.5
    cfg.rollout.max_response_length = RESPONSE_RANGE[1]
    cfg.trainer.micro_batch_size = NUM_SEQUENCES
    cfg.trainer.max_tokens_per_micro_batch = 0
    cfg.trainer.total_steps = 20
    for section, values in sections.items():
        for key, value in values.items():
            setattr(getattr(cfg, section), key, value)
    return cfg


def hf_response_log_probs(hf_model, batch, requires_grad: bool = False, temperature: float = 1.0):
    """[n, R] log-probs and entropies of the response tokens under the HF model, one sequence at a time."""
    n, width = batch.num_sequences, batch.response_width
    rows_lp, rows_h = [], []
    for i in range(n):
        tokens = batch.tokens_of(i)
        p, r = int(batch.prompt_lengths[i]), int(batch.response_lengths[i])
        with torch.set_grad_enabled(requires_grad):
            log_softmax = (hf_model(input_ids=tokens[None]).logits[0].float() / temperature).log_softmax(-1)
            picked = log_softmax[p - 1 : p - 1 + r].gather(-1, tokens[p : p + r, None])[:, 0]
            entropy = -(log_softmax[p - 1 : p - 1 + r].exp() * log_softmax[p - 1 : p - 1 + r]).sum(-1)
        pad = torch.zeros(width - r)
        rows_lp.append(torch.cat([picked, pad]))
        rows_h.append(torch.cat([entropy, pad]))
    return torch.stack(rows_lp), torch.stack(rows_h)


def global_batch(hf_model):
    """The 7-sequence batch every test uses, with old / ref / rollout log-probs and advantages."""
    from megatron_dapo.actor import PolicyBatch

    g = torch.Generator().manual_seed(2024)
    prompts = [torch.randint(0, 300, (int(torch.randint(*PROMPT_RANGE, (1,), generator=g)),), generator=g) for _ in range(NUM_SEQUENCES)]
    responses = [torch.randint(0, 300, (int(torch.randint(*RESPONSE_RANGE, (1,), generator=g)),), generator=g) for _ in range(NUM_SEQUENCES)]
    batch = PolicyBatch.from_token_lists(prompts, responses, response_width=RESPONSE_RANGE[1] - 1)
    base, _ = hf_response_log_probs(hf_model, batch)
    valid = batch.response_valid_mask()
    noise = lambda scale: torch.where(valid, scale * torch.randn(base.shape, generator=g), 0.0)  # noqa: E731
    batch.old_log_probs = base + noise(0.3)  # ratios away from 1: the clips are active on some tokens
    batch.ref_log_probs = base + noise(0.2)
    batch.rollout_log_probs = batch.old_log_probs + noise(0.5)  # some truncated-IS weights hit the cap
    batch.advantages = torch.randn(NUM_SEQUENCES, generator=g)
    mask = valid.clone()
    mask[3] = False  # an overlong-filtered response: no loss token, not counted as a sequence
    batch.response_mask = mask
    return batch


# ---------------------------------------------------------------------------------------------
# Model, actor, exports
# ---------------------------------------------------------------------------------------------


def build_actor_for(model_dir: str, layout, cfg, sequence_parallel: bool = False):
    from megatron_dapo.actor import build_actor
    from megatron_dapo.model.builder import build_gpt_models
    from megatron_dapo.model.hf_config import read_hf_config
    from megatron_dapo.model.load import load_hf_into_megatron

    hf_cfg = read_hf_config(model_dir)
    models = build_gpt_models(
        hf_cfg, layout, torch.float32, transformer_engine="off", init_weights=False, sequence_parallel=sequence_parallel
    )
    load_hf_into_megatron(models, model_dir, hf_cfg)
    return build_actor(cfg, models, vocab_size=hf_cfg.vocab_size), hf_cfg


def export_weights(actor, hf_cfg) -> dict[str, torch.Tensor]:
    from megatron_dapo.model.load import export_megatron_to_hf

    return {name: tensor.clone() for name, tensor in export_megatron_to_hf(actor.gpt_models, hf_cfg)}


def export_grads(actor, hf_cfg) -> dict[str, torch.Tensor]:
    """Full HF-named gradients (the DDP main_grad buffers), via the weight export's mapping.

    Valid only without the distributed optimizer (it reduce-scatters: each rank keeps a shard).
    """
    params = [p for model in actor.gpt_models for p in model.parameters()]
    saved = [p.data for p in params]
    try:
        for p in params:
            p.data = p.main_grad
        return export_weights(actor, hf_cfg)
    finally:
        for p, data in zip(params, saved):
            p.data = data


def main_grad_norm(actor) -> float:
    """Norm of the gradients as they are now (after clipping); single process only."""
    return math.sqrt(sum(float(p.main_grad.double().square().sum()) for m in actor.gpt_models for p in m.parameters()))


def tensor_list(t: torch.Tensor) -> list:
    return t.double().tolist()


def run_steps(actor, hf_cfg, share, save_grads: bool) -> tuple[dict, dict]:
    """compute_log_probs; step 1 by hand (gradients exported between backward and step); step 2 via update()."""
    from megatron_dapo.actor import summarise

    result: dict = {}
    tensors: dict = {}
    started = time.perf_counter()
    log_probs, entropy = actor.compute_log_probs(share, with_entropy=True)
    result["log_probs"] = tensor_list(log_probs)
    result["entropy"] = tensor_list(entropy)
    local_plan = actor.plan(share, actor.settings.max_tokens_per_micro_batch)
    result["local_micro_batches"] = len(local_plan)
    result["synchronised_micro_batches"] = len(actor.synchronised_plan(share))
    sums = actor.compute_gradients(share)
    result["step1"] = summarise(sums[: -2])
    if save_grads:
        tensors["grads"] = export_grads(actor, hf_cfg)
    result["step1"].update(actor.apply_gradients())
    result["step2"] = actor.update([share])
    tensors["weights"] = export_weights(actor, hf_cfg)
    result["seconds"] = time.perf_counter() - started
    return result, tensors
