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

"auto" is spmd for vLLM (the only engine here that runs SPMD) and leader for the others: the
resolved placement is part of the run's `ParallelLayout` (`layout.resolve_placement`).

Devices (`assign_engine_devices`, GPU runs): an engine computes only on GPUs of its own ranks. In the
spmd placement each rank opens its own GPU. In the leader placement the leader's engine takes the
first `rollout.tp` GPUs of its replica on the leader's node (replica ranks in (PP, CP, TP) order: the
leader's own GPU first); with actor TP 4 and rollout.tp 2 on 8 GPUs the leaders at local ranks 0
and 4 get GPUs 0-1 and 4-5. vLLM's processes are given them as CUDA_VISIBLE_DEVICES, SGLang as
`base_gpu_id` + `gpu_id_step` (it puts TP rank i on GPU base + i * step). A layout where an engine
would need a GPU outside its replica, one its leader cannot see, or one another engine uses is
refused with a `PlacementError` that names the keys to change.

The sizes (rollout.tp >= 1 and dividing the world) are rules of `distributed.layout`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Optional, Sequence, get_args

from megatron_dapo.distributed.layout import (  # the placement itself is a size of the layout
    PLACEMENT_CHOICES,
    SPMD_ENGINES,
    Placement,
    PlacementError,
    check_rollout_tp,
    check_sizes,
    resolve_placement,
)

__all__ = [
    "PLACEMENT_CHOICES",
    "SPMD_ENGINES",
    "SYNC_MODES",
    "EngineDevices",
    "Placement",
    "PlacementError",
    "RankGpu",
    "SpmdSlot",
    "WeightSyncMode",
    "assign_engine_devices",
    "check_sync_mode",
    "choose_sync_mode",
    "replica_groups",
    "resolve_placement",
]

WeightSyncMode = Literal["auto", "gather", "shared_memory", "tp_shards"]
"""`rollout.weight_sync_mode` (config.py types the key with it; `choose_sync_mode` picks for "auto")."""
SYNC_MODES = get_args(WeightSyncMode)


SHARD_MODES = ("shared_memory", "tp_shards")
"""The modes in which each rank streams its own TP slices (`sync.dispatch.OwnShards`)."""


def check_sync_mode(requested: str, placement: str, tp_size: int, rollout_tp: Optional[int], ep: int = 1) -> None:
    """The rules between `rollout.weight_sync_mode`, the placement and the actor's layout, which need
    no host names: `PlacementError` naming the keys for a mode that cannot work. The config checks
    them at load; `choose_sync_mode`, which also knows the hosts, starts with them.

    The shard modes stream each rank's own slices of every tensor; under expert parallelism
    (`ep` > 1) a rank holds only its own experts, so they take the gather path, whose export moves
    the experts between expert-parallel ranks (`model.load`)."""
    if requested not in SYNC_MODES:
        raise PlacementError(f"unknown rollout.weight_sync_mode {requested!r} ({', '.join(SYNC_MODES)})")
    if requested in SHARD_MODES and ep > 1:
        raise PlacementError(
            f"rollout.weight_sync_mode={requested} streams each rank's own slices, but at parallel.ep={ep} a rank holds only "
            "its own experts: use auto or gather (the gather export moves the experts between expert-parallel ranks)"
        )
    if placement == "separate":
        if requested in SHARD_MODES:
            raise PlacementError(
                f"rollout.weight_sync_mode={requested} is for colocated engines; with rollout.placement=separate the weights "
                "travel to the engines' ranks as full tensors: use auto or gather"
            )
        return
    if placement == "spmd":
        if requested == "shared_memory":
            raise PlacementError(
                "rollout.weight_sync_mode=shared_memory is for rollout.placement=leader (the spmd engine is in-process): "
                "use auto, gather or tp_shards, or set rollout.placement=leader"
            )
        if requested == "tp_shards" and rollout_tp != tp_size:
            raise PlacementError(
                f"rollout.weight_sync_mode=tp_shards needs rollout.tp = parallel.tp (got {rollout_tp} and {tp_size}): use auto or gather"
            )
    elif requested == "tp_shards":
        raise PlacementError(
            "rollout.weight_sync_mode=tp_shards needs the spmd placement (rollout.engine=vllm, rollout.placement auto or spmd): "
            "use auto, gather or shared_memory"
        )


