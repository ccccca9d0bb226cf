"""`megatron-dapo plan [FILE] [key=value ...] [options]`: the per-GPU memory plan of a config on a cluster.

    megatron-dapo plan configs/dapo_qwen2.5_7b.yaml --model qwen2.5-7b --nodes 2
    megatron-dapo plan configs/dapo_qwen2.5_32b.yaml --model qwen2.5-32b --nodes 8 --json

Prints actor params / grads / optimizer (with and without the distributed optimizer), reference,
rollout weights and KV cache, activations, the largest trainer.max_tokens_per_micro_batch that fits,
and the largest rollout.gpu_memory_utilization with and without actor offload (actor.offload_*) and
the host memory offload takes; what is counted and why: `megatron_dapo/plan/`. Exit status 0 when
the plan fits, 3 when it does not; a config or model error is reported by the command line's one
handler (exit 2).
"""

from __future__ import annotations

import argparse
import json

from megatron_dapo.cli.main import check_flags, sort_trailing_options
from megatron_dapo.config import load_config

# The planner imports neither torch nor Megatron (fast --help), and its tables are the choices --help lists.
from megatron_dapo.plan import (
    DEFAULT_GPU,
    DEFAULT_RESERVE_GIB,
    GPU_MODELS,
    KNOWN_MODELS,
    ClusterShape,
    format_plan,
    plan_memory,
    resolve_model,
)

EXIT_DOES_NOT_FIT = 3


def _add_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model",
        choices=sorted(KNOWN_MODELS),
        type=str.lower,
        help="a built-in model shape (no download); default: model.hf_dir's config.json",
    )
    parser.add_argument("--nodes", type=int, default=1, help="number of nodes (default 1)")
    parser.add_argument("--gpus-per-node", type=int, default=8, help="GPUs per node (default 8)")
    parser.add_argument(
        "--gpu",
        choices=sorted(GPU_MODELS),
        type=str.lower,
        default=DEFAULT_GPU,
        help="the GPU model: its memory as torch reports it and vLLM's batch defaults on it (default h100: "
        + ", ".join(f"{k} {v.memory_gib} GiB" for k, v in GPU_MODELS.items())
        + ")",
    )
    parser.add_argument(
        "--gpu-memory-gib",
        type=float,
        default=None,
        help="memory of one GPU in GiB as torch.cuda.get_device_properties reports it (default: the --gpu figure)",
    )
    parser.add_argument(
        "--reserve-gib",
        type=float,
        default=DEFAULT_RESERVE_GIB,
        help=f"memory kept free for the CUDA context, NCCL and fragmentation (default {DEFAULT_RESERVE_GIB})",
    )
    parser.add_argument("--json", action="store_true", help="print the plan as JSON (bytes) instead of a table")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options may come before or after the config and its overrides (`plan FILE --nodes 2 key=value`):
    argparse's `parse_args` cannot mix positionals and options, so everything after the config is
    taken as it is and sorted out in `run`."""
    parser.epilog = f"exit status: 0 the plan fits, {EXIT_DOES_NOT_FIT} it does not, 2 a config or model error"
    parser.add_argument("config", nargs="?", help="YAML file (omit to start from the built-in defaults)")
    _add_options(parser)
    parser.add_argument(
        "overrides", nargs=argparse.REMAINDER, help="dotted overrides, e.g. parallel.tp=4 rollout.tp=2"
    )



def run(args: argparse.Namespace) -> int:
    """Print the plan; 0 if it fits, 3 if it does not."""
    args = sort_trailing_options(args, _add_options, "megatron-dapo plan")
    config_path, overrides = args.config, list(args.overrides)
    if config_path is not None and "=" in config_path:  # only overrides, no file
        config_path, overrides = None, [config_path, *overrides]
    check_flags(args, at_least={"nodes": 1, "gpus_per_node": 1, "reserve_gib": 0}, above={"gpu_memory_gib": 0})
    gpu_gib = GPU_MODELS[args.gpu].memory_gib if args.gpu_memory_gib is None else args.gpu_memory_gib
    cfg = load_config(config_path, overrides)
    name, model = resolve_model(cfg, args.model)
    cluster = ClusterShape(args.nodes, args.gpus_per_node, gpu_gib, args.gpu)
    plan = plan_memory(cfg, model, cluster, reserve_gib=args.reserve_gib, model_name=name)
    print(json.dumps(plan.to_dict(), indent=2) if args.json else format_plan(plan))
    return 0 if plan.fits else EXIT_DOES_NOT_FIT
