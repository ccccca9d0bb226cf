"""`megatron-dapo smoke`: does everything this package does on a GPU work here? One command, one table.

    megatron-dapo smoke                      # GPU sizes when CUDA is present, CPU sizes otherwise
    megatron-dapo smoke --workspace /tmp/s   # where the models, logs and the step's run go

Steps, each its own process (logs under <workspace>/logs):
  1. doctor                            versions, GPUs, memory, disk of this node
  2. check-sync dense, vLLM            the weight sync into vLLM, bit for bit, and the log-prob mismatch
  3. check-sync dense, SGLang          the same into SGLang
  4. check-sync MoE (EP=2 with 2 GPUs) a tiny Qwen3-MoE: router and every expert, expert-parallel actor
  5. trainer step, MoE, r3             one DAPO step whose update replays the routing the engine returned
  6. weight push                       a 1.5B-shaped model made on the spot (no download) pushed into the
                                       engine, against a device copy of the same bytes
An engine that is not installed makes its steps SKIP (with the install command); a failing step
does not stop the others. Exit code 0 when no step failed, 1 otherwise. On a GPU it is sized to
finish in under 10 minutes; on a 2-core CPU machine in about as long.
"""

from __future__ import annotations

import argparse
import importlib.util
import tempfile
from pathlib import Path


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.epilog = __doc__
    parser.add_argument("--workspace", default=None, help="models, logs and runs go here (default: a new temporary directory)")
    parser.add_argument("--only", default=None, metavar="WORD",
                        help="run only the steps whose name contains WORD (e.g. push, check-sync, doctor)")  # fmt: skip


def machine_facts():
    """This machine as the plan sees it: CUDA devices and the engines that import."""
    import torch

    from megatron_dapo.smoke.plan import Machine

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return Machine(gpus=gpus, vllm=importlib.util.find_spec("vllm") is not None, sglang=importlib.util.find_spec("sglang") is not None)


def run(args: argparse.Namespace) -> int:
    from megatron_dapo.data.demo import prepare_workspace
    from megatron_dapo.smoke.plan import plan_steps
    from megatron_dapo.smoke.run import FAIL, format_table, run_steps

    workspace = Path(args.workspace or tempfile.mkdtemp(prefix="megatron_dapo_smoke_"))
    machine = machine_facts()
    sizes = f"GPU sizes, {machine.gpus} GPU(s)" if machine.on_gpu else "CPU sizes (no CUDA)"
    print(f"megatron-dapo smoke: {sizes}; vLLM {'yes' if machine.vllm else 'no'}, SGLang {'yes' if machine.sglang else 'no'}; "
          f"workspace {workspace}", flush=True)  # fmt: skip
    for kind in ("dense", "moe"):  # the demo's models and data (the trainer step reuses the MoE workspace)
        prepare_workspace(workspace / kind, seed=7, model=kind)
    steps = plan_steps(machine, workspace)
    if args.only:
        steps = [step for step in steps if args.only.lower() in step.name.lower()]
    results = run_steps(steps, workspace / "logs", say=lambda line: print(line, flush=True))
    print("\n" + format_table(results), flush=True)
    return 1 if any(r.status == FAIL for r in results) else 0
