"""`megatron-dapo demo`: the main job on a CPU machine - a tiny model learns arithmetic with DAPO.

Three phases, all with the real trainer code (Megatron-Core actor, rollout engine, reward, dynamic
sampling, checkpoints):

1. workspace (`outputs/demo` by default, once): the demo tokenizer (a byte-level BPE trained on the
   task's text), a randomly initialised Qwen2-shaped model (head_dim 32, which vLLM's CPU attention
   supports), and the arithmetic task in the verl/DAPO schema - train and held-out validation
   parquet files, and an SFT file whose `response` is a short worked solution;
2. supervised warm start (`sft` section of the config) so that the model writes the `Answer:` line;
3. DAPO (the rest of the config) from the SFT checkpoint, validating before training and every
   `trainer.eval_every` steps; the before/after validation accuracy is printed at the end, and the
   curves are in `<trainer.output_dir>/plot.png`.

    megatron-dapo demo                                          # one process
    torchrun --nproc_per_node 2 -m megatron_dapo.cli demo parallel.tp=2
    megatron-dapo demo rollout.engine=vllm                      # vLLM's CPU build, real weight sync
    megatron-dapo demo --model moe                              # a tiny Qwen3-MoE (8 experts, top-2)
    torchrun --nproc_per_node 2 -m megatron_dapo.cli demo --model moe parallel.ep=2

`--model moe` swaps the model for a Qwen3-MoE of the same width (8 experts of width 96, 2 routed per
token, ~1.9M parameters, ~0.7M active): the same task, trained with the MoE layers of Megatron-Core
(expert parallelism with `parallel.ep`), pushed into the engine expert by expert. Its workspace is
`outputs/demo-moe` unless --workspace says otherwise.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

from megatron_dapo.cli.job import guarded
from megatron_dapo.data.demo import DEMO_MODELS, prepare_workspace, workspace_paths  # noqa: F401  (prepare_workspace: public here too)
from megatron_dapo.errors import StopError

DEFAULT_CONFIG = Path(__file__).resolve().parents[2] / "configs" / "tiny_cpu.yaml"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.epilog = __doc__
    parser.add_argument("--config", default=str(DEFAULT_CONFIG), help="YAML config (default: configs/tiny_cpu.yaml)")
    parser.add_argument("--model", choices=DEMO_MODELS, default="dense",
                        help="dense: a tiny Qwen2 (default); moe: a tiny Qwen3-MoE (8 experts, top-2; see below)")
    parser.add_argument("--workspace", default=None,
                        help="model, data and runs go here (default outputs/demo, or outputs/demo-moe with --model moe)")
    parser.add_argument("--max-operand", type=int, default=50, help="problems a +- b with 0 <= a, b <= this (default 50)")
    parser.add_argument("--skip-sft", action="store_true", help="reuse the workspace's SFT checkpoint when there is one")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. trainer.total_steps=5 parallel.tp=2")


def _wait_for(path: Path, timeout_s: float = 600.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        if time.monotonic() > deadline:
            # A StopError: one line for the user (rank 0 died or is stuck; its own output says why).
            raise StopError(f"rank 0 did not finish preparing {path.parent} within {timeout_s:.0f} s: see rank 0's output above")
        time.sleep(0.5)


def _val_accuracy(metrics_file: Path) -> list[tuple[int, float]]:
    from megatron_dapo.tracking import read_metrics

    points = []
    for record in read_metrics(metrics_file):
        for key, value in record.items():
            if key.startswith("val/acc/mean@"):
                points.append((int(record["step"]), float(value)))
    return points


def run(args: argparse.Namespace) -> int:
    from megatron_dapo.config import load_config
    from megatron_dapo.distributed.launch import resolve_launch_env
    from megatron_dapo.trainer.loop import train
    from megatron_dapo.trainer.sft import run_sft

    root = Path(args.workspace or ("outputs/demo" if args.model == "dense" else "outputs/demo-moe"))
    paths = workspace_paths(root)
    overrides = [
        f"model.hf_dir={paths['model']}",
        f"data.train_files=[{paths['train']}]",
        f"data.val_files=[{paths['val']}]",
        f"sft.train_files=[{paths['sft']}]",
        f"sft.output_dir={root / 'sft'}",
        f"trainer.output_dir={root / 'dapo'}",
        *args.overrides,
    ]
    cfg = load_config(args.config, overrides)  # a mistyped override stops here, before the workspace is built
    launch = resolve_launch_env(os.environ, free_port=0)
    started = time.perf_counter()
    if launch.rank != 0:
        _wait_for(root / ".ready")
    prepare_workspace(root, seed=7, max_operand=args.max_operand, model=args.model)  # rank 0 builds it; the others find it ready
    say = print if launch.rank == 0 else (lambda *a, **k: None)
    sft_root = Path(cfg.sft.output_dir) / "checkpoints"

    def both_phases() -> None:
        if cfg.sft.total_steps and not (args.skip_sft and (sft_root / "latest").exists()):
            say(f"== phase 1: supervised warm start, {cfg.sft.total_steps} steps")
            run_sft(cfg, say=say, keep_process_group=True)
        if (sft_root / "latest").exists():
            cfg.model.megatron_checkpoint = str(sft_root)
        say(f"== phase 2: DAPO, {cfg.trainer.total_steps} steps (rollout engine: {cfg.rollout.engine})")
        train(cfg, say=say, overwrite=True)  # each demo run starts its DAPO phase afresh

    code = guarded(both_phases)
    if code == 0 and launch.rank == 0:
        points = _val_accuracy(Path(cfg.trainer.output_dir) / "metrics.jsonl")
        if points:
            (first_step, first), (last_step, last) = points[0], points[-1]
            print(f"\nvalidation accuracy (avg@{cfg.rollout.val_n}): {first:.3f} at step {first_step} -> {last:.3f} at step {last_step}")
        print(f"curves: {Path(cfg.trainer.output_dir) / 'plot.png'}; metrics: {Path(cfg.trainer.output_dir) / 'metrics.jsonl'}; "
              f"total {time.perf_counter() - started:.0f} s")  # fmt: skip
    return code
