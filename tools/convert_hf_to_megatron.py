#!/usr/bin/env python
"""Convert a HuggingFace model directory into a Megatron distributed checkpoint (one process, streaming).

    python tools/convert_hf_to_megatron.py --hf-dir Qwen2.5-7B --output ckpt/qwen7b --tp 4 --pp 2

The command `megatron-dapo convert hf-to-megatron` (see its --help), for a checkout that is not installed.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # runs from a checkout without installing

from megatron_dapo.cli.main import main as megatron_dapo  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    """`megatron-dapo convert hf-to-megatron ARGV` (default: this script's arguments)."""
    return megatron_dapo(["convert", "hf-to-megatron", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    sys.exit(main())
