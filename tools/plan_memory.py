#!/usr/bin/env python
"""Per-GPU memory plan of a DAPO config on a cluster, and the largest micro-batch token budget that fits.

    python tools/plan_memory.py configs/dapo_qwen2.5_7b.yaml --model qwen2.5-7b --nodes 2
    python tools/plan_memory.py configs/dapo_qwen2.5_32b.yaml --model qwen2.5-32b --nodes 8 --json

Runs `megatron-dapo plan` from a checkout; see megatron_dapo/plan/ (what is counted and why) and --help.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # runs from a checkout without installing

from megatron_dapo.cli.main import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(["plan", *sys.argv[1:]]))
