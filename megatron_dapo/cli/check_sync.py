"""`megatron-dapo check-sync`: does the actor -> rollout engine weight sync work here, exactly?

    megatron-dapo check-sync --hf-dir Qwen2.5-7B --engine vllm --tp 4 --pp 2 --dtype bfloat16 --tolerance 0.5
    python tools/check_sync.py --hf-dir tiny --engine embedded --tp 2

The first thing to run after changing the engine, vLLM / torch / Megatron versions or the parallel
layout; what it checks is in `megatron_dapo.trainer.check_sync`. This module is the command: its
options, and the processes. Run as a plain command it starts the TP x PP processes itself
(re-executing `-m megatron_dapo.cli check-sync` under `torch.distributed.run`, gloo on CPU / NCCL
on GPUs) and reads rank 0's verdict from a file; under torchrun or srun it uses the ranks it is
given (the world size must be a multiple of TP x PP; extra ranks are data-parallel replicas).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Mapping, Optional

import megatron_dapo
from megatron_dapo.cli.main import check_flags
from megatron_dapo.distributed.launch import find_free_port
from megatron_dapo.errors import InputError, StopError

RESULT_FILE_ENV = "MEGATRON_DAPO_CHECK_SYNC_RESULT"
"""Set by the plain command for the processes it starts: where rank 0 writes the verdict."""
EXIT_PASS, EXIT_FAIL = 0, 1

DESCRIPTION = """\
Check that the actor -> rollout engine weight sync is exact.

Loads the HF model into the Megatron actor (--tp x --pp processes) and into a rollout engine on
rank 0, changes every actor weight (--update perturb: all scaled by 1 + 2^-6; --update step: one
optimizer step), syncs with the trainer's code path (--sync-mode: gather, or shared_memory where
each TP rank writes only its own slices; auto picks like the trainer), and reports
  * per tensor: engine weight == actor's HF export, bit for bit (in the engine dtype);
  * the log-prob mismatch of responses the engine samples: mean / max |engine - actor| and the
    k3 KL estimate, over all response tokens.
Exit code 0 if every tensor is equal and max |diff| <= --tolerance, 1 if not (or when the check
could not finish), 2 on bad arguments.

