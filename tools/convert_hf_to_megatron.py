#!/usr/bin/env python
"""Convert a HuggingFace model directory into a Megatron distributed checkpoint (one process, streaming).

    python tools/convert_hf_to_megatron.py --hf-dir Qwen2.5-7B --output ckpt/qwen7b --tp 4 --pp 2

Same as `megatron-dapo convert hf-to-megatron`; see megatron_dapo/checkpoint/conversion.py and --help.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # runs from a checkout without installing

from megatron_dapo.checkpoint.conversion import HF_TO_MEGATRON_DESCRIPTION, add_hf_to_megatron_arguments, run_hf_to_megatron  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="convert_hf_to_megatron.py",
        description=HF_TO_MEGATRON_DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_hf_to_megatron_arguments(parser)
    return run_hf_to_megatron(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
