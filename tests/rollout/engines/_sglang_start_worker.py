"""Worker of test_sglang_parallel_start.py: one SGLang CPU engine in this process, created at the
same moment as the other workers' (they meet in `ready_dir` after the slow SGLang import), then a
greedy generation. Writes {"ports", "responses", "start_seconds"} (or {"error"}) as JSON to `result`.

A plain script with a `__main__` guard: SGLang spawns its scheduler processes, which import the
main module again."""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from pathlib import Path

PROMPTS = [[17, 3, 250, 41, 99], [5, 6, 7]]


def main(model_dir: str, ready_dir: str, engines: int, result: str) -> None:
    out: dict = {}
    try:
        from megatron_dapo.rollout.base import SamplingParams
        from megatron_dapo.rollout.engines.sglang.engine import SGLangEngine, prepare_import

        prepare_import("cpu")
        import sglang  # noqa: F401  (the slow part, before the meeting point)

        ready = Path(ready_dir)
        (ready / str(os.getpid())).touch()
        deadline = time.monotonic() + 300
        while len(list(ready.iterdir())) < engines:
            if time.monotonic() > deadline:
                raise TimeoutError("the other engine's process never got ready")
            time.sleep(0.02)
        started = time.perf_counter()
        engine = SGLangEngine(model_dir, dtype="float32", skip_tokenizer_init=True, device="cpu")
        try:
            out["start_seconds"] = time.perf_counter() - started
            out["ports"] = list(engine.ports)
            generated = engine.generate(PROMPTS, SamplingParams(temperature=0, max_new_tokens=6))
            out["responses"] = generated.response_ids
        finally:
            engine.shutdown()
    except BaseException:
        out["error"] = traceback.format_exc()
        raise
    finally:
        Path(result).write_text(json.dumps(out))


if __name__ == "__main__":
    main(**json.loads(sys.argv[1]))