def choose_sync_mode(
    requested: str,
    tp_size: int,
    tp_group_hosts: Sequence[str],
    engine_kind: str,
    device_type: str,
    placement: str = "leader",
    rollout_tp: Optional[int] = None,
    ep: int = 1,
) -> str:
    """The weight-sync mode for `rollout.weight_sync_mode=requested`; pure, the same on every rank.

    `tp_size` is the actor's TP size, `tp_group_hosts` the host names of the engine leader's TP group
    (leader placement), `rollout_tp` the engines' TP size (spmd placement), `ep` the actor's
    expert-parallel size (> 1: always gather, see `check_sync_mode`). Raises `PlacementError`
    for a mode the placement or the hosts cannot use. "auto": spmd -> tp_shards when rollout TP =
    actor TP > 1, else gather; leader -> shared_memory when the actor's TP > 1 and the leader's TP
    group shares a node, except on a GPU for the engines whose `load_weights` takes GPU tensors
    without a host copy (embedded, SGLang); otherwise gather. The file path goes through host
    memory (/dev/shm): for those engines the leader would then copy the whole model back onto its
    GPU through one PCIe link (~65 GB per push of a 32B model in bfloat16), while the gather's full
    tensors stay on the GPUs: the embedded engine loads them in its own process, SGLang receives
    them as CUDA IPC handles (`update_weights_from_tensor`). vLLM's leader placement takes files
    anyway (tensors sent to its workers would travel as lists), so there the shared-memory path,
    which needs no TP gather, wins.
    """
    check_sync_mode(requested, placement, tp_size, rollout_tp, ep)
    if ep > 1 or placement == "separate":
        return "gather"
    if placement == "spmd":
        if requested == "auto":
            return "tp_shards" if rollout_tp == tp_size > 1 else "gather"
        return requested
    one_node = len(set(tp_group_hosts)) <= 1
    if requested == "gather":
        return "gather"
    if requested == "shared_memory":
        if not one_node:
            raise PlacementError(
                f"rollout.weight_sync_mode=shared_memory needs the TP group on one node; it spans {sorted(set(tp_group_hosts))} "
                "(use gather or auto)"
            )
        return "shared_memory"
    takes_gpu_tensors = engine_kind in ("embedded", "sglang")
    if tp_size > 1 and one_node and not (takes_gpu_tensors and device_type == "cuda"):
        return "shared_memory"
    return "gather"


@dataclass(frozen=True)
class SpmdSlot:
    """One rank's place in the spmd placement."""

    rank: int
    world_size: int
    tp: int

    def __post_init__(self) -> None:
        check_rollout_tp(self.world_size, self.tp)
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


# ---- devices ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RankGpu:
    """Where one trainer rank computes: its node, the GPUs its process sees, and the one it uses."""

    node: str
    visible: tuple[str, ...]
    """The GPUs this process sees, in CUDA order, by their node-wide ids (the CUDA_VISIBLE_DEVICES
    entries; "0".."n-1" where it is unset)."""
    index: int
    """The CUDA index of this rank's GPU in its own process (`torch.cuda.current_device()`)."""

    def __post_init__(self) -> None:
        if not 0 <= self.index < len(self.visible):
            raise ValueError(f"GPU index {self.index} is outside the {len(self.visible)} GPUs this process sees")

    @property
    def gpu(self) -> str:
        """This rank's GPU by its node-wide id."""
        return self.visible[self.index]


@dataclass(frozen=True)
class EngineDevices:
    """The GPUs one engine computes on."""

    owner: int
    """The global rank that builds the engine (leader placement) or the group's first rank (spmd)."""
    ranks: tuple[int, ...]
    """The trainer ranks whose GPUs the engine uses, in engine TP-rank order."""
    node: str
    gpus: tuple[str, ...]
    """Node-wide GPU ids, in engine TP-rank order."""
    indices: tuple[int, ...]
    """The same GPUs as CUDA numbers them in the process that opens them: the owner's process in the
    leader placement (its engine processes inherit its view), each rank's own in spmd."""

    @property
    def base_gpu_id(self) -> int:
        """SGLang's `base_gpu_id`: the GPU of engine TP rank 0, in the owner's numbering."""
        return self.indices[0]

    @property
    def gpu_id_step(self) -> int:
        """SGLang's `gpu_id_step`: the distance between consecutive TP ranks' GPUs (1 for one GPU)."""
        return self.indices[1] - self.indices[0] if len(self.indices) > 1 else 1

    @property
    def cuda_visible_devices(self) -> str:
        """CUDA_VISIBLE_DEVICES for processes that should see exactly this engine's GPUs."""
        return ",".join(self.gpus)


ENGINE_KINDS = ("embedded", "vllm", "sglang")


def assign_engine_devices(
    placement: str,
    engine: str,
    rollout_tp: int,
    ranks: Sequence[RankGpu],
    engines: Sequence[Sequence[int]],
) -> list[EngineDevices]:
    """The GPUs of each engine (pure; the same answer on every rank).

    `ranks[r]` is where global rank r computes. `engines` lists each engine's ranks: in the leader
    placement the replicas (the ranks holding one copy of the actor, leader first, then in (PP, CP,
    TP) order: `replica_groups`), in spmd the rollout-TP groups (`SpmdSlot.group_ranks`). The
    embedded engine runs in its leader's process, on the leader's GPU; vLLM and SGLang leaders take
    the first `rollout_tp` GPUs of the replica on the leader's node. Raises `PlacementError` where an
    engine would need GPUs outside its replica, GPUs its leader's process cannot see, GPUs SGLang
    cannot address (not evenly spaced) or GPUs another engine uses.
    """
    if placement not in ("leader", "spmd"):
        raise ValueError(f"placement must be 'leader' or 'spmd', got {placement!r}")
    if engine not in ENGINE_KINDS:
        raise ValueError(f"unknown rollout.engine {engine!r}; use one of {', '.join(ENGINE_KINDS)}")
    check_sizes(rollout_tp=rollout_tp)
    if placement == "spmd":
        assigned = [_spmd_engine(group, rollout_tp, ranks) for group in engines]
    else:
        assigned = [_leader_engine(group, engine, rollout_tp, ranks) for group in engines]
    _refuse_shared_gpus(assigned, ranks)
    return assigned


