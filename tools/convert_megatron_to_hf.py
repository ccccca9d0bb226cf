#!/usr/bin/env python
"""Export the model of a Megatron checkpoint to a HuggingFace directory (one process, streaming).

    python tools/convert_megatron_to_hf.py --megatron-dir runs/dapo/checkpoints --output exported/

Same as `megatron-dapo convert megatron-to-hf`; see megatron_dapo/checkpoint/conversion.py and --help.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # runs from a checkout without installing

from megatron_dapo.checkpoint.conversion import MEGATRON_TO_HF_DESCRIPTION, add_megatron_to_hf_arguments, run_megatron_to_hf  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="convert_megatron_to_hf.py",
        description=MEGATRON_TO_HF_DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_megatron_to_hf_arguments(parser)
    return run_megatron_to_hf(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
