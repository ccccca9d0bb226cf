"""`megatron-dapo config FILE [key=value ...]`: show the resolved configuration or say what is wrong.

Checks what `train` checks before anything loads, as far as this machine can: the config itself,
with `--world-size` the layout and batch splits, the reward function (imported), and when
`model.hf_dir` is readable here the model's architecture and shape against the layout, its tokenizer
files and weight-file headers. Checks it cannot run are named on stderr. Exit code 2 on an error.
"""

from __future__ import annotations

import argparse
import json
import sys


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", nargs="?", help="YAML file (omit to start from the built-in defaults)")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. trainer.total_steps=10 rollout.n=8")
    parser.add_argument("--world-size", type=int, default=None, help="also check the layout for this many processes")


def run(args: argparse.Namespace) -> int:
    from megatron_dapo.config import config_to_dict, load_config, skipped_model_checks
    from megatron_dapo.trainer.startup import check_model_files, check_reward_function

    config_path, overrides = args.config, list(args.overrides)
    if config_path is not None and "=" in config_path:
        config_path, overrides = None, [config_path, *overrides]
    cfg = load_config(config_path, overrides)
    if args.world_size is not None:
        cfg.resolve_world(args.world_size)
    check_reward_function(cfg)
    skipped = skipped_model_checks(cfg)
    if skipped is None:
        check_model_files(cfg)
    print(json.dumps(config_to_dict(cfg), indent=2))
    if skipped is not None:
        print(f"note: {skipped}", file=sys.stderr)
    return 0
