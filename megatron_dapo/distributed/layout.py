"""The parallel layout of a run: sizes, the rules they must follow, and which ranks form which group.

The one owner of the parallel arithmetic (as torchtitan's ParallelDims is). `ParallelLayout`
holds every size of a run: the actor's TP, PP, VPP, CP and EP, the derived DP, expert-TP and
expert-DP, the rollout engines' TP and their placement. `Config.parallel_layout(world_size)`
builds it once at start-up (`ParallelLayout.from_config`), and it is passed down: to
`init_distributed`, the model builder, `plan`, `doctor` and the rollout group; nothing else
derives a size. Every rule on the sizes (each >= 1, interleaving needs pipeline stages), on the
model (heads and query groups by TP, layers by PP x VPP, experts by EP) and on the world (TP x PP
x CP, TP x EP x PP and rollout.tp divide it; the batches split evenly over its data-parallel
ranks) is one function here. `config.py` applies them to a loaded config, `ParallelLayout.validate`
to a layout in code; both report the same message, which names the config key, its value and the
values that would fit. A rule that fails raises `LayoutError`; a placement the engine cannot take
raises `PlacementError`.

Pure Python (no torch.distributed): the pre-flight check and the `plan` command use it before any
process group exists. The rank numbering follows Megatron-Core's default order "tp-cp-ep-dp-pp"
(tensor-parallel ranks are adjacent, pipeline stages are the slowest-varying), so the groups
printed by `describe()` are the groups `parallel_state.initialize_model_parallel` creates; a
multi-process test checks that against Megatron.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Literal, Optional, get_args

from megatron_dapo.errors import InputError

__all__ = [
    "EXPERT_DISPATCHERS",
    "ExpertParallelError",
    "LayoutError",
    "PLACEMENT_CHOICES",
    "ParallelLayout",
    "Placement",
    "PlacementError",
    "SPMD_ENGINES",
    "check_batch_split",
    "check_expert_dispatcher",
    "check_model_shape",
    "check_moe_sequence_parallel",
    "check_rollout_pool",
    "check_rollout_tp",
    "check_sizes",
    "check_world_size",
    "divisors",
    "expert_data_parallel_size",
    "experts_per_rank",
    "resolve_placement",
    "validate_expert_parallel",
]


class LayoutError(InputError, ValueError):
    """Parallel sizes that do not fit each other, the model, the world or the batches."""


class PlacementError(InputError, ValueError):
    """A rollout placement the engine or the GPUs cannot hold; the message names the keys to change."""


Placement = Literal["auto", "spmd", "leader", "separate"]
"""`rollout.placement` (config.py types the key with it: the one list of values)."""
PLACEMENT_CHOICES = get_args(Placement)
RESOLVED_PLACEMENTS = ("leader", "spmd", "separate")
SPMD_ENGINES = ("vllm",)
"""Engines that run SPMD inside the trainer's ranks (vLLM's external launcher)."""


def resolve_placement(requested: str, engine: str) -> str:
    """The placement "spmd", "leader" or "separate" that `rollout.placement=requested` means for
    `rollout.engine=engine`: "auto" is spmd for vLLM (the only engine here that runs SPMD) and leader
    for the others; "separate" (engines on ranks of their own, `rollout.num_gpus`) takes every engine."""
    if requested not in PLACEMENT_CHOICES:
        raise PlacementError(f"unknown rollout.placement {requested!r}; use one of {', '.join(PLACEMENT_CHOICES)}")
    if requested == "auto":
        return "spmd" if engine in SPMD_ENGINES else "leader"
    if requested == "spmd" and engine not in SPMD_ENGINES:
        raise PlacementError(
            f"'rollout.placement'=spmd needs rollout.engine={' or '.join(SPMD_ENGINES)} (got {engine!r}): "
            "use placement auto or leader"
        )
    return requested


def divisors(n: int) -> list[int]:
    """All positive divisors of n, ascending (the values a size may take: 'use parallel.tp in {...}')."""
    return [d for d in range(1, n + 1) if n % d == 0]


def _set(values: list[int]) -> str:
    return "{" + ", ".join(str(v) for v in values) + "}"


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise LayoutError(message)


def _positive(key: str, value: Any) -> None:
    _require(isinstance(value, int) and not isinstance(value, bool) and value >= 1, f"'{key}' must be >= 1, got {value!r}")


def check_sizes(tp: int = 1, pp: int = 1, cp: int = 1, vpp: Optional[int] = None, rollout_tp: int = 1) -> None:
    """Every parallel size is an integer >= 1 (vpp: or null), and interleaving (vpp > 1) needs pipeline stages."""
    for key, value in (("parallel.tp", tp), ("parallel.pp", pp), ("parallel.cp", cp), ("rollout.tp", rollout_tp)):
        _positive(key, value)
    if vpp is not None:
        _require(
            isinstance(vpp, int) and not isinstance(vpp, bool) and vpp >= 1,
            f"'parallel.vpp' must be null or >= 1, got {vpp!r}",
        )
        _require(
            vpp == 1 or pp > 1,
            f"'parallel.vpp'={vpp} needs pipeline parallelism: set parallel.pp > 1 or parallel.vpp=null",
        )


def check_model_shape(
    tp: int,
    pp: int,
    vpp: Optional[int] = None,
    *,
    num_attention_heads: Optional[int] = None,
    num_query_groups: Optional[int] = None,
    num_layers: Optional[int] = None,
) -> None:
    """The model splits over the layout: attention heads and query groups (num_key_value_heads) by TP,
    layers by PP x VPP. A dimension given as None or 0 (unknown) is not checked."""
    if num_attention_heads:
        _require(
            num_attention_heads % tp == 0,
            f"'parallel.tp'={tp} does not divide the model's num_attention_heads={num_attention_heads}: "
            f"use parallel.tp in {_set(divisors(num_attention_heads))}",
        )
    if num_query_groups:
        _require(
            num_query_groups % tp == 0,
            f"'parallel.tp'={tp} does not divide the model's num_key_value_heads={num_query_groups} (query groups): "
            f"use parallel.tp in {_set(divisors(num_query_groups))}",
        )
    if num_layers:
        stages = pp * (vpp or 1)
        if vpp is None:
            fix = f"use parallel.pp in {_set(divisors(num_layers))}"
            product = f"{stages}"
        else:
            fix = f"change 'parallel.pp' / 'parallel.vpp' so that their product is in {_set(divisors(num_layers))}"
            product = f"{pp} x {vpp} = {stages}"
        _require(
            num_layers % stages == 0,
            f"the model's num_hidden_layers={num_layers} is not divisible by parallel.pp x parallel.vpp = {product}: {fix}",
        )


def _check_world_positive(world_size: Any) -> None:
    _require(
        isinstance(world_size, int) and not isinstance(world_size, bool) and world_size >= 1,
        f"world size {world_size!r}: a run needs at least one process (--world-size, or the number of processes "
        "torchrun / srun launch, must be >= 1)",
    )


def check_world_size(world_size: int, tp: int, pp: int, cp: int) -> int:
    """The data-parallel size of `world_size` processes: the world must hold whole model copies of
    tp x pp x cp ranks."""
    _check_world_positive(world_size)
    model_parallel = tp * pp * cp
    _require(
        world_size % model_parallel == 0,
        f"world size {world_size} is not divisible by parallel.tp x parallel.pp x parallel.cp = "
        f"{tp} x {pp} x {cp} = {model_parallel}: launch a multiple of {model_parallel} processes "
        f"or change 'parallel.tp' / 'parallel.pp' / 'parallel.cp' (their product must be in {_set(divisors(world_size))})",
    )
    return world_size // model_parallel


def check_rollout_pool(launch_world: int, rollout_ranks: int, rollout_tp: int) -> int:
    """The separate placement's split of a launch of `launch_world` processes: the last `rollout_ranks`
    (`rollout.num_gpus`) hold the engines, `rollout.tp` ranks each, the rest train. Returns the
    trainer's world size."""
    _positive("rollout.tp", rollout_tp)
    _check_world_positive(launch_world)
    _require(
        isinstance(rollout_ranks, int) and not isinstance(rollout_ranks, bool) and rollout_ranks >= 1,
        f"'rollout.placement'=separate needs 'rollout.num_gpus' >= 1 (the ranks that hold the engines), got {rollout_ranks!r}",
    )
    _require(
        rollout_ranks % rollout_tp == 0,
        f"'rollout.num_gpus'={rollout_ranks} is not a whole number of engines of 'rollout.tp'={rollout_tp} ranks: "
        f"use rollout.num_gpus in {{{rollout_tp}, {2 * rollout_tp}, ...}} or rollout.tp in {_set(divisors(rollout_ranks))}",
    )
    _require(
        launch_world > rollout_ranks,
        f"'rollout.num_gpus'={rollout_ranks} leaves no rank to train on in a launch of {launch_world} process(es): "
        f"launch more than {rollout_ranks} processes (the trainer's ranks come first, the engines' last)",
    )
    return launch_world - rollout_ranks


