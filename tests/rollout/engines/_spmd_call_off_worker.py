"""Worker of test_spmd_call_off.py: a TP=2 spmd vLLM engine (CPU build) whose batch is called off
mid-generation (run under torchrun, 2 ranks; not collected).

Both ranks hold one shard of the engine and step it together. In order:

1. equality: a short batch (several call-off checks long) through vLLM's own `LLM.generate`, as
   `VLLMEngine.generate` ran it before it stepped the engine itself (the reference), then through
   `generate` without and with a `call_off` predicate that stays false (engine-wide and per-prompt
   seeds);
2. the control: a long batch (no EOS in the model: every response runs to max_new_tokens) with the
   trainer's vote (`SigtermFlag.votes_to_call_off`, one store read per check) that stays false:
   the batch's full time, and how many checks were made; then what one check costs;
3. call-offs of the same long batch, SIGTERM (or the call-off) ~`delay_s` into it:
   * "engine_both": SIGTERM to both ranks, the predicate their own flag (`RolloutGroup.generate`);
   * "engine_one": SIGTERM to rank 1 only; rank 0 learns it from the group's vote;
   * "trainer_replica": no SIGTERM: the world's gather meeting is called off as another rollout
     replica's rank does (`liveness.call_off`), the trainer's vote and conversion
     (`SigtermFlag.calling_off_generation`), then both ranks wait in the gather meeting;
   * "trainer_one": SIGTERM to rank 0 only, the trainer's vote and conversion;
   after each: what each rank raised, seconds from the SIGTERM to it, whether vLLM kept requests;
4. the short batch again after the aborted ones: the engine is clean and still reproduces it.

Results (JSON) come back through `write_rank_result`; the assertions are in test_spmd_call_off.py.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

PROMPTS = [[17, 3, 250, 41, 99, 8, 120], [5, 6], [200, 201, 202, 13, 77, 31, 64, 2, 9], [66, 67, 68]]


def _plain(out) -> dict:
    return {
        "prompt_index": out.prompt_index,
        "responses": out.response_ids,
        "log_probs": [lp.tolist() for lp in out.log_probs],
        "finish_reasons": out.finish_reasons,
    }


def _llm_generate(engine, params) -> dict:
    """What `VLLMEngine.generate` did before it stepped the engine itself: `LLM.generate` under the
    same seeding (the reference; both ranks call it, as the spmd engine needs)."""
    from vllm import SamplingParams as VLLMSamplingParams
    from vllm.inputs import TokensPrompt

    from megatron_dapo.rollout.engines.vllm.io import collect_outputs, vllm_sampling_kwargs

    requests = [TokensPrompt(prompt_token_ids=ids) for ids in PROMPTS]
    sampling = [VLLMSamplingParams(**vllm_sampling_kwargs(params, i)) for i in range(len(PROMPTS))]
    with engine._sampler_seeded(params.seed if not params.seed_per_prompt else None):
        outputs = engine._llm.generate(requests, sampling, use_tqdm=False)
    return _plain(collect_outputs(outputs, PROMPTS, params))


def main(model_dir: str, long_tokens: int, delay_s: float) -> dict:
    import torch.distributed as dist

    from megatron_dapo.distributed import ParallelLayout, init_distributed, liveness
    from megatron_dapo.distributed.placement import SpmdSlot
    from megatron_dapo.rollout.base import GenerationCalledOff, SamplingParams
    from megatron_dapo.rollout.engines.vllm.engine import CALL_OFF_CHECK_STEPS, VLLMEngine
    from megatron_dapo.rollout.group import RolloutGroup
    from megatron_dapo.trainer.preemption import SigtermFlag
    from tests.support.torchrun_utils import RESULT_DIR_ENV, reporting

    out: dict = {"check_steps": CALL_OFF_CHECK_STEPS}
    with reporting(out):
        ctx = init_distributed(ParallelLayout(), timeout_s=300, seed=1, gather_timeout_s=120)
        rank = ctx.rank
        out["rank"] = rank
        results = Path(os.environ[RESULT_DIR_ENV])
        (results / f"pid{rank}").write_text(str(os.getpid()))
        liveness.configure(window_s=20)
        started = time.perf_counter()
        engine = VLLMEngine(
            model_dir, tensor_parallel_size=2, placement="spmd", load_checkpoint=True, dtype="float32",
            max_model_len=long_tokens + 16, enforce_eager=True, kv_cache_memory_bytes=32 << 20,
        )  # fmt: skip
        out["engine_start_s"] = time.perf_counter() - started
        rollout = RolloutGroup(engine, engine_kind="vllm", spmd=SpmdSlot(rank, dist.get_world_size(), 2))
        try:
            # 1. equality with vLLM's own loop
            short = SamplingParams(n=2, temperature=1.0, max_new_tokens=3 * CALL_OFF_CHECK_STEPS, seed=5, seed_per_prompt=False)
            per_prompt = SamplingParams(n=2, temperature=1.0, max_new_tokens=3 * CALL_OFF_CHECK_STEPS, seed=9, seed_per_prompt=True)
            asked = [0]

            def never() -> bool:
                asked[0] += 1
                return False

            out["short"] = {
                "reference": _llm_generate(engine, short),
                "stepped": _plain(engine.generate(PROMPTS, short)),
                "checked": _plain(engine.generate(PROMPTS, short, call_off=never)),
                "asked": asked[0],
                "per_prompt_reference": _llm_generate(engine, per_prompt),
                "per_prompt_checked": _plain(engine.generate(PROMPTS, per_prompt, call_off=never)),
            }
            long = SamplingParams(n=2, temperature=1.0, max_new_tokens=long_tokens, seed=7, seed_per_prompt=False)

            # 2. the control: the trainer's vote, never yes
            dist.barrier()
            asked[0] = 0
            with SigtermFlag() as flag:

                def vote() -> bool:
                    asked[0] += 1
                    return flag.votes_to_call_off()

                begun = time.time()
                with flag.calling_off_generation():
                    full = rollout.generate(PROMPTS, long, call_off=vote)
                out["control"] = {"batch_s": time.time() - begun, "asked": asked[0], "received": flag.received}
            if full is not None:
                out["control"]["lengths"] = [len(r) for r in full.response_ids]
                out["control"]["finish_reasons"] = sorted(set(full.finish_reasons))

            # what one check costs (the trainer's vote: a store read; the group's all-reduce)
            with SigtermFlag() as flag:
                dist.barrier()
                begun = time.perf_counter()
                for _ in range(50):
                    engine._agree_to_call_off(flag.votes_to_call_off, 0)
                out["check_ms"] = (time.perf_counter() - begun) * 1000 / 50

            # 3. call-offs
            out["scenarios"] = {}
            for name, targets in (("engine_both", (0, 1)), ("engine_one", (1,)), ("trainer_replica", ()), ("trainer_one", (0,))):
                out["scenarios"][name] = _scenario(name, targets, delay_s, rank, results, rollout, long, GenerationCalledOff, SigtermFlag, liveness)

            # 4. the short batch again: nothing of the aborted batches is left in the engine
            out["short_after"] = _plain(engine.generate(PROMPTS, short, call_off=never))
        finally:
            rollout.shutdown()
        dist.barrier()
    return out


def _scenario(name, targets, delay_s, rank, results, rollout, params, GenerationCalledOff, SigtermFlag, liveness) -> dict:
    import torch.distributed as dist

    trainer = name.startswith("trainer")
    sent_file = results / f"sent_{name}"
    record: dict = {"outcome": None}
    dist.barrier()
    with SigtermFlag() as flag:
        if rank == 0:  # as SLURM does: the signal comes from outside, at a time of its own
            def send() -> None:
                pids = [int((results / f"pid{r}").read_text()) for r in targets]
                (sent_file.with_suffix(".tmp")).write_text(repr(time.time()))
                (sent_file.with_suffix(".tmp")).replace(sent_file)
                if not targets:  # another rollout replica's rank calls the gather meeting off
                    liveness.call_off(liveness.GATHER)
                for pid in pids:
                    os.kill(pid, signal.SIGTERM)

            threading.Timer(delay_s, send).start()
        asked = [0]

        def vote() -> bool:
            asked[0] += 1
            return flag.votes_to_call_off() if trainer else flag.received

        begun = time.time()
        try:
            if trainer:
                with liveness.calling_off_when(lambda: flag.received), flag.calling_off_generation():
                    rollout.generate(PROMPTS, params, call_off=vote)
            else:
                rollout.generate(PROMPTS, params, call_off=vote)
            record["outcome"] = "finished"
        except (GenerationCalledOff, liveness.MeetingCalledOff) as error:
            record["outcome"] = type(error).__name__
            record["message"] = str(error)
        ended = time.time()
        record["asked"] = asked[0]  # the checks made: the step the group stopped at, over CALL_OFF_CHECK_STEPS
        record["received"] = flag.received
        record["batch_s"] = ended - begun
        while not sent_file.exists():  # the sender's clock reading (same machine)
            time.sleep(0.01)
        record["after_sigterm_s"] = ended - float(sent_file.read_text())
        record["engine_unfinished"] = rollout.engine._llm.llm_engine.has_unfinished_requests()
        if trainer:  # the ranks that wait in the gather meeting leave it too, every one alike
            try:
                liveness.await_ranks([0, 1], liveness.GATHER, what="gather")
                record["gather"] = "met"
            except liveness.MeetingCalledOff:
                record["gather"] = "called off"
            record["next_called_off"] = liveness.called_off(liveness.GATHER)
    dist.barrier()
    return record