def replica_groups(coordinates: Sequence[tuple[int, int, int, int]]) -> list[list[int]]:
    """Each replica's global ranks, leader first, from every rank's (DP, PP, CP, TP) ranks (pure).

    `coordinates[r]` belongs to global rank r; replicas are ordered by DP rank, and within one the
    ranks by (PP, CP, TP), so the replica's leader (PP = CP = TP = 0) comes first.
    """
    replicas: dict[int, list[tuple[tuple[int, int, int], int]]] = {}
    for rank, (dp, pp, cp, tp) in enumerate(coordinates):
        replicas.setdefault(dp, []).append(((pp, cp, tp), rank))
    return [[rank for _, rank in sorted(replicas[dp])] for dp in sorted(replicas)]


def _leader_engine(group: Sequence[int], engine: str, rollout_tp: int, ranks: Sequence[RankGpu]) -> EngineDevices:
    owner = group[0]
    leader = ranks[owner]
    if engine == "embedded":
        chosen = [owner]  # the embedded engine runs in the leader's process, on its GPU
    else:
        on_node, seen = [], set()
        for rank in group:
            if ranks[rank].node == leader.node and ranks[rank].gpu not in seen:
                on_node.append(rank)
                seen.add(ranks[rank].gpu)
        if len(on_node) < rollout_tp:
            raise PlacementError(
                f"rollout.tp={rollout_tp} needs {rollout_tp} GPUs of one replica on its leader's node, but the replica of "
                f"rank {owner} (ranks {list(group)}) has {len(on_node)} on {leader.node}: its engine would compute on GPUs "
                f"of other replicas. Use rollout.tp <= {len(on_node)}, more model parallelism per node (parallel.tp x "
                "parallel.pp x parallel.cp), or rollout.placement=spmd (vLLM)"
            )
        chosen = on_node[:rollout_tp]
    gpus = tuple(ranks[rank].gpu for rank in chosen)
    hidden = [gpu for gpu in gpus if gpu not in leader.visible]
    if hidden:
        raise PlacementError(
            f"the rollout engine of rank {owner} needs GPUs {list(gpus)} of {leader.node}, but that process sees only "
            f"{list(leader.visible)} (CUDA_VISIBLE_DEVICES): let every task see all GPUs of its node (e.g. srun without "
            "--gpus-per-task), or use rollout.tp=1, or rollout.placement=spmd (vLLM)"
        )
    indices = tuple(leader.visible.index(gpu) for gpu in gpus)
    if engine == "sglang" and len(indices) > 1:
        step = indices[1] - indices[0]
        if step < 1 or any(b - a != step for a, b in zip(indices, indices[1:])):
            raise PlacementError(
                f"SGLang puts engine TP rank i on GPU base_gpu_id + i * gpu_id_step, but the replica of rank {owner} "
                f"holds GPUs {list(indices)} for its rollout.tp={rollout_tp} engine (not evenly spaced): use a "
                "rollout.tp that the replica's first pipeline stage holds (<= parallel.tp x parallel.cp), or "
                "rollout.engine=vllm"
            )
    return EngineDevices(owner, tuple(chosen), leader.node, gpus, indices)


def _spmd_engine(group: Sequence[int], rollout_tp: int, ranks: Sequence[RankGpu]) -> EngineDevices:
    if len(group) != rollout_tp:
        raise ValueError(f"an spmd engine group has rollout.tp={rollout_tp} ranks, got {list(group)}")
    members = [ranks[rank] for rank in group]
    return EngineDevices(
        group[0], tuple(group), members[0].node, tuple(m.gpu for m in members), tuple(m.index for m in members)
    )


def _refuse_shared_gpus(engines: Sequence[EngineDevices], ranks: Sequence[RankGpu]) -> None:
    users: dict[tuple[str, str], int] = {}
    for engine in engines:
        for rank in engine.ranks:
            node, gpu = ranks[rank].node, ranks[rank].gpu
            other: Optional[int] = users.get((node, gpu))
            if other is not None:
                raise PlacementError(
                    f"GPU {gpu} of {node} would hold two rollout engine shards (of the engines of ranks {other} and "
                    f"{engine.owner}): trainer ranks share GPUs; launch one task per GPU (every rank on its own GPU: "
                    "LOCAL_RANK / SLURM_LOCALID)"
                )
            users[(node, gpu)] = engine.owner