def check_rollout_tp(world_size: int, rollout_tp: int) -> None:
    """The world cuts into whole rollout engines of `rollout.tp` ranks (the spmd placement's groups)."""
    _positive("rollout.tp", rollout_tp)
    _check_world_positive(world_size)
    _require(
        world_size % rollout_tp == 0,
        f"'rollout.tp'={rollout_tp} must divide the world size {world_size}: launch a multiple of {rollout_tp} "
        f"processes or use rollout.tp in {_set(divisors(world_size))}",
    )


def check_batch_split(
    dp: int,
    *,
    ppo_mini_batch_size: int,
    n: int,
    micro_batch_size: int,
    max_tokens_per_micro_batch: int,
    gen_batch_size: int,
    train_batch_size: int,
) -> None:
    """Every batch splits evenly over `dp` data-parallel ranks: the prompts of a generation batch and of
    a train batch, the sequences of a mini-batch (ppo_mini_batch_size x n), and with a fixed micro-batch
    size (no token budget) each rank's share of a mini-batch into micro-batches."""
    sequences = ppo_mini_batch_size * n
    _require(
        sequences % dp == 0,
        f"a mini-batch of trainer.ppo_mini_batch_size x rollout.n = {ppo_mini_batch_size} x {n} = {sequences} "
        f"sequences cannot be split evenly over {dp} data-parallel ranks: change 'trainer.ppo_mini_batch_size' "
        f"or the number of processes",
    )
    if not max_tokens_per_micro_batch:
        per_rank = sequences // dp
        _require(
            per_rank % micro_batch_size == 0,
            f"each data-parallel rank gets {per_rank} sequences per mini-batch, not a multiple of "
            f"'trainer.micro_batch_size'={micro_batch_size}: change it to a divisor of {per_rank}",
        )
    _require(
        gen_batch_size % dp == 0,
        f"'trainer.gen_batch_size'={gen_batch_size} prompts cannot be split evenly over {dp} data-parallel "
        f"replicas: use a multiple of {dp}",
    )
    _require(
        train_batch_size % dp == 0,
        f"'trainer.train_batch_size'={train_batch_size} is not divisible by {dp} data-parallel replicas: "
        f"use a multiple of {dp}",
    )


