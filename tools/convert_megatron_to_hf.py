#!/usr/bin/env python
"""Export the model of a Megatron checkpoint to a HuggingFace directory (one process, streaming).

    python tools/convert_megatron_to_hf.py --megatron-dir runs/dapo/checkpoints --output exported/

The command `megatron-dapo convert megatron-to-hf` (see its --help), for a checkout that is not installed.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # runs from a checkout without installing

from megatron_dapo.cli.main import main as megatron_dapo  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    """`megatron-dapo convert megatron-to-hf ARGV` (default: this script's arguments)."""
    return megatron_dapo(["convert", "megatron-to-hf", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    sys.exit(main())