Run it as a plain command: it starts tp x pp x ep processes itself (torch.distributed.run; gloo
on CPU), plus --rollout-ranks with --placement separate. Under torchrun / srun it uses the ranks
it is given (world = multiple of tp x pp, plus the rollout ranks, and --ep must divide the
data-parallel size). With --placement separate the weights travel to the engines' own ranks as in
training (full tensors over the bridge: NCCL on GPUs, gloo on CPU); each engine is checked.
A mixture of experts at --ep > 1 syncs through the gather path (each rank holds only its own
experts; the shard modes are refused).
With --dtype bfloat16 expect max |diff| of 0.1-1 nats from kernel differences alone: raise
--tolerance accordingly; float32 (the default) should give ~1e-5 or less.
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = DESCRIPTION
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.add_argument("--hf-dir", required=True, help="HuggingFace model directory (config.json + safetensors)")
    parser.add_argument("--engine", choices=("embedded", "vllm", "sglang"), default="embedded",
                        help="rollout engine (default: embedded); sglang runs on rank 0 with TP = --tp")  # fmt: skip
    parser.add_argument("--tp", type=int, default=1, help="actor tensor-parallel size (default 1)")
    parser.add_argument("--pp", type=int, default=1, help="actor pipeline-parallel size (default 1)")
    parser.add_argument("--vpp", type=int, default=None, help="virtual pipeline stages per rank (default: none)")
    parser.add_argument("--ep", type=int, default=1,
                        help="actor expert-parallel size of a mixture-of-experts model (parallel.ep; default 1): "
                        "each MoE layer's experts split over --ep ranks")  # fmt: skip
    parser.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="float32",
                        help="actor and engine dtype (default float32: exact comparison)")  # fmt: skip
    parser.add_argument("--tolerance", type=float, default=1e-3,
                        help="largest allowed per-token |engine - actor| log-prob difference (default 1e-3)")  # fmt: skip
    parser.add_argument("--update", choices=("perturb", "step"), default="perturb",
                        help="how the actor's weights change before the sync: scale every weight by 1 + 2^-6 "
                        "(default; every tensor changes, so a missed one is caught) or one optimizer step")  # fmt: skip
    parser.add_argument("--lr", type=float, default=1e-4, help="learning rate of --update step (default 1e-4)")
    parser.add_argument("--num-prompts", type=int, default=4, help="random prompts to sample from (default 4)")
    parser.add_argument("--responses-per-prompt", type=int, default=2, help="samples per prompt (default 2)")
    parser.add_argument("--prompt-length", type=int, default=16, help="tokens per random prompt (default 16)")
    parser.add_argument("--max-new-tokens", type=int, default=32, help="response length limit (default 32)")
    parser.add_argument("--temperature", type=float, default=1.0, help="sampling temperature (default 1.0)")
    parser.add_argument("--seed", type=int, default=0, help="seed of prompts, sampling and --update step")
    parser.add_argument("--bucket-mb", type=float, default=512, help="weight-sync bucket size in MB (rollout.weight_sync_bucket_mb)")
    parser.add_argument("--sync-mode", choices=("auto", "gather", "shared_memory", "tp_shards"), default="auto",
                        help="how TP shards reach the engine (rollout.weight_sync_mode): gather full tensors, each TP "
                        "rank writes its own slices to /dev/shm (leader placement) or loads them into its own engine "
                        "shard (spmd); auto (default) picks like the trainer")  # fmt: skip
    parser.add_argument("--placement", choices=("leader", "spmd", "separate"), default="leader",
                        help="rollout.placement: one engine on rank 0 (default); vLLM SPMD: every rank holds its "
                        "shard of an engine with TP = --tp (vllm only); or separate: the engines on --rollout-ranks "
                        "processes of their own, the weights pushed over the bridge as in training")  # fmt: skip
    parser.add_argument("--rollout-ranks", type=int, default=1,
                        help="--placement separate: processes (GPUs) that hold the engines, after the actor's "
                        "(rollout.num_gpus; default 1)")  # fmt: skip
    parser.add_argument("--rollout-tp", type=int, default=1,
                        help="--placement separate: tensor-parallel size of each engine (rollout.tp; default 1): "
                        "--rollout-ranks / --rollout-tp engines")  # fmt: skip
    parser.add_argument("--only-failures", action="store_true", help="list only the tensors that differ")
    parser.add_argument("--corrupt-tensor", metavar="NAME", default=None,
                        help="self-test: after the sync, overwrite this HF tensor in the engine with a perturbed "
                        "copy; the check must then fail (proves it can see a bad tensor on your setup)")  # fmt: skip
    parser.add_argument("--transformer-engine", choices=("auto", "on", "off"), default="auto",
                        help="actor layer implementation (default auto: TE when usable)")  # fmt: skip
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.3, help="vLLM: share of GPU memory (default 0.3)")
    parser.add_argument("--kv-cache-mb", type=int, default=None,
                        help="vLLM: KV cache size in MB (default: 256 on CPU, from --gpu-memory-utilization on GPU)")  # fmt: skip
    parser.add_argument("--timeout-s", type=float, default=900, help="collective timeout in seconds (default 900)")


def launched_by_a_launcher(env: Optional[Mapping[str, str]] = None) -> bool:
    """True under torchrun (RANK / WORLD_SIZE) or inside an srun step (not a bare sbatch shell)."""
    env = os.environ if env is None else env
    if "RANK" in env and "WORLD_SIZE" in env:
        return True
    in_step = "SLURM_STEP_ID" in env or "SLURM_STEPID" in env
    return in_step and "SLURM_PROCID" in env and "SLURM_NTASKS" in env


def to_argv(args: argparse.Namespace) -> list[str]:
    """The command-line options that reproduce `args` (for the re-executed processes)."""
    argv: list[str] = []
    for action_dest, value in sorted(vars(args).items()):
        if action_dest.startswith("_") or action_dest == "command" or value is None or value is False:
            continue
        flag = "--" + action_dest.replace("_", "-")
        argv += [flag] if value is True else [flag, str(value)]
    return argv