# ---------------------------------------------------------------------------------------------
# Expert parallelism (mixture-of-experts models)
# ---------------------------------------------------------------------------------------------
#
# `parallel.ep` ranks share one MoE layer's experts (E / EP each); attention and the other dense
# parameters stay split by TP / CP and replicated over DP. Megatron lays the experts over the same
# ranks in a second grid, "tp-ep-dp-pp" with the expert-TP size equal to TP (its default, which we
# keep): expert-TP ranks adjacent, EP next, expert-DP = world / (TP x EP x PP), then the pipeline
# stages (the same stages as the dense grid). `parallel_state.initialize_model_parallel` requires
# world % (TP x EP x PP) == 0, i.e. EP divides DP x CP: the expert grid of one pipeline stage must
# tile its DP x TP x CP ranks.

EXPERT_DISPATCHERS = ("alltoall", "allgather")
"""Megatron's token dispatchers that run without extra kernels ("flex" needs DeepEP / HybridEP)."""


class ExpertParallelError(LayoutError):
    """An expert-parallel layout that does not fit the model or the launch; the message names the key and the fix."""


def experts_per_rank(num_experts: int, ep: int) -> int:
    """Experts each expert-parallel rank holds: num_experts / ep (ExpertParallelError unless it divides)."""
    if not isinstance(ep, int) or isinstance(ep, bool) or ep < 1:
        raise ExpertParallelError(f"parallel.ep={ep!r} must be a positive integer")
    if num_experts < 1:
        if ep > 1:
            raise ExpertParallelError(
                f"parallel.ep={ep} needs a mixture-of-experts model (the model has no experts): set parallel.ep=1"
            )
        return 0
    if num_experts % ep != 0:
        raise ExpertParallelError(
            f"parallel.ep={ep} does not divide the model's num_experts={num_experts}: "
            f"use parallel.ep in {_set(divisors(num_experts))}"
        )
    return num_experts // ep


