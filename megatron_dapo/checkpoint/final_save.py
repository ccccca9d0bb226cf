"""Which fully reshardable format the final save uses: whether `fully_reshardable`'s gather fits.

The save after the last step (`trainer.final_checkpoint_reshardable`) is written so that the
finished run continues at any TP / PP / VPP / EP / DP. Two optimizer formats do that
(`optimizer_state.ANY_LAYOUT_FORMATS`), with the same tensors on disk:

- `fully_reshardable` (Megatron's): the distributed optimizer's state is gathered over gloo into
  the CPU memory of DP rank 0 of every model-parallel position (of the dense data-parallel group for
  the dense parameters, of the expert data-parallel group for the experts), 12 bytes per parameter
  (fp32 main weight, Adam's two moments), and written from there. With TP x CP = 8 every dense DP
  rank 0 sits on node 0, which then holds the whole model's state: ~393 GB for 32B parameters, beside
  the pinned offload buffers of the run; an OOM there would kill the job at its very end.
- `fully_sharded_model_space` (`model_space.py`): every rank writes its own part, nothing is
  gathered, no host memory beyond the writer's.

The final save uses `fully_reshardable` where it fits and `fully_sharded_model_space` otherwise: before
the save every rank reports its node, how many parameters' state it would receive, and the node's
available memory; `final_save_fits` decides (pure, the same on every rank). `fully_reshardable` is kept
where it fits as Megatron's own, long-standing path; the model-space format is faster to write and to
read (docs/PERF.md), and lighter to load: Megatron's `fully_reshardable` loader has every rank read its
whole TP x PP slice of the state into host memory (12 bytes per parameter of the slice, on every node),
the model-space loader each rank's own part.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

__all__ = [
    "GATHERED_BYTES_PER_PARAMETER",
    "HEADROOM",
    "RankShare",
    "available_host_memory",
    "final_save_fits",
    "gathered_parameters",
]

GATHERED_BYTES_PER_PARAMETER = 12
"""fp32 main weight + Adam's exp_avg and exp_avg_sq, per parameter of the gathered shard."""
HEADROOM = 0.8
"""Only this share of a node's available memory is counted on: the gather's own buffers, the
writer's copies and the page cache of the files being written need the rest."""


@dataclass(frozen=True)
class RankShare:
    """One rank's part in a `fully_reshardable` save."""

    host: str
    gathered: int
    """Parameters whose optimizer state lands on this rank (`gathered_parameters`)."""
    available: int
    """Bytes of host memory available on this rank's node (MemAvailable)."""


def gathered_parameters(dense: int, expert: int, dp_rank: int, expert_dp_rank: int) -> int:
    """Parameters whose optimizer state a rank receives in a `fully_reshardable` save (pure).

    `dense`, `expert`: the rank's own parameters (its TP / PP / EP shard) outside and inside the
    experts. Each distributed optimizer gathers into rank 0 of the group it is sharded over: the
    dense one over data parallel x context parallel (`dp_rank`: this rank's place there), the
    experts' one over the expert data-parallel group (`expert_dp_rank`), whose rank 0 is another
    rank whenever EP > 1."""
    return (dense if dp_rank == 0 else 0) + (expert if expert_dp_rank == 0 else 0)


def final_save_fits(shares: Sequence[RankShare], headroom: float = HEADROOM) -> tuple[bool, str]:
    """(whether every node can hold the state its ranks receive, why: the tightest node's figures)."""
    need: dict[str, int] = {}
    available: dict[str, int] = {}
    for share in shares:
        available[share.host] = min(available.get(share.host, share.available), share.available)
        if share.gathered:
            need[share.host] = need.get(share.host, 0) + GATHERED_BYTES_PER_PARAMETER * share.gathered
    if not need:
        return True, "nothing is gathered"
    host = max(need, key=lambda h: (need[h] - headroom * available[h], need[h]))
    fits = all(bytes_ <= headroom * available[h] for h, bytes_ in need.items())
    return fits, (
        f"the fully_reshardable final save would gather {_size(need[host])} of optimizer state on node {host}, "
        f"which has {_size(available[host])} available ({headroom:.0%} of it usable)"
    )


def _size(num_bytes: float) -> str:
    """`num_bytes` in the largest binary unit that keeps it >= 1 (a tiny model's state is not "0.0 GiB")."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if num_bytes >= scale:
            return f"{num_bytes / scale:.1f} {unit}"
    return f"{int(num_bytes)} B"


def available_host_memory(meminfo: str = "/proc/meminfo") -> int:
    """This node's MemAvailable in bytes (0 where the kernel does not say: nothing is gathered then)."""
    try:
        with open(meminfo, encoding="ascii") as handle:
            for line in handle:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0
