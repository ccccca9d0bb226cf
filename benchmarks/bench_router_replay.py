"""Rollout routing replay: the rollout/trainer log-prob mismatch of a tiny MoE with `actor.router_replay`
off (the actor routes as it likes) and r3 (it replays the engine's routing), through the real trainer.

    python benchmarks/bench_router_replay.py [--dtype bfloat16 --steps 3 --modes off,r3 --out DIR]

The demo's tiny Qwen3-MoE (8 experts, top-2; `megatron-dapo demo --model moe`) and its arithmetic
data, the embedded engine, one process, the test suite's small steps (4 prompts x 4 responses of at
most 16 tokens per step). Each mode is one training run of `--steps` steps from the same start with
the same seeds, so step 1 of every mode generates the same responses: its mismatch is a paired
comparison of the old-log-prob pass alone. Dynamic sampling is off (the untrained model solves none
of the problems, so every advantage is 0 and only the routers' auxiliary loss moves the weights):
later steps generate nearly the same responses in every mode too.

Printed per mode and step: `rollout_mismatch/{mean_abs,max_abs}` (|engine - actor| log-prob of the
sampled tokens) and, where the actor routed on its own, `rollout_mismatch/routing_token_frac` (tokens
sent to another expert set than the engine's in at least one layer) and `routing_layer_frac` ((token,
layer) pairs). Not a timing benchmark: the figures are deterministic on one machine type.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

STEP_SETTINGS = [
    "rollout.n=4", "rollout.max_response_length=16", "algorithm.overlong_buffer.len=4", "trainer.gen_batch_size=8",
    "trainer.train_batch_size=4", "trainer.ppo_mini_batch_size=2", "trainer.micro_batch_size=4", "trainer.eval_every=0",
    "trainer.val_before_train=false", "trainer.save_every=0", "trainer.loggers=[jsonl]", "reward.num_workers=1",
    # The untrained demo MoE solves none of the arithmetic: without dynamic sampling each step trains
    # on its first generation batch (advantages 0), which is all this measurement needs.
    "algorithm.filter_groups.enable=false",
]  # fmt: skip
KEYS = ("mean_abs", "max_abs", "routing_token_frac", "routing_layer_frac")


def run(mode: str, dtype: str, steps: int, workspace: dict, out: Path) -> dict[int, dict]:
    command = [
        sys.executable, "-m", "megatron_dapo.cli", "train", "--config", str(REPO / "configs" / "tiny_cpu.yaml"),
        *STEP_SETTINGS, f"trainer.total_steps={steps}", f"model.dtype={dtype}", f"actor.router_replay={mode}",
        f"model.hf_dir={workspace['model']}", f"data.train_files=[{workspace['train']}]",
        f"data.val_files=[{workspace['val']}]", f"trainer.output_dir={out}", "--overwrite",
    ]  # fmt: skip
    proc = subprocess.run(command, cwd=REPO, capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(f"{mode}: the run failed\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return {int(row["step"]): row for row in rows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16"))
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--modes", default="off,r3", help="comma-separated actor.router_replay values")
    parser.add_argument("--out", default=None, help="directory for the workspace and the runs (default: a temporary one)")
    args = parser.parse_args()

    from megatron_dapo.cli.demo import prepare_workspace

    root = Path(args.out or tempfile.mkdtemp(prefix="bench_router_replay_"))
    workspace = prepare_workspace(root / "workspace", seed=7, num_train=200, num_val=8, model="moe")
    print(f"tiny Qwen3-MoE, {args.dtype}, embedded engine, {args.steps} steps per mode")
    print(f"{'mode':<5} {'step':>4} " + " ".join(f"{key:>19}" for key in KEYS))
    for mode in args.modes.split(","):
        metrics = run(mode, args.dtype, args.steps, workspace, root / mode)
        for step, row in sorted(metrics.items()):
            values = [row.get(f"rollout_mismatch/{key}") for key in KEYS]
            print(f"{mode:<5} {step:>4} " + " ".join(f"{'-' if v is None else f'{v:.6f}':>19}" for v in values))


if __name__ == "__main__":
    main()