def expert_data_parallel_size(world_size: int, ep: int, tp: int = 1, pp: int = 1, cp: int = 1) -> int:
    """Replicas of each expert: world / (TP x EP x PP), after checking that EP x TP tiles the
    DP x TP x CP ranks of a pipeline stage (Megatron's rule, see above)."""
    experts_per_rank(max(ep, 1), ep)  # ep itself is a positive integer
    if world_size < 1 or world_size % (tp * pp * cp) != 0:
        raise ExpertParallelError(
            f"world size {world_size} is not divisible by parallel.tp x parallel.pp x parallel.cp = {tp * pp * cp}"
        )
    stage = world_size // pp  # DP x TP x CP ranks of one pipeline stage
    if stage % (ep * tp) != 0:
        dp_cp = stage // tp
        raise ExpertParallelError(
            f"parallel.ep x parallel.tp = {ep} x {tp} = {ep * tp} does not divide the {stage} ranks of a pipeline stage "
            f"(DP x TP x CP = {stage // (tp * cp)} x {tp} x {cp}): parallel.ep must divide DP x CP = {dp_cp}, "
            f"use parallel.ep in {_set(divisors(dp_cp))} or launch a multiple of {ep * tp * pp} processes"
        )
    return world_size // (tp * ep * pp)


def check_expert_dispatcher(dispatcher: str, pp: int = 1, ep: int = 1) -> None:
    """The MoE token dispatcher runs here with this pipeline and expert-parallel size.

    Megatron's allgather dispatcher gathers equally shaped token blocks over the TP x EP ranks. Its
    peers must therefore hold micro-batches of one shape, which RL batches do not give: the
    pipeline schedule declares variable sequence lengths (`actor.optim.prepare_transformer_config`),
    and expert-parallel peers are different data-parallel replicas, whose responses differ in length
    (gloo then aborts on a size mismatch, NCCL hangs or reads garbage). Within TP (EP = 1) the
    ranks share each micro-batch, so there it works.
    """
    if dispatcher not in EXPERT_DISPATCHERS:
        raise ExpertParallelError(f"MoE token dispatcher {dispatcher!r} is not supported: use one of {', '.join(EXPERT_DISPATCHERS)}")
    if dispatcher == "allgather" and pp > 1:
        raise ExpertParallelError(
            f"the allgather MoE token dispatcher does not take the varying micro-batch shapes of parallel.pp={pp}: "
            "use the alltoall dispatcher"
        )
    if dispatcher == "allgather" and ep > 1:
        raise ExpertParallelError(
            f"the allgather MoE token dispatcher needs micro-batches of one shape on its parallel.ep={ep} expert-parallel "
            "ranks, which hold different data-parallel shares of responses of different lengths: use the alltoall dispatcher"
        )


def check_moe_sequence_parallel(tp: int, sequence_parallel: bool) -> None:
    """MoE training with TP > 1 needs sequence parallelism: Megatron's MoE layer refuses to train
    without it (each TP rank would route and dispatch every token of the sequence again)."""
    if tp > 1 and not sequence_parallel:
        raise ExpertParallelError(
            f"training a mixture-of-experts model at parallel.tp={tp} needs sequence parallelism: "
            "set parallel.sequence_parallel=true"
        )


def validate_expert_parallel(
    ep: int,
    *,
    num_experts: Optional[int] = None,
    world_size: Optional[int] = None,
    tp: int = 1,
    pp: int = 1,
    cp: int = 1,
    dispatcher: Optional[str] = None,
    sequence_parallel: Optional[bool] = None,
) -> None:
    """Every expert-parallel rule that the given facts allow to check (None: not known yet).

    At launch the world size is known, once the HF config is read the number of experts (0 for a
    dense model, which then needs parallel.ep=1); `sequence_parallel` is checked for training an
    MoE model.
    """
    experts_per_rank(num_experts if num_experts is not None else ep, ep)
    if world_size is not None:
        expert_data_parallel_size(world_size, ep, tp, pp, cp)
    if dispatcher is not None:
        check_expert_dispatcher(dispatcher, pp, ep)
    if sequence_parallel is not None and num_experts:
        check_moe_sequence_parallel(tp, sequence_parallel)


