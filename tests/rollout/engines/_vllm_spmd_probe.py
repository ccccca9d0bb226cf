"""Workers run under torchrun by test_vllm_seeds.py and test_spmd_shm.py: real SPMD vLLM engines
(the CPU build) in a plain gloo world.

* `seed_job` (1 rank, TP 1): engine-level and per-prompt seeding, the trainer's RNG around a
  generate, a second (fresh) engine as a resumed run would build it, and the output conversion
  on vLLM's flat and per-position log-probs against a reference written out here.
* `shm_job` (2 ranks, TP 2): the shared-memory names vLLM gives the engine's TP group, what is left
  in /dev/shm after the start and after shutdown, and one seeded generation.
"""

from __future__ import annotations

import os

import torch

PROMPTS = [[1, 2, 3], [7, 8], [11, 12, 13, 14], [20], [30, 31, 32], [40, 41]]


def _engine(model_dir: str, tp: int):
    from megatron_dapo.rollout.engines.vllm.engine import VLLMEngine

    return VLLMEngine(
        model_dir, tensor_parallel_size=tp, dtype="float32", max_model_len=64, placement="spmd",
        enforce_eager=True, kv_cache_memory_bytes=32 << 20,
    )  # fmt: skip


def _plain(out) -> dict:
    return {
        "prompt_index": out.prompt_index,
        "responses": out.response_ids,
        "log_probs": [lp.tolist() for lp in out.log_probs],
        "finish_reasons": out.finish_reasons,
        "truncated": out.truncated.tolist(),
    }


def _reference_conversion(request_outputs, params) -> dict:
    """vLLM's outputs read one token at a time from per-position {token_id: Logprob} mappings."""
    responses, log_probs, reasons, prompt_index = [], [], [], []
    for index, request in enumerate(request_outputs):
        for completion in sorted(request.outputs, key=lambda c: c.index):
            tokens = [int(t) for t in completion.token_ids]
            responses.append(tokens)
            log_probs.append([float(completion.logprobs[i][t].logprob) for i, t in enumerate(tokens)])
            reasons.append(str(completion.finish_reason))
            prompt_index.append(index)
    return {
        "prompt_index": prompt_index,
        "responses": responses,
        "log_probs": log_probs,
        "finish_reasons": reasons,
        "truncated": [r == "length" for r in reasons],
    }


def seed_job(model_dir: str) -> None:
    import torch.distributed as dist
    from vllm import SamplingParams as VLLMSamplingParams

    from megatron_dapo.rollout.base import SamplingParams
    from megatron_dapo.rollout.engines.vllm.io import collect_outputs, vllm_sampling_kwargs
    from tests.support.torchrun_utils import reporting

    dist.init_process_group("gloo")
    out: dict = {}
    with reporting(out, teardown=False):

        def engine_level(seed: int) -> SamplingParams:
            return SamplingParams(n=2, temperature=1.0, max_new_tokens=6, seed=seed, seed_per_prompt=False)

        def per_prompt(seed: int) -> SamplingParams:
            return SamplingParams(n=2, temperature=1.0, max_new_tokens=6, seed=seed, seed_per_prompt=True)

        engine = _engine(model_dir, tp=1)
        torch.manual_seed(1234)
        rng = torch.get_rng_state()
        out["engine_seed_7"] = _plain(engine.generate(PROMPTS, engine_level(7)))
        out["trainer_rng_unchanged"] = torch.equal(torch.get_rng_state(), rng)
        engine.generate(PROMPTS[:3], engine_level(8))  # another call in between
        out["engine_seed_7_again"] = _plain(engine.generate(PROMPTS, engine_level(7)))
        out["engine_seed_9"] = _plain(engine.generate(PROMPTS, engine_level(9)))
        out["per_prompt_all"] = _plain(engine.generate(PROMPTS, per_prompt(100)))
        out["per_prompt_third_alone"] = _plain(engine.generate([PROMPTS[2]], per_prompt(104)))  # prompt 2: 100 + 2 * n
        out["not_collected"] = engine.generate(PROMPTS, per_prompt(100), collect=False)

        # The conversion: vLLM's flat log-probs (what the engine asks for) and per-position mappings.
        params = per_prompt(100)
        requests = [engine._tokens_prompt(prompt_token_ids=ids) for ids in PROMPTS]
        raw = {}
        for flat in (True, False):
            sampling = [VLLMSamplingParams(**{**vllm_sampling_kwargs(params, i), "flat_logprobs": flat}) for i in range(len(PROMPTS))]
            raw[flat] = engine._llm.generate(requests, sampling, use_tqdm=False)
        out["flat_is_flat"] = type(raw[True][0].outputs[0].logprobs).__name__
        out["converted_flat"] = _plain(collect_outputs(raw[True], PROMPTS, params))
        out["converted_per_position"] = _plain(collect_outputs(raw[False], PROMPTS, params))
        out["reference"] = _reference_conversion(raw[False], params)
        engine.shutdown()

        resumed = _engine(model_dir, tp=1)  # a fresh engine, as a resumed run builds it
        out["fresh_engine_seed_7"] = _plain(resumed.generate(PROMPTS, engine_level(7)))
        resumed.shutdown()
    dist.destroy_process_group()


def shm_job(model_dir: str, seed: int) -> None:
    import torch.distributed as dist
    from vllm.distributed import get_tp_group
    from vllm.distributed.device_communicators.cpu_communicator import _CPUSHMDistributed

    from megatron_dapo.rollout.base import SamplingParams
    from tests.support.torchrun_utils import reporting

    dist.init_process_group("gloo")
    out: dict = {}
    with reporting(out, teardown=False):
        engine = _engine(model_dir, tp=2)
        prefix = engine.shared_memory_prefix
        out["prefix"] = prefix
        communicator = get_tp_group().device_communicator
        out["shm_communicator"] = isinstance(communicator.dist_module, _CPUSHMDistributed)  # AVX-512 builds only
        os.environ["VLLM_DIST_IDENT"] = prefix or ""
        out["group_name"] = _CPUSHMDistributed.make_group_name(communicator)  # vLLM's own naming
        del os.environ["VLLM_DIST_IDENT"]
        # Each rank unlinks its own segment once the others have opened it, inside its engine start:
        # look only when every rank of the job has finished starting (under load, rank 0 used to look
        # before rank 1 had unlinked, and saw a segment that was about to go).
        dist.barrier()
        out["left_after_start"] = sorted(n for n in os.listdir("/dev/shm") if prefix and n.startswith(prefix))
        result = engine.generate(PROMPTS[:2], SamplingParams(n=2, temperature=1.0, max_new_tokens=5, seed=seed))
        out["responses"] = result.response_ids
        engine.shutdown()
        out["left_after_shutdown"] = sorted(n for n in os.listdir("/dev/shm") if prefix and n.startswith(prefix))
    dist.destroy_process_group()
