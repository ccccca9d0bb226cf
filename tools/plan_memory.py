#!/usr/bin/env python
"""Per-GPU memory plan of a DAPO config on a cluster, and the largest micro-batch token budget that fits.

    python tools/plan_memory.py configs/dapo_qwen2.5_7b.yaml --model qwen2.5-7b --nodes 2
    python tools/plan_memory.py configs/dapo_qwen2.5_32b.yaml --model qwen2.5-32b --nodes 8 --json

The command `megatron-dapo plan` (see its --help), for a checkout that is not installed.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # runs from a checkout without installing

from megatron_dapo.cli.main import main as megatron_dapo  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    """`megatron-dapo plan ARGV` (default: this script's arguments)."""
    return megatron_dapo(["plan", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    sys.exit(main(["plan", *sys.argv[1:]]))