# ---------------------------------------------------------------------------------------------
# The layout
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ParallelLayout:
    """Every parallel size of a run, built once (`from_config`) and passed down.

    The actor: tensor / pipeline / virtual-pipeline / context / expert parallel sizes; data
    parallel, expert-TP (= TP, Megatron's default, which we keep) and expert-DP are derived from
    the world size. The rollout: the engines' TP size and their placement ("leader" or "spmd",
    resolved from "auto" by the engine). `world_size` is None until the layout is resolved against
    a launch (`resolve`); the derived sizes need it.
    """

    tp: int = 1
    pp: int = 1
    vpp: Optional[int] = None
    cp: int = 1
    world_size: Optional[int] = None
    ep: int = field(default=1, kw_only=True)
    rollout_tp: int = field(default=1, kw_only=True)
    placement: str = field(default="leader", kw_only=True)
    """Resolved rollout placement: "leader", "spmd" or "separate" (`resolve_placement`)."""
    rollout_ranks: int = field(default=0, kw_only=True)
    """Ranks of their own for the engines (the separate placement's `rollout.num_gpus`; 0 otherwise).
    They come after the trainer's ranks: `world_size` counts the trainer's ranks alone (Megatron's
    world), `launch_world` every process of the launch."""

    @classmethod
    def from_config(cls, cfg: Any, world_size: Optional[int] = None) -> "ParallelLayout":
        """The layout of a `config.Config` (its `parallel` and `rollout` sections), validated, and
        resolved against `world_size` when given. `Config.parallel_layout` is the caller at start-up."""
        p, r = cfg.parallel, cfg.rollout
        layout = cls(
            tp=p.tp,
            pp=p.pp,
            vpp=p.vpp,
            cp=p.cp,
            ep=p.ep,
            rollout_tp=r.tp,
            placement=resolve_placement(r.placement, r.engine),
            rollout_ranks=r.num_gpus,
        )
        if world_size is None:
            layout.validate()
            return layout
        return layout.resolve(world_size)

    # ------------------------------------------------------------------ sizes

    @property
    def model_parallel_size(self) -> int:
        """Ranks holding one copy of the model: tp * pp * cp."""
        return self.tp * self.pp * self.cp

    @property
    def vpp_size(self) -> int:
        """Model chunks per pipeline rank (1 without interleaving)."""
        return 1 if self.vpp is None else self.vpp

    @property
    def megatron_vpp(self) -> Optional[int]:
        """The virtual-pipeline size to give Megatron: None without interleaving (vpp null or 1)."""
        return None if self.vpp is None or self.vpp == 1 else self.vpp

    def _world(self) -> int:
        if self.world_size is None:
            raise ValueError("the data-parallel sizes are derived from the world size: call resolve(world_size) first")
        return self.world_size

    @property
    def dp(self) -> int:
        """Data-parallel size: world / (tp * pp * cp)."""
        return self._world() // self.model_parallel_size

    @property
    def expert_tp(self) -> int:
        """Ranks splitting each expert's matrices: the TP size (Megatron's default expert-TP, kept)."""
        return self.tp

    @property
    def expert_dp(self) -> int:
        """Replicas of each expert: world / (expert-TP * ep * pp)."""
        return self._world() // (self.expert_tp * self.ep * self.pp)

    @property
    def rollout_engines(self) -> int:
        """Engines generating independently: one per actor replica (leader), per rollout-TP group of
        the world (spmd) or of the rollout ranks (separate)."""
        if self.placement == "separate":
            return self.rollout_ranks // self.rollout_tp
        return self._world() // self.rollout_tp if self.placement == "spmd" else self.dp

    @property
    def launch_world(self) -> int:
        """Every process of the launch: the trainer's `world_size` plus the separate placement's rollout ranks."""
        return self._world() + self.rollout_ranks

    @property
    def separate(self) -> bool:
        return self.placement == "separate"

    def role(self, launch_rank: int) -> str:
        """"trainer" or "rollout": what the process of `launch_rank` runs (rollout: only in the separate
        placement, the last `rollout_ranks` of the launch)."""
        if not 0 <= launch_rank < self.launch_world:
            raise ValueError(f"rank {launch_rank} outside a launch of {self.launch_world} processes")
        return "trainer" if launch_rank < self.world_size else "rollout"

    def engine_leaders(self) -> list[int]:
        """Launch ranks that own an engine in the separate placement (the first of each group of
        rollout.tp rollout ranks; the others lend the engine their GPUs)."""
        if not self.separate:
            raise ValueError("engine_leaders is the separate placement's: the colocated ones follow the actor's layout")
        first = self._world()
        return list(range(first, first + self.rollout_ranks, self.rollout_tp))

    def resolve(self, launch_world: int) -> "ParallelLayout":
        """This layout for a launch of `launch_world` processes, validated (separate placement: the
        trainer's world is what the rollout ranks leave)."""
        if self.world_size is not None and self.launch_world != launch_world:
            raise LayoutError(
                f"this layout was made for {self.launch_world} processes, the launch has {launch_world}: "
                "launch the number of processes the configuration was checked for"
            )
        world_size = check_rollout_pool(launch_world, self.rollout_ranks, self.rollout_tp) if self.separate else launch_world
        resolved = dataclasses.replace(self, world_size=world_size)
        resolved.validate(world_size)
        return resolved

    # ------------------------------------------------------------------ validation

    def validate(
        self,
        world_size: Optional[int] = None,
        num_layers: Optional[int] = None,
        num_attention_heads: Optional[int] = None,
        num_query_groups: Optional[int] = None,
        num_experts: Optional[int] = None,
    ) -> None:
        """Raise `LayoutError` naming the config key and the fix for any size that does not fit.

        Arguments left as None are not checked (the world-size check runs at launch, the model
        checks once the HF config is read; `num_experts` 0 is a dense model, which needs ep=1).
        """
        check_sizes(self.tp, self.pp, self.cp, self.vpp, self.rollout_tp)
        if self.placement not in RESOLVED_PLACEMENTS:
            raise PlacementError(f"a layout's placement is one of {', '.join(RESOLVED_PLACEMENTS)} (resolve_placement), got {self.placement!r}")
        if self.separate:
            check_rollout_pool(self.rollout_ranks + 1, self.rollout_ranks, self.rollout_tp)  # the pool alone
        elif self.rollout_ranks:
            raise PlacementError(
                f"'rollout.num_gpus'={self.rollout_ranks} gives the engines ranks of their own, which only "
                f"rollout.placement=separate does (placement {self.placement}): set rollout.placement=separate or rollout.num_gpus=0"
            )
        if world_size is not None:
            check_world_size(world_size, self.tp, self.pp, self.cp)
            if not self.separate:
                check_rollout_tp(world_size, self.rollout_tp)
        validate_expert_parallel(
            self.ep, num_experts=num_experts, world_size=world_size, tp=self.tp, pp=self.pp, cp=self.cp
        )
        check_model_shape(
            self.tp,
            self.pp,
            self.vpp,
            num_attention_heads=num_attention_heads,
            num_query_groups=num_query_groups,
            num_layers=num_layers,
        )

    # ------------------------------------------------------------------ rank coordinates

    def coordinates(self, rank: int) -> dict[str, int]:
        """(tp, cp, dp, pp) ranks of a global rank in Megatron's default "tp-cp-ep-dp-pp" order."""
        dp = self.dp  # raises if the world size is not resolved
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} outside world of size {self.world_size}")
        tp_rank = rank % self.tp
        cp_rank = (rank // self.tp) % self.cp
        dp_rank = (rank // (self.tp * self.cp)) % dp
        pp_rank = rank // (self.tp * self.cp * dp)
        return {"tp": tp_rank, "cp": cp_rank, "dp": dp_rank, "pp": pp_rank}

    def expert_coordinates(self, rank: int) -> dict[str, int]:
        """(expert_tp, ep, expert_dp, pp) ranks of a global rank in the expert grid's "tp-ep-dp-pp" order."""
        expert_dp = self.expert_dp  # raises if the world size is not resolved
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} outside world of size {self.world_size}")
        tp, ep = self.expert_tp, self.ep
        return {"expert_tp": rank % tp, "ep": (rank // tp) % ep, "expert_dp": (rank // (tp * ep)) % expert_dp, "pp": rank // (tp * ep * expert_dp)}

    def rank_of(self, tp: int = 0, cp: int = 0, dp: int = 0, pp: int = 0) -> int:
        """Inverse of `coordinates`."""
        return tp + self.tp * (cp + self.cp * (dp + self.dp * pp))

    GROUP_KINDS = ("tp", "cp", "dp", "pp", "ep", "expert_tp", "expert_dp")

    def groups(self, kind: str) -> list[list[int]]:
        """All process groups of one kind, each a sorted rank list: "tp", "cp", "dp", "pp" (the dense
        grid) or "ep", "expert_tp", "expert_dp" (Megatron's expert grid, see above)."""
        if kind not in self.GROUP_KINDS:
            raise ValueError(f"unknown group kind {kind!r}; use one of {', '.join(self.GROUP_KINDS)}")
        if self.world_size is None:
            raise ValueError("groups need the world size: call resolve(world_size) first")
        coordinates = self.coordinates if kind in ("tp", "cp", "dp", "pp") else self.expert_coordinates
        seen: dict[tuple, list[int]] = {}
        for rank in range(self.world_size):
            coords = coordinates(rank)
            key = tuple(v for k, v in coords.items() if k != kind)
            seen.setdefault(key, []).append(rank)
        return sorted(seen.values())

    def layers_of_stage(self, num_layers: int, pp_rank: int, vpp_rank: int = 0) -> range:
        """Global layer indices held by model chunk `vpp_rank` of pipeline rank `pp_rank` (even split)."""
        per_chunk = num_layers // (self.pp * self.vpp_size)
        start = vpp_rank * (num_layers // self.vpp_size) + pp_rank * per_chunk
        return range(start, start + per_chunk)

    def describe(self, num_layers: Optional[int] = None) -> str:
        """A multi-line description of the resolved layout for the pre-flight print."""
        if self.world_size is None:
            return f"tp={self.tp} pp={self.pp} vpp={self.vpp} cp={self.cp} ep={self.ep} (world size not resolved)"
        lines = [
            f"world={self.world_size} = tp {self.tp} x cp {self.cp} x dp {self.dp} x pp {self.pp}"
            + (f" (vpp {self.vpp} chunks per pipeline rank)" if self.vpp else "")
        ]
        for kind in ("tp", "cp", "dp", "pp"):
            size = getattr(self, kind)
            if size > 1 or kind == "dp":
                lines.append(f"  {kind.upper()} groups: " + " ".join(str(g) for g in self.groups(kind)))
        if self.ep > 1:
            lines.append(
                f"  experts: EP {self.ep} x expert-TP {self.expert_tp} x expert-DP {self.expert_dp}; EP groups: "
                + " ".join(str(g) for g in self.groups("ep"))
            )
        if self.separate:
            first, last = self.world_size, self.launch_world - 1
            lines[0] += f" trainer ranks, + {self.rollout_ranks} rollout rank(s) = {self.launch_world} processes"
            lines.append(
                f"  rollout: ranks {first}-{last}, {self.rollout_engines} engine(s) of rollout.tp {self.rollout_tp} "
                f"(owned by ranks {', '.join(str(r) for r in self.engine_leaders())})"
            )
        if num_layers is not None and self.pp > 1:
            for pp_rank in range(self.pp):
                chunks = []
                for v in range(self.vpp_size):
                    layers = self.layers_of_stage(num_layers, pp_rank, v)
                    chunks.append(f"layers {layers.start}-{layers.stop - 1}")
                lines.append(f"  PP stage {pp_rank}: " + "; ".join(chunks))
        if self.cp > 1:
            chunks = 2 * self.cp
            lines.append(
                f"  CP: every sequence is padded to a multiple of {chunks} (x tp under sequence parallelism) and cut "
                f"into {chunks} chunks; CP rank r holds chunks r and {chunks - 1}-r (Megatron's load-balanced layout)"
            )
        return "\n".join(lines)
