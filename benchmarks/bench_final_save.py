"""The final save's two fully reshardable optimizer formats against each other and the periodic one:
`benchmarks/bench_checkpoint.py` with one more variant.

    torchrun --nproc_per_node 2 benchmarks/bench_final_save.py [--rounds 5] [bench_checkpoint.py's options]

Variants (all with 2 writer threads per rank, Megatron's fully parallel save over DP, checksums; the
load verifies them):

  final        fully_reshardable: the optimizer state gathered over gloo into DP rank 0 and written there
  model-space  fully_sharded_model_space: every rank writes its own part of the same tensors
  after        dp_reshardable: the periodic save (every rank writes its own bucket shard; same TP/PP only)

Reported as bench_checkpoint.py reports: median (min-max) seconds of save and load, MB of tensor data
each rank wrote, files.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import bench_checkpoint  # noqa: E402

bench_checkpoint.VARIANTS["model-space"] = dict(
    optimizer_format="fully_sharded_model_space", write_threads=2, parallel_save=True, checksums=True, verify=True
)

if __name__ == "__main__":
    if not any(a.startswith("--variants") for a in sys.argv[1:]):
        sys.argv += ["--variants", "final,model-space,after"]
    bench_checkpoint.main()
