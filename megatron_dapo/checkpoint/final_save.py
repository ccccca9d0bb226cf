"""Whether the fully reshardable final save fits the host memory of the nodes that gather it.

A `fully_reshardable` save (`trainer.final_checkpoint_reshardable`, after the last step) gathers
the distributed optimizer's state over gloo into the CPU memory of DP rank 0 of every model-parallel
position: 12 bytes per parameter (fp32 main weight, Adam's two moments). With TP x CP = 8 every DP
rank 0 sits on node 0, which then holds the whole model's state: ~393 GB for 32B parameters, beside
the pinned offload buffers of the run. An OOM there kills the job at its very end, without the final
checkpoint. So before the final save every rank reports its node, whether it gathers and how many
parameters, and the node's available memory; `final_save_fits` decides (pure, the same on every
rank), and when a node cannot hold its share the save keeps `trainer.checkpoint_format` and says so:
the run's last checkpoint then resumes at the same TP / PP / VPP (like every periodic save), and its
weights convert to HF at any layout as always.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

__all__ = ["GATHERED_BYTES_PER_PARAMETER", "HEADROOM", "RankShare", "available_host_memory", "final_save_fits"]

GATHERED_BYTES_PER_PARAMETER = 12
"""fp32 main weight + Adam's exp_avg and exp_avg_sq, per parameter of the gathered shard."""
HEADROOM = 0.8
"""Only this share of a node's available memory is counted on: the gather's own buffers, the
writer's copies and the page cache of the files being written need the rest."""


@dataclass(frozen=True)
class RankShare:
    """One rank's part in a fully reshardable save."""

    host: str
    gathers: bool
    """DP rank 0 (of the dense data-parallel group): the state of its model shard lands here."""
    parameters: int
    """Parameters of this rank's model shard (its TP / PP / EP part)."""
    available: int
    """Bytes of host memory available on this rank's node (MemAvailable)."""


def final_save_fits(shares: Sequence[RankShare], headroom: float = HEADROOM) -> tuple[bool, Optional[str]]:
    """(True, None) when every node can hold the state its gathering ranks receive; else (False, why)."""
    need: dict[str, int] = {}
    available: dict[str, int] = {}
    for share in shares:
        available[share.host] = min(available.get(share.host, share.available), share.available)
        if share.gathers:
            need[share.host] = need.get(share.host, 0) + GATHERED_BYTES_PER_PARAMETER * share.parameters
    short = [(host, bytes_) for host, bytes_ in need.items() if bytes_ > headroom * available[host]]
    if not short:
        return True, None
    host, bytes_ = max(short, key=lambda item: item[1] - headroom * available[item[0]])
    gib = 2**30
    return False, (
        f"the fully reshardable final save would gather {bytes_ / gib:.1f} GiB of optimizer state on node {host}, which has "
        f"{available[host] / gib:.1f} GiB available ({headroom:.0%} of it usable)"
    )


def available_host_memory(meminfo: str = "/proc/meminfo") -> int:
    """This node's MemAvailable in bytes (0 where the kernel does not say: the save then keeps its format)."""
    try:
        with open(meminfo, encoding="ascii") as handle:
            for line in handle:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0
