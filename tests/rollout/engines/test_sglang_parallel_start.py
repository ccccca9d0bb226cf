"""Two SGLang engines started at the same moment on one node, each from its own process, as the
replica leaders of one job start theirs (issue 26 item 8): each takes the ports of its node slot
(`engine_ports`: LOCAL_RANK, here SLURM_LOCALID as srun sets it), both start and both generate.

Real SGLang CPU engines (0.5.23, float32, TP 1); the pure port rules: test_sglang_ports.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from tests.support.tiny_models import save_tiny_model
from tests.support.torchrun_utils import REPO_ROOT, launch_slot

WORKER = Path(__file__).parent / "_sglang_start_worker.py"
ENGINES = 2


def test_two_engines_started_at_once_on_one_node_both_generate(require_sglang, tmp_path):
    model = save_tiny_model("qwen2", tmp_path / "qwen2", seed=0)
    ready = tmp_path / "ready"
    ready.mkdir()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH", "")]))
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "LOCAL_WORLD_SIZE"):
        env.pop(name, None)
    results = [tmp_path / f"engine{slot}.json" for slot in range(ENGINES)]
    logs = [open(tmp_path / f"engine{slot}.log", "w+") for slot in range(ENGINES)]
    with launch_slot():
        started = time.monotonic()
        procs = [
            subprocess.Popen(
                [sys.executable, str(WORKER), json.dumps({"model_dir": str(model), "ready_dir": str(ready), "engines": ENGINES, "result": str(results[slot])})],
                env=dict(env, SLURM_LOCALID=str(slot)), stdout=logs[slot], stderr=subprocess.STDOUT, start_new_session=True,
            )  # fmt: skip
            for slot in range(ENGINES)
        ]
        try:
            codes = [proc.wait(timeout=600) for proc in procs]
        finally:
            for proc in procs:
                if proc.poll() is None:
                    os.killpg(proc.pid, 9)
                    proc.wait()
    outputs = []
    for log in logs:
        log.seek(0)
        outputs.append(log.read()[-6000:])
        log.close()
    assert codes == [0] * ENGINES, "\n".join(outputs)
    out = [json.loads(path.read_text()) for path in results]
    assert all("error" not in o for o in out), [o.get("error") for o in out]
    ports = [tuple(o["ports"]) for o in out]
    print(f"\n[sglang] {ENGINES} engines at once: ports {ports}, starts {[round(o['start_seconds'], 1) for o in out]} s, "
          f"{time.monotonic() - started:.0f} s in all")  # fmt: skip
    assert len({port for pair in ports for port in pair}) == 2 * ENGINES  # every engine its own port and nccl_port
    assert all(pair[1] == pair[0] + 1 for pair in ports)
    # Same model, greedy: both engines produce the same tokens, and they produce some.
    assert out[0]["responses"] == out[1]["responses"] and all(1 <= len(r) <= 6 for r in out[0]["responses"])