def _check_arguments(args: argparse.Namespace) -> None:
    check_flags(args, at_least=dict.fromkeys(
        ("tp", "pp", "ep", "num_prompts", "responses_per_prompt", "prompt_length", "max_new_tokens", "rollout_ranks", "rollout_tp"), 1))  # fmt: skip
    if args.placement == "spmd" and args.engine != "vllm":
        raise InputError("--placement spmd needs --engine vllm")
    if args.placement != "separate" and (args.rollout_ranks != 1 or args.rollout_tp != 1):
        raise InputError("--rollout-ranks and --rollout-tp are for --placement separate (the engines on ranks of their own)")
    if args.placement == "separate" and args.rollout_ranks % args.rollout_tp:
        raise InputError(f"--rollout-ranks {args.rollout_ranks} is not a whole number of engines of --rollout-tp {args.rollout_tp}")
    config_file = Path(args.hf_dir) / "config.json"
    if not config_file.is_file():
        raise InputError(f"{args.hf_dir} is not an HF model directory (no config.json)")
    # The model's experts against --ep and the sync mode against the layout, before any process starts.
    from megatron_dapo.distributed.layout import experts_per_rank
    from megatron_dapo.distributed.placement import check_sync_mode

    hf = json.loads(config_file.read_text())
    experts_per_rank(int(hf.get("num_experts") or hf.get("num_local_experts") or 0), args.ep)
    check_sync_mode(args.sync_mode, args.placement, args.tp, args.tp if args.placement == "spmd" else None, args.ep)


def processes(args: argparse.Namespace) -> int:
    """How many processes the plain command starts: the actor's tp x pp x ep (one data-parallel
    replica per EP rank), plus the engines' own ranks in the separate placement."""
    return args.tp * args.pp * args.ep + (args.rollout_ranks if args.placement == "separate" else 0)


def _relaunch(args: argparse.Namespace, nproc: int) -> bool:
    """Run this command on `nproc` local processes under torch.distributed.run; True when it passed."""
    port = find_free_port()
    package_root = str(Path(megatron_dapo.__file__).resolve().parent.parent)
    with tempfile.TemporaryDirectory(prefix="check_sync_") as tmp:
        result_file = Path(tmp) / "result.json"
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH")) if p)
        env.setdefault("OMP_NUM_THREADS", "1")
        env[RESULT_FILE_ENV] = str(result_file)
        command = [
            sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc_per_node", str(nproc),
            "--master_addr", "127.0.0.1", "--master_port", str(port), "-m", "megatron_dapo.cli", "check-sync", *to_argv(args),
        ]  # fmt: skip
        shape = f"tp={args.tp} x pp={args.pp}" + (f" x ep={args.ep}" if args.ep > 1 else "")
        if args.placement == "separate":
            shape += f", + {args.rollout_ranks} for the engines"
        print(f"check-sync: starting {nproc} processes ({shape}) with torch.distributed.run", flush=True)
        code = subprocess.call(command, env=env)
        if not result_file.is_file():
            raise StopError(f"the check-sync processes failed before reaching a verdict (exit code {code}; their output is above)")
        return bool(json.loads(result_file.read_text())["passed"])


def run(args: argparse.Namespace) -> int:
    _check_arguments(args)
    nproc = processes(args)
    launched = launched_by_a_launcher()
    if not launched and nproc > 1:
        return EXIT_PASS if _relaunch(args, nproc) else EXIT_FAIL

    from megatron_dapo.trainer.check_sync import run_check

    if not launched:
        return EXIT_PASS if run_check(args, env={}) else EXIT_FAIL  # one process, no launcher: a private world of one
    result_file = os.environ.get(RESULT_FILE_ENV)
    passed = run_check(args, env=None, result_file=Path(result_file) if result_file else None)
    if result_file:
        return EXIT_PASS  # started by `_relaunch`: the parent reads the verdict; torchrun stays quiet
    return EXIT_PASS if passed else EXIT_FAIL
