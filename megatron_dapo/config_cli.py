"""`megatron-dapo config FILE [key=value ...]`: show the resolved configuration or say what is wrong."""

from __future__ import annotations

import argparse
import json
import sys

from megatron_dapo.config import ConfigError, config_to_dict, load_config


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", nargs="?", help="YAML file (omit to start from the built-in defaults)")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. trainer.total_steps=10 rollout.n=8")
    parser.add_argument("--world-size", type=int, default=None, help="also check the layout for this many processes")


def run(args: argparse.Namespace) -> int:
    config_path, overrides = args.config, list(args.overrides)
    if config_path is not None and "=" in config_path:
        config_path, overrides = None, [config_path, *overrides]
    try:
        cfg = load_config(config_path, overrides)
        if args.world_size is not None:
            cfg.resolve_world(args.world_size)
    except ConfigError as exc:
        print(f"config error: {exc}", file=sys.stderr)
        return 1
    print(json.dumps(config_to_dict(cfg), indent=2))
    return 0
