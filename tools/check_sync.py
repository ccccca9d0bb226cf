#!/usr/bin/env python
"""Check that the actor -> rollout engine weight sync is exact (per-tensor equality, log-prob mismatch).

    python tools/check_sync.py --hf-dir Qwen2.5-0.5B --engine embedded --tp 2
    python tools/check_sync.py --hf-dir Qwen2.5-7B --engine vllm --tp 4 --pp 2 --dtype bfloat16 --tolerance 0.5

Same as `megatron-dapo check-sync`; see megatron_dapo/rollout/sync/check.py and --help.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # runs from a checkout without installing

from megatron_dapo.rollout.sync.check import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
