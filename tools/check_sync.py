#!/usr/bin/env python
"""Check that the actor -> rollout engine weight sync is exact (per-tensor equality, log-prob mismatch).

    python tools/check_sync.py --hf-dir Qwen2.5-0.5B --engine embedded --tp 2
    python tools/check_sync.py --hf-dir Qwen2.5-7B --engine vllm --tp 4 --pp 2 --dtype bfloat16 --tolerance 0.5

The command `megatron-dapo check-sync` (see its --help), for a checkout that is not installed.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # runs from a checkout without installing

from megatron_dapo.cli.main import main as megatron_dapo  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    """`megatron-dapo check-sync ARGV` (default: this script's arguments)."""
    return megatron_dapo(["check-sync", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    sys.exit(main())
