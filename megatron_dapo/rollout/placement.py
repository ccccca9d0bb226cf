"""Where rollout engines run: which ranks build one, which generate, and how prompts are split (pure).

Two placements (`rollout.placement`):

* "leader": one engine per data-parallel replica of the actor, built on the replica's first rank
  (`distributed.objects.is_replica_leader`), which spawns `rollout.tp` workers on its own node.
  That rank generates the replica's share of the prompts; the replica's other ranks wait.
* "spmd": the world is cut into rollout-TP groups of `rollout.tp` consecutive ranks (the layout
  vLLM's external launcher uses inside an existing torch.distributed world). Every rank holds its
  TP shard of its group's engine; all ranks of a group generate together, for the group's share
  of the prompts (the rollout-DP split: `world / rollout.tp` shares), and the group's first rank
  hands the results on. Consecutive ranks keep a group on one node, as launchers place them.

"auto" is spmd for vLLM (the only engine here that runs SPMD) and leader for the others.
"""

from __future__ import annotations

from dataclasses import dataclass

PLACEMENT_CHOICES = ("auto", "spmd", "leader")
SPMD_ENGINES = ("vllm",)


def resolve_placement(requested: str, engine: str) -> str:
    """The placement "spmd" or "leader" that `rollout.placement=requested` means for `rollout.engine=engine`."""
    if requested not in PLACEMENT_CHOICES:
        raise ValueError(f"unknown rollout.placement {requested!r}; use one of {', '.join(PLACEMENT_CHOICES)}")
    if requested == "auto":
        return "spmd" if engine in SPMD_ENGINES else "leader"
    if requested == "spmd" and engine not in SPMD_ENGINES:
        raise ValueError(f"rollout.placement=spmd needs rollout.engine in {SPMD_ENGINES}, got {engine!r}: use auto or leader")
    return requested


@dataclass(frozen=True)
class SpmdSlot:
    """One rank's place in the spmd placement."""

    rank: int
    world_size: int
    tp: int

    def __post_init__(self) -> None:
        if self.tp < 1:
            raise ValueError(f"rollout.tp must be >= 1, got {self.tp}")
        if self.world_size < 1 or self.world_size % self.tp:
            raise ValueError(
                f"rollout.tp={self.tp} must divide the world size {self.world_size} (rollout.placement=spmd): "
                "launch a multiple of rollout.tp processes or change rollout.tp"
            )
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} is outside the world of size {self.world_size}")

    @property
    def tp_rank(self) -> int:
        """This rank's TP rank inside its engine."""
        return self.rank % self.tp

    @property
    def group_ranks(self) -> tuple[int, ...]:
        """The global ranks of this rank's rollout-TP group, TP rank order."""
        first = self.rank - self.tp_rank
        return tuple(range(first, first + self.tp))

    @property
    def data_rank(self) -> int:
        """Which share of the prompts this rank's group generates (rollout-DP rank)."""
        return self.rank // self.tp

    @property
    def data_size(self) -> int:
        """How many groups share the prompts (rollout-DP size)."""
        return self.world_size // self.tp

    @property
    def hands_on_results(self) -> bool:
        """The group's first rank: the one whose outputs are gathered to every rank."""
        return self.tp_rank == 0
