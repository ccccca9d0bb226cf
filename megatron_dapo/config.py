"""Typed configuration: dataclasses, a YAML file, dotted CLI overrides, validation at start.

    cfg = load_config("configs/tiny_cpu.yaml", ["trainer.total_steps=10", "rollout.n=8"])

Every key is declared here with its type and default. Unknown keys, wrong types and impossible
combinations fail in `load_config` with a `ConfigError` naming the key and the fix, so a typo
never silently falls back to a default after an hour in a queue. YAML values may use OmegaConf
interpolation (`${rollout.max_response_length}`); overrides are parsed as YAML scalars
(`trainer.total_steps=10` is an int, `model.megatron_checkpoint=null` is None).

The data-parallel size is not a key: it is derived from the world size by the run's `ParallelLayout`
(`Config.parallel_layout`, built once at start-up and passed down).
The rules on the parallel sizes (against each other, the model and the world) belong to
`distributed/layout.py`, the rollout placement to `distributed/placement.py`; this module applies them
to the config and reports a broken one as a ConfigError.
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import os
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Optional

from megatron_dapo.algorithm.defaults import CLIP_C, CLIP_HIGH, CLIP_LOW
from megatron_dapo.distributed.layout import (
    LayoutError,
    ParallelLayout,
    Placement,
    PlacementError,
    check_batch_split,
    check_expert_dispatcher,
    check_moe_sequence_parallel,
)
from megatron_dapo.distributed.placement import WeightSyncMode, check_sync_mode
from megatron_dapo.errors import ConfigError, InputError  # noqa: F401  (ConfigError: public here too)

__all__ = [
    "ActorConfig",
    "AlgorithmConfig",
    "Config",
    "CustomRewardFunctionConfig",
    "ConfigError",
    "DataConfig",
    "FilterGroupsConfig",
    "KLConfig",
    "ModelConfig",
    "OptimizerConfig",
    "OverlongBufferConfig",
    "ParallelConfig",
    "RewardConfig",
    "RolloutConfig",
    "TrainerConfig",
    "engine_returns_routing",
    "load_config",
    "config_to_dict",
]


# --------------------------------------------------------------------------------------------
# Sections
# --------------------------------------------------------------------------------------------


@dataclass
class ModelConfig:
    hf_dir: str = ""
    """HuggingFace model directory (config.json, safetensors, tokenizer files)."""
    dtype: Literal["float32", "bfloat16", "float16"] = "bfloat16"
    """Parameter / compute dtype of actor, reference and rollout."""
    megatron_checkpoint: Optional[str] = None
    """Megatron distributed checkpoint to start from instead of converting `hf_dir` at start."""
    transformer_engine: Literal["auto", "on", "off"] = "auto"
    """Layer implementation: Transformer Engine when installed ("auto"), required ("on"), or the local spec."""
    recompute_activations: bool = False
    """Full activation recomputation, trading compute for memory on long responses."""


@dataclass
class ParallelConfig:
    tp: int = 1
    """Tensor-parallel size of the actor and reference."""
    pp: int = 1
    """Pipeline-parallel size."""
    vpp: Optional[int] = None
    """Virtual pipeline stages per rank (interleaved 1F1B); null disables it."""
    cp: int = 1
    """Context-parallel size: each sequence is cut into 2*CP chunks shared by CP ranks (with or without
    Transformer Engine; without it the SDPA core attention all-gathers K/V). `megatron-dapo plan` prints
    the CP a sequence length needs."""
    sequence_parallel: bool = False
    """Megatron sequence parallelism inside TP groups."""
    ep: int = 1
    """Expert-parallel size of mixture-of-experts models: each MoE layer's experts are split over `ep`
    ranks (E / ep each), which exchange tokens with an all-to-all, so a model whose experts do not fit
    one GPU's memory trains without splitting every expert by TP. Must divide the number of experts
    and DP x CP. 1 (default): every rank holds all experts, the only value for dense models."""
    use_distributed_optimizer: bool = True
    """Shard optimizer state across data-parallel ranks (ZeRO-1)."""
    dp: Optional[int] = field(default=None, metadata={"derived": True})
    """Derived: world_size / (tp * pp * cp). Not settable."""


@dataclass
class MoEConfig:
    """Mixture-of-experts training (Qwen3-MoE, Qwen2-MoE); a dense model ignores it. The experts'
    parallelism is `parallel.ep`."""

    token_dispatcher: Literal["alltoall", "allgather"] = "alltoall"
    """How tokens reach their experts' ranks: "alltoall" (any layout) or "allgather" (parallel.pp = 1
    and parallel.ep = 1 only: it needs micro-batches of one shape on its peers)."""
    aux_loss_coeff: Optional[float] = None
    """Weight of the load-balancing loss; null: the model's `router_aux_loss_coef` (config.json),
    0 turns it off. Averaged over micro-batches and data-parallel replicas as in Megatron's own
    training (the policy loss keeps its exact global token-mean); logged as actor/moe_aux_loss."""
    z_loss_coeff: Optional[float] = None
    """Weight of the router z-loss (mean squared log-sum-exp of the router logits); null or 0: off.
    Averaged like the load-balancing loss; logged as actor/moe_z_loss."""


@dataclass
class ActorConfig:
    """Where the actor's state lives while the rollout engine generates (`actor/offload.py`), and how
    a mixture-of-experts actor routes (`router_replay`).

    Offloaded state goes to host memory (pinned on GPUs) after the update and comes back before the
    next old log-probs, so the engine can take the GPU: raise rollout.gpu_memory_utilization by what
    `megatron-dapo plan` shows (its "with offload" figures). Order per step: engine sleep -> onload ->
    log-probs -> update -> offload grads + optimizer -> wake engine weights -> weight sync -> offload
    params -> wake KV cache -> generate. Round trips are bit-exact."""

    offload_params: bool = False
    """Move the weights (Megatron DDP's parameter buffers) to host memory during generation."""
    offload_grads: bool = False
    """Free the fp32 DDP gradient buffers during generation (dropped, not copied: every update starts
    from zeroed grads, so they come back as zeros and take no host memory)."""
    offload_optimizer: bool = False
    """Move the optimizer state (fp32 main params, Adam moments) to host memory during generation."""
    router_replay: Literal["off", "r2", "r3"] = "off"
    """Mixture-of-experts models: rollout routing replay (`actor/routing.py`). "off": the actor's routers
    choose; "r2": the update replays the experts the actor chose in its old-log-prob pass; "r3": the
    old-log-prob pass and the update replay the experts the rollout engine chose for every token (the
    engine returns them), which removes the engine/trainer routing mismatch behind MoE RL collapse."""

    @property
    def offload_any(self) -> bool:
        return self.offload_params or self.offload_grads or self.offload_optimizer


@dataclass
class RolloutConfig:
    engine: Literal["embedded", "vllm", "sglang"] = "embedded"
    """Generation engine: the embedded HF engine (no extra dependency), vLLM or SGLang."""
    n: int = 16
    """Responses sampled per prompt (the group size)."""
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    """-1 disables top-k."""
    max_prompt_length: int = 2048
    max_response_length: int = 20480
    stop: list[str] = field(default_factory=list)
    """Extra stop strings besides the tokenizer's EOS."""
    tp: int = 1
    """Tensor-parallel size of each rollout engine (must divide the world size; separate placement:
    rollout.num_gpus)."""
    gpu_memory_utilization: float = 0.6
    return_routed_experts: bool = False
    """Mixture-of-experts models: have vLLM / SGLang return the experts of every token even when
    `actor.router_replay` is not "r3" (which always asks), for the routing-mismatch metrics
    (`rollout_mismatch/routing_*`). The embedded engine returns them on every MoE model."""
    free_cache_engine: bool = True
    """Sleep the engine during training to free its GPU memory (how deeply: rollout.sleep_level;
    GPU engines only, a no-op on CPU)."""
    weight_sync_bucket_mb: int = 512
    """Bucket size of the actor -> engine weight stream; peak extra memory is one bucket."""
    weight_sync_mode: WeightSyncMode = "auto"
    """How TP shards reach the engine: "gather" (all-gather full tensors, then the engine's owner -
    with placement spmd every rank - loads them), "shared_memory" (leader placement: each TP rank
    writes its own slices into a shared bucket file in /dev/shm that the engine reads: no gather;
    the TP group must share a node), "tp_shards" (spmd placement with rollout.tp = parallel.tp:
    each rank loads its own slices into its own in-process engine: no gather, no file) or "auto"
    (`distributed.placement.choose_sync_mode`): gather when parallel.ep > 1 or the placement is
    separate; otherwise, spmd: tp_shards when rollout.tp = parallel.tp > 1, else gather; leader:
    shared_memory when parallel.tp > 1 and the actor's TP group is on one node, except on a GPU for
    the embedded engine and SGLang, which gather (they take the gathered tensors on the GPU); else
    gather."""
    placement: Placement = "auto"
    """Where engines run. "spmd": every rank holds its shard of one engine per rollout-TP group of
    rollout.tp consecutive ranks (vLLM's external_launcher), and the groups split the prompts
    (vLLM only). "leader": one engine per data-parallel replica on its first rank, which spawns
    rollout.tp workers on its node while the replica's other ranks wait. "separate": the engines
    run on ranks of their own (rollout.num_gpus, the last ranks of the launch; every engine), the
    trainer on the rest; the weights travel to them after every update (`distributed/bridge.py`).
    "auto": spmd for vLLM, leader for the embedded engine and SGLang."""
    num_gpus: int = 0
    """rollout.placement=separate: how many ranks of the launch hold the engines (GPUs on a cluster,
    processes on a CPU), rollout.tp per engine; the launch is the trainer's ranks plus these. 0 with
    the colocated placements."""
    partial_rollouts: bool = False
    """Asynchronous training (trainer.max_staleness > 0): weight pushes land between the engines'
    decode steps, the sequences in flight continuing with the new weights (their KV recomputed
    with them), each token's version recorded; staleness counts a sample's oldest token. false:
    every engine finishes the requests handed to it before it takes a push, so each sample has one
    version and a run is reproducible; true: fresher samples and no push waits for a generation,
    but where a push lands depends on timing (docs/ASYNC.md)."""
    sleep_level: int = 1
    """How deeply a GPU engine sleeps during training (rollout.free_cache_engine): 1 frees the KV
    cache and keeps the weights in host memory, 2 frees the weights too (less host memory; the
    weight sync after each update is a full push anyway, but with actor.offload_* a checkpoint,
    which takes the GPU from the engine, then pushes the weights once more)."""
    val_n: int = 1
    """Samples per prompt during validation (k of avg@k / pass@k)."""
    val_temperature: float = 1.0
    val_top_p: float = 0.7
    seed: int = 0
    gather_timeout_s: float = 10800.0
    """The longest a rank waits for another rank that is alive (3 hours): for the others' generation
    results, and for the replica leader's engine to start, sleep or wake. Engines generate on their
    own and may finish minutes apart; the waiting ranks watch the ones they wait for
    (`rollout.liveness_window_s`), so a rank that is gone is noticed within that window, and this
    bound only ends the wait for one that is alive but stuck (and is the timeout of the gloo group
    the results then move on, before any tensor moves over the default group, NCCL on GPUs, whose
    timeout is `trainer.collective_timeout_s`). Raise it if one generation batch can take longer."""
    liveness_window_s: float = 60.0
    """How long a rank that others wait for may go without a heartbeat before they stop waiting
    (`distributed/liveness.py`): every rank beats in the job's store every window / 6 seconds, and a
    rank whose process died or froze, or whose node is gone, is noticed within about 1.5 x this
    window, instead of after `rollout.gather_timeout_s`. Raise it where the store is slow or a
    process can hold Python's interpreter lock for long (a slow beat is taken for a death)."""
    seed_per_prompt: bool = False
    """How training generation is seeded (validation always seeds per prompt). false: each generation
    batch seeds the engine's sampler once (from rollout.seed, the step, the batch and the engine) and
    all requests draw from it together: fast, and a resumed run repeats the same tokens where the
    engine schedules deterministically (vLLM's spmd placement, the embedded engine). true: every
    prompt gets its own seed, so its responses do not depend on batching or scheduling (vLLM's
    leader placement too), at the cost of vLLM's per-request sampling path at every decode step."""


FILTER_GROUP_METRICS = ("acc", "score", "seq_reward")
"""Values `algorithm.filter_groups.metric` may name (see `trainer.samples.filter_metric`)."""


@dataclass
class FilterGroupsConfig:
    enable: bool = True
    """Dynamic sampling: drop prompt groups whose metric is constant, generate more until full."""
    metric: str = "acc"
    """Per-sample value compared within a group: acc (correctness, the paper's), score (task score
    before the overlong penalty) or seq_reward (task score + overlong penalty, what advantages use)."""
    max_num_gen_batches: int = 10
    """Give up after this many generation batches in one step (0 = unlimited)."""


@dataclass
class OverlongBufferConfig:
    enable: bool = True
    """Soft overlong punishment (DAPO eq. 13)."""
    len: int = 4096
    """Length of the punishment interval before `rollout.max_response_length`."""
    penalty_factor: float = 1.0
    apply_in_validation: bool = True


@dataclass
class KLConfig:
    use_kl_loss: bool = False
    """Add a KL(actor || reference) loss term; DAPO uses none, and then no reference model is built."""
    coef: float = 0.001
    type: Literal["k1", "abs", "k2", "mse", "k3", "low_var_kl"] = "low_var_kl"


@dataclass
class MaskedISConfig:
    """Sequence-level masked importance sampling (algorithm/off_policy.py, docs/ASYNC.md "Off-policy
    correction"): a sequence whose geometric-mean ratio pi_old / pi_rollout over its loss tokens lies
    outside [low, high] leaves the loss and the token-mean's denominator; kept ones are not reweighted."""

    enable: bool = False
    low: float = 0.999
    """Lower bound of the per-token geometric-mean ratio (inclusive); 0 < low < 1."""
    high: float = 1.001
    """Upper bound (inclusive); > 1. The defaults are verl's geometric rejection presets (+-0.1% a
    token); stale samples (trainer.max_staleness > 0) sit further out: watch actor/mis_masked_frac."""


@dataclass
class AlgorithmConfig:
    clip_low: float = CLIP_LOW
    clip_high: float = CLIP_HIGH
    """Decoupled upper clip range (DAPO clip-higher)."""
    clip_c: Optional[float] = CLIP_C
    """Dual-clip constant (> 1) bounding the loss of negative-advantage tokens; null disables."""
    loss_agg_mode: Literal[
        "token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"
    ] = "token-mean"
    norm_adv_by_std: bool = True
    """Divide group-centred scores by the group std (GRPO); false gives Dr. GRPO."""
    entropy_coeff: float = 0.0
    kl: KLConfig = field(default_factory=KLConfig)
    filter_groups: FilterGroupsConfig = field(default_factory=FilterGroupsConfig)
    overlong_buffer: OverlongBufferConfig = field(default_factory=OverlongBufferConfig)
    overlong_filter: bool = False
    """Mask truncated responses out of the loss."""
    tis_cap: Optional[float] = None
    """Truncated importance sampling: each token's loss times min(pi_old / pi_rollout, tis_cap), the
    engine's log-probs being the behaviour policy (docs/ASYNC.md); null disables. Combines with `mis`."""
    mis: MaskedISConfig = field(default_factory=MaskedISConfig)
    """Sequence-level masked importance sampling; with `tis_cap` the kept tokens get the TIS weight too."""


@dataclass
class DataConfig:
    train_files: list[str] = field(default_factory=list)
    """Parquet or jsonl files in the verl/DAPO schema."""
    val_files: list[str] = field(default_factory=list)
    prompt_key: str = "prompt"
    overlong_prompts: Literal["drop", "truncate", "error"] = "drop"
    """What to do with prompts longer than `rollout.max_prompt_length`."""
    apply_chat_template: bool = True
    shuffle: bool = True
    seed: int = 1
    val_max_samples: int = -1
    """-1 uses the whole validation set."""


@dataclass
class CustomRewardFunctionConfig:
    path: Optional[str] = None
    """`package.module:function`, `/path/to/file.py:function`, or a module / file path with `name` set;
    null uses the DAPO math reward."""
    name: Optional[str] = None
    """Function name when `path` does not include it."""


@dataclass
class RewardConfig:
    custom_function: CustomRewardFunctionConfig = field(default_factory=CustomRewardFunctionConfig)
    num_workers: int = 0
    """Scoring processes; 0 picks min(8, cpu count)."""
    timeout_s: float = 10.0
    """Per-sample scoring timeout; a sample that raises or hangs gets the minimum reward."""
    min_reward: float = -1.0


@dataclass
class OptimizerConfig:
    lr: float = 1e-6
    warmup_steps: int = 10
    """Linear warm-up over this many optimizer (rollout) steps, then constant (DAPO recipe)."""
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8


@dataclass
class SFTConfig:
    """The supervised warm start (`megatron-dapo sft`): the actor's update step with a cross-entropy loss."""

    train_files: list[str] = field(default_factory=list)
    """Parquet or jsonl in the verl/DAPO schema plus a `response` field (the target text)."""
    total_steps: int = 0
    """Optimizer steps (0: no warm start)."""
    batch_size: int = 32
    """Sequences per optimizer step, all data-parallel ranks together."""
    lr: float = 1e-4
    warmup_steps: int = 0
    output_dir: str = "outputs/sft"
    """Its checkpoints (`checkpoints/step_N`) are what `model.megatron_checkpoint` points the DAPO run at."""


@dataclass
class TrainerConfig:
    total_steps: int = 100
    """Optimizer (rollout) steps; generation batches are counted separately."""
    train_batch_size: int = 512
    """Prompts per step after dynamic sampling."""
    gen_batch_size: int = 1536
    """Prompts sampled per generation batch (>= train_batch_size)."""
    ppo_mini_batch_size: int = 32
    """Prompts per optimizer update; train_batch_size / ppo_mini_batch_size updates per step."""
    ppo_epochs: int = 1
    max_staleness: int = 0
    """Asynchronous training (rollout.placement=separate): how many weight versions older than the
    update's own a sample may have been generated with. 0: the synchronous loop (every sample comes
    from the weights the step starts from). 1: one-step-off, the engines generate the next step's
    batch while this one trains. k: up to k steps ahead. Needs an off-policy correction
    (algorithm.tis_cap and/or algorithm.mis): the engine's log-probs are then the behaviour policy (docs/ASYNC.md)."""
    micro_batch_size: int = 1
    """Sequences per micro-batch when `max_tokens_per_micro_batch` is 0."""
    max_tokens_per_micro_batch: int = 0
    """Token budget per micro-batch (dynamic batch size); 0 uses `micro_batch_size`."""
    save_every: int = 50
    """Checkpoint every N steps (0 = only at the end and on SIGTERM)."""
    keep_last: int = 2
    checkpoint_format: str = "dp_reshardable"
    """Optimizer-state format of the periodic and SIGTERM checkpoints (`checkpoint/optimizer_state.py`).
    `dp_reshardable` (Megatron-LM's default): every rank writes its own shard of the distributed
    optimizer, the weights are shared out among the data-parallel ranks, nothing is gathered; such a
    checkpoint resumes at the same parallel.tp / pp / vpp (the DP size may change).
    `fully_sharded_model_space`: every rank writes its own part too, but laid out like the model's
    parameters (an index entry per parameter rather than per gradient bucket), so it resumes at any layout.
    `fully_reshardable`: the same model-space tensors, gathered over gloo into DP rank 0's host memory and
    written from there: every save funnels the whole optimizer state (12 bytes per parameter) through
    the nodes of DP rank 0. The weights of each convert to HF and load at any layout."""
    final_checkpoint_reshardable: bool = True
    """Write the checkpoint after the last step (trainer.total_steps) so that it resumes at any layout,
    whatever checkpoint_format says: `fully_reshardable` (Megatron's format) when the nodes of the ranks
    that gather the optimizer state (12 bytes per parameter of their shards: dense DP rank 0, and
    expert-DP rank 0 for the experts) have the host memory available for it, else
    `fully_sharded_model_space` (every rank writes its own part, nothing gathered); the run says which
    and why (`checkpoint/final_save.py`). false keeps checkpoint_format for it too."""
    checkpoint_write_threads: int = 2
    """Writer threads (one file each) per rank for checkpoint data, also used to checksum it. Parallel
    file systems (Lustre, GPFS) reach their bandwidth only with several streams per client."""
    eval_every: int = 10
    """Validate every N steps (0 = never)."""
    val_before_train: bool = True
    output_dir: str = "outputs/run"
    experiment_name: str = "dapo"
    seed: int = 42
    loggers: list[str] = field(default_factory=lambda: ["console", "jsonl", "tensorboard"])
    collective_timeout_s: float = 1800.0
    """A hung rank fails the job after this many seconds instead of idling (every collective except
    the wait for other engines' generation results, which `rollout.gather_timeout_s` bounds)."""


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    moe: MoEConfig = field(default_factory=MoEConfig)
    actor: ActorConfig = field(default_factory=ActorConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    data: DataConfig = field(default_factory=DataConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    sft: SFTConfig = field(default_factory=SFTConfig)

    def parallel_layout(self, world_size: int) -> ParallelLayout:
        """The run's layout for `world_size` processes (`ParallelLayout`, checked against the world and
        the batches); sets the derived `parallel.dp`. Built once at start-up and passed down."""
        layout = parallel_layout(self, world_size)
        self.parallel.dp = layout.dp
        return layout

    def resolve_world(self, world_size: int) -> "Config":
        """Check the layout fits `world_size` processes and derive `parallel.dp`; returns the config."""
        self.parallel_layout(world_size)
        return self


_LOGGERS = ("console", "jsonl", "tensorboard", "wandb")
CHECKPOINT_FORMATS = ("dp_reshardable", "fully_reshardable", "fully_sharded_model_space")  # = checkpoint.optimizer_state.OPTIMIZER_FORMATS

# --------------------------------------------------------------------------------------------
# Loading
# --------------------------------------------------------------------------------------------


def load_config(path: str | os.PathLike | None = None, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """Read a YAML file (optional), apply dotted `key=value` overrides, build and validate a Config."""
    # `megatron-dapo --help` imports this module: omegaconf and yaml (~150 ms) load on first use.
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    try:
        base = OmegaConf.create({}) if path is None else _load_yaml(path)
        for item in overrides:
            if "=" not in item:
                raise ConfigError(
                    f"override {item!r} is not of the form key=value (e.g. trainer.total_steps=10)"
                )
            key, _ = item.split("=", 1)
            _check_key_path(key.strip())
        merged = OmegaConf.merge(base, OmegaConf.from_dotlist(list(overrides)))
        raw = OmegaConf.to_container(merged, resolve=True)
    except OmegaConfBaseException as exc:
        raise ConfigError(f"could not read the configuration: {exc}") from exc
    cfg = _build(Config, raw or {}, prefix="")
    validate(cfg)
    return cfg


BASE_KEY = "base"
"""A config file's optional top-level key naming the file it changes (a path relative to it): the
base is read first and this file's sections are merged over it (lists replaced whole). An async
recipe is then its differences from the synchronous one (configs/dapo_qwen2.5_32b_async.yaml)."""


def _load_yaml(path: str | os.PathLike, _chain: tuple[Path, ...] = ()):
    """The file's settings, its `base:` file's first (`BASE_KEY`)."""
    from omegaconf import OmegaConf

    path = Path(path)
    loaded = _read_yaml_file(path)
    if BASE_KEY not in loaded:
        return loaded
    base = loaded.pop(BASE_KEY)
    if not isinstance(base, str) or not base.strip():
        raise ConfigError(f"config file {path}: '{BASE_KEY}' names the config file this one changes (a path relative to it), got {base!r}")
    base_path = (path.parent / base).resolve()
    chain = (*_chain, path.resolve())
    if base_path in chain:
        raise ConfigError(f"config file {path}: '{BASE_KEY}: {base}' comes back to {base_path.name} (" + " -> ".join(p.name for p in (*chain, base_path)) + ")")
    if not base_path.is_file():
        raise ConfigError(f"config file {path}: '{BASE_KEY}: {base}' does not exist (looked for {base_path})")
    return OmegaConf.merge(_load_yaml(base_path, chain), loaded)


def _read_yaml_file(path: Path):
    import yaml
    from omegaconf import OmegaConf

    if not path.is_file():
        raise ConfigError(f"config file {str(path)!r} does not exist")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(f"config file {path} is not UTF-8 text (byte {exc.start}: {exc.reason})") from None
    # The YAML parser's own errors are tracebacks that bury the line; and OmegaConf's message for a
    # repeated key does not say which section it is in. Parse the structure first to say both.
    try:
        root = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.YAMLError as exc:
        raise ConfigError(_yaml_error_message(path, exc)) from None
    for key, first, again in _duplicate_keys(root):
        raise ConfigError(
            f"config file {path} line {again}: key '{key}' is given twice (first on line {first}); keep one of them"
        )
    try:
        loaded = OmegaConf.create(text)
    except yaml.YAMLError as exc:
        raise ConfigError(_yaml_error_message(path, exc)) from None
    if not isinstance(loaded, type(OmegaConf.create({}))):
        raise ConfigError(f"config file {str(path)!r} must hold a mapping of sections at the top level")
    return loaded


def _yaml_error_message(path: Path, exc: Exception) -> str:
    """'config file F line L, column C: <what the parser found> (<context>)' from a PyYAML error."""
    mark = getattr(exc, "problem_mark", None)
    where = f" line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
    problem = getattr(exc, "problem", None) or str(exc)
    context, context_mark = getattr(exc, "context", None), getattr(exc, "context_mark", None)
    if context and context_mark is not None and (mark is None or context_mark.line != mark.line):
        problem += f" ({context} on line {context_mark.line + 1})"
    elif context:
        problem += f" ({context})"
    return f"config file {path}{where}: invalid YAML: {problem}; check the indentation, brackets and quotes there"


def _duplicate_keys(node, prefix: str = ""):
    """(dotted key, first line, repeated line) for every key given twice in one YAML mapping."""
    import yaml

    if isinstance(node, yaml.MappingNode):
        seen: dict[str, int] = {}
        for key_node, value_node in node.value:
            key = str(key_node.value) if isinstance(key_node, yaml.ScalarNode) else key_node.start_mark.line
            line = key_node.start_mark.line + 1
            if key in seen:
                yield f"{prefix}{key}", seen[key], line
            else:
                seen[key] = line
            yield from _duplicate_keys(value_node, f"{prefix}{key}.")
    elif isinstance(node, yaml.SequenceNode):
        for index, item in enumerate(node.value):
            yield from _duplicate_keys(item, f"{prefix.rstrip('.')}[{index}].")


def _check_key_path(key: str) -> None:
    """Reject a misspelt override before merging, with the closest valid key."""
    cls: Any = Config
    walked: list[str] = []
    for part in key.split("."):
        if cls is None:
            raise ConfigError(f"config key '{'.'.join(walked)}' is a value, not a section: cannot set '{key}'")
        hints = typing.get_type_hints(cls)
        if part not in hints:
            _unknown_key(".".join(walked + [part]), hints)
        walked.append(part)
        cls = hints[part] if dataclasses.is_dataclass(hints[part]) else None


def _unknown_key(key: str, valid: typing.Iterable[str]) -> typing.NoReturn:
    valid = sorted(valid)
    leaf = key.rsplit(".", 1)[-1]
    close = difflib.get_close_matches(leaf, valid, n=1)
    parent = key.rsplit(".", 1)[0] + "." if "." in key else ""
    hint = f" Did you mean '{parent}{close[0]}'?" if close else ""
    raise ConfigError(f"unknown config key '{key}'.{hint} Valid keys here: {', '.join(valid)}")


def _build(cls, raw: Any, prefix: str):
    if not isinstance(raw, dict):
        raise ConfigError(
            f"'{prefix.rstrip('.') or 'the config'}' must be a mapping of keys, got {type(raw).__name__} {raw!r}"
        )
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    for key in raw:
        if key not in fields:
            _unknown_key(prefix + str(key), fields)
    kwargs = {}
    for name, f in fields.items():
        if name not in raw:
            continue
        key = prefix + name
        if f.metadata.get("derived") and raw[name] is not None:
            raise ConfigError(
                f"'{key}' is derived from the world size and cannot be set; "
                "set parallel.tp / parallel.pp / parallel.cp and launch with the matching number of processes"
            )
        annotation = hints[name]
        if dataclasses.is_dataclass(annotation):
            kwargs[name] = _build(annotation, raw[name] if raw[name] is not None else {}, key + ".")
        else:
            kwargs[name] = _coerce(raw[name], annotation, key)
    return cls(**kwargs)


def _type_name(annotation) -> str:
    origin = typing.get_origin(annotation)
    if origin is Literal:
        return " | ".join(repr(a) for a in typing.get_args(annotation))
    if origin in (typing.Union, types.UnionType):
        return " | ".join(_type_name(a) for a in typing.get_args(annotation))
    if origin is list:
        return f"list of {_type_name(typing.get_args(annotation)[0])}"
    if annotation is type(None):
        return "null"
    return getattr(annotation, "__name__", str(annotation))


def _coerce(value: Any, annotation, key: str):
    """Check `value` against the declared type; ints are accepted where floats are expected."""
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    fail = ConfigError(f"'{key}' must be {_type_name(annotation)}, got {value!r} ({type(value).__name__})")
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        for candidate in (a for a in args if a is not type(None)):
            try:
                return _coerce(value, candidate, key)
            except ConfigError:
                continue
        raise fail
    if origin is Literal:
        if value in args and type(value) is type(next(a for a in args if a == value)):
            return value
        # YAML 1.1 (OmegaConf) reads a bare `on` / `off` as a boolean: where the choices hold that
        # word, `transformer_engine: on` and `router_replay: off` mean the word.
        if isinstance(value, bool) and ("on" if value else "off") in args:
            return "on" if value else "off"
        close = difflib.get_close_matches(str(value), [str(a) for a in args], n=1)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        raise ConfigError(f"'{key}' must be one of {', '.join(repr(a) for a in args)}, got {value!r}.{hint}")
    if origin is list:
        if isinstance(value, (str, bytes)) or not isinstance(value, (list, tuple)):
            if isinstance(value, str) and args and args[0] is str:
                return [value]  # a single path is a list of one
            raise fail
        return [_coerce(v, args[0], f"{key}[{i}]") for i, v in enumerate(value)]
    if annotation is bool:
        if isinstance(value, bool):
            return value
        raise fail
    if annotation is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise fail
    if annotation is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        raise fail
    if annotation is str:
        if isinstance(value, str):
            return value
        raise fail
    raise fail


def config_to_dict(cfg: Config) -> dict:
    """Plain nested dict (for logging, checkpoint metadata and `megatron-dapo config`)."""
    return dataclasses.asdict(cfg)


# --------------------------------------------------------------------------------------------
# Validation
# --------------------------------------------------------------------------------------------


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ConfigError(message)


@contextlib.contextmanager
def _config_errors():
    """The layout and placement rules raise their own errors; a config that breaks one is a ConfigError."""
    try:
        yield
    except (LayoutError, PlacementError) as exc:
        raise ConfigError(str(exc)) from None


def validate(cfg: Config) -> None:
    """Checks that need only the config (and the model's config.json when it is readable)."""
    p, r, a, t, o = cfg.parallel, cfg.rollout, cfg.algorithm, cfg.trainer, cfg.optimizer
    with _config_errors():
        layout = ParallelLayout.from_config(cfg)  # every size >= 1, the placement the engine can take
        check_expert_dispatcher(cfg.moe.token_dispatcher, p.pp, p.ep)
    for key in ("aux_loss_coeff", "z_loss_coeff"):
        value = getattr(cfg.moe, key)
        _require(value is None or value >= 0, f"'moe.{key}' must be >= 0 or null, got {value}")

    _require(r.n >= 1, f"'rollout.n' must be >= 1, got {r.n}")
    _require(r.temperature > 0, f"'rollout.temperature' must be > 0, got {r.temperature}")
    _require(0 < r.top_p <= 1, f"'rollout.top_p' must be in (0, 1], got {r.top_p}")
    _require(r.top_k == -1 or r.top_k >= 1, f"'rollout.top_k' must be -1 (off) or >= 1, got {r.top_k}")
    _require(r.max_prompt_length >= 1, f"'rollout.max_prompt_length' must be >= 1, got {r.max_prompt_length}")
    _require(r.max_response_length >= 1, f"'rollout.max_response_length' must be >= 1, got {r.max_response_length}")
    _require(r.val_n >= 1, f"'rollout.val_n' must be >= 1, got {r.val_n}")
    _require(r.val_temperature >= 0, f"'rollout.val_temperature' must be >= 0, got {r.val_temperature}")
    _require(0 < r.val_top_p <= 1, f"'rollout.val_top_p' must be in (0, 1], got {r.val_top_p}")
    _require(0 < r.gpu_memory_utilization <= 1, "'rollout.gpu_memory_utilization' must be in (0, 1]")
    _require(r.weight_sync_bucket_mb >= 1, "'rollout.weight_sync_bucket_mb' must be >= 1")
    _require(r.sleep_level in (1, 2), f"'rollout.sleep_level' must be 1 or 2, got {r.sleep_level}")
    with _config_errors():
        check_sync_mode(r.weight_sync_mode, layout.placement, layout.tp, layout.rollout_tp, layout.ep)

    _require(cfg.sft.total_steps >= 0, f"'sft.total_steps' must be >= 0, got {cfg.sft.total_steps}")
    _require(cfg.sft.batch_size >= 1, f"'sft.batch_size' must be >= 1, got {cfg.sft.batch_size}")
    _require(cfg.sft.lr > 0, f"'sft.lr' must be > 0, got {cfg.sft.lr}")
    _require(0 <= a.clip_low < 1, f"'algorithm.clip_low' must be in [0, 1), got {a.clip_low}")
    _require(a.clip_high >= 0, f"'algorithm.clip_high' must be >= 0, got {a.clip_high}")
    _require(
        a.clip_c is None or a.clip_c > 1,
        f"'algorithm.clip_c' (dual-clip) must be > 1 or null to disable it, got {a.clip_c}",
    )
    _require(a.kl.coef >= 0, f"'algorithm.kl.coef' must be >= 0, got {a.kl.coef}")
    _require(a.entropy_coeff >= 0, f"'algorithm.entropy_coeff' must be >= 0, got {a.entropy_coeff}")
    _require(
        a.filter_groups.max_num_gen_batches >= 0,
        "'algorithm.filter_groups.max_num_gen_batches' must be >= 0 (0 = unlimited)",
    )
    _require(a.tis_cap is None or a.tis_cap > 0, f"'algorithm.tis_cap' must be > 0 or null, got {a.tis_cap}")
    if a.mis.enable:
        _require(
            0 < a.mis.low < 1 < a.mis.high < float("inf"),
            f"'algorithm.mis' needs 0 < low < 1 < high (the on-policy ratio 1 inside the band), got "
            f"low={a.mis.low}, high={a.mis.high}",
        )
    _require(
        a.filter_groups.metric in FILTER_GROUP_METRICS,
        f"'algorithm.filter_groups.metric'={a.filter_groups.metric!r} is not one of {', '.join(FILTER_GROUP_METRICS)}",
    )
    ob = a.overlong_buffer
    if ob.enable:
        _require(ob.len >= 1, f"'algorithm.overlong_buffer.len' must be >= 1 when enabled, got {ob.len}")
        _require(
            ob.len <= r.max_response_length,
            f"'algorithm.overlong_buffer.len'={ob.len} is longer than 'rollout.max_response_length'="
            f"{r.max_response_length}: shorten the buffer or raise the max response length",
        )
        _require(ob.penalty_factor >= 0, "'algorithm.overlong_buffer.penalty_factor' must be >= 0")

    for key in ("total_steps", "train_batch_size", "gen_batch_size", "ppo_mini_batch_size", "ppo_epochs", "micro_batch_size"):
        value = getattr(t, key)
        _require(value >= 1, f"'trainer.{key}' must be >= 1, got {value}")
    for key in ("max_tokens_per_micro_batch", "save_every", "eval_every"):
        value = getattr(t, key)
        _require(value >= 0, f"'trainer.{key}' must be >= 0, got {value}")
    _require(t.keep_last >= 1, f"'trainer.keep_last' must be >= 1, got {t.keep_last}")
    _require(
        t.checkpoint_format in CHECKPOINT_FORMATS,
        f"'trainer.checkpoint_format'={t.checkpoint_format!r} is not one of {', '.join(CHECKPOINT_FORMATS)}",
    )
    _require(t.checkpoint_write_threads >= 1, f"'trainer.checkpoint_write_threads' must be >= 1, got {t.checkpoint_write_threads}")
    _require(t.collective_timeout_s > 0, "'trainer.collective_timeout_s' must be > 0")
    _require(r.gather_timeout_s > 0, f"'rollout.gather_timeout_s' must be > 0, got {r.gather_timeout_s}")
    _require(r.liveness_window_s >= 1, f"'rollout.liveness_window_s' must be >= 1 (seconds), got {r.liveness_window_s}")
    _require(
        isinstance(t.max_staleness, int) and t.max_staleness >= 0, f"'trainer.max_staleness' must be an integer >= 0, got {t.max_staleness!r}"
    )
    if t.max_staleness > 0:
        _require(
            layout.placement == "separate",
            f"'trainer.max_staleness'={t.max_staleness} trains asynchronously, which needs the engines on GPUs of their own: "
            f"set rollout.placement=separate with rollout.num_gpus (rollout.placement={r.placement} puts them beside the "
            "actor, where an engine sleeps during the update and generation cannot overlap it)",
        )
        _require(
            a.tis_cap is not None or a.mis.enable,
            f"'trainer.max_staleness'={t.max_staleness} trains on samples of older weights: set an off-policy correction, "
            "algorithm.tis_cap (token-level truncated IS, e.g. 2.0) and/or algorithm.mis.enable=true (sequence-level "
            "masked IS); the engine's log-probs are the behaviour policy (docs/ASYNC.md, \"Off-policy correction\")",
        )
    if r.partial_rollouts:
        _require(
            t.max_staleness > 0,
            "'rollout.partial_rollouts'=true pushes weights into engines while they generate, which only happens "
            "with asynchronous training: set trainer.max_staleness >= 1 (with rollout.placement=separate), or "
            "rollout.partial_rollouts=false",
        )
        _require(
            cfg.actor.router_replay != "r3" and not r.return_routed_experts,
            "'rollout.partial_rollouts'=true pushes weights into generations in flight, and no engine records the routed "
            "experts of a response across a push: use actor.router_replay=off or r2 and rollout.return_routed_experts=false "
            "with partial rollouts, or rollout.partial_rollouts=false (docs/ASYNC.md)",
        )
    _require(
        t.gen_batch_size >= t.train_batch_size,
        f"'trainer.gen_batch_size'={t.gen_batch_size} is smaller than 'trainer.train_batch_size'="
        f"{t.train_batch_size}: a generation batch must hold at least one train batch of prompts; "
        f"raise trainer.gen_batch_size (DAPO uses 3x)",
    )
    _require(
        t.train_batch_size % t.ppo_mini_batch_size == 0,
        f"'trainer.train_batch_size'={t.train_batch_size} is not a multiple of 'trainer.ppo_mini_batch_size'="
        f"{t.ppo_mini_batch_size}: pick a mini-batch size that divides it",
    )
    if t.max_tokens_per_micro_batch:
        longest = r.max_prompt_length + r.max_response_length
        _require(
            t.max_tokens_per_micro_batch >= longest,
            f"'trainer.max_tokens_per_micro_batch'={t.max_tokens_per_micro_batch} cannot hold one full sequence "
            f"(rollout.max_prompt_length + rollout.max_response_length = {longest}); raise it to at least {longest}",
        )
    for name in t.loggers:
        _require(name in _LOGGERS, f"'trainer.loggers' has unknown logger {name!r}; valid: {', '.join(_LOGGERS)}")

    _require(o.lr > 0, f"'optimizer.lr' must be > 0, got {o.lr}")
    _require(o.warmup_steps >= 0, f"'optimizer.warmup_steps' must be >= 0, got {o.warmup_steps}")
    _require(o.weight_decay >= 0, f"'optimizer.weight_decay' must be >= 0, got {o.weight_decay}")
    _require(o.grad_clip >= 0, f"'optimizer.grad_clip' must be >= 0 (0 disables), got {o.grad_clip}")
    _require(0 <= o.adam_beta1 < 1 and 0 <= o.adam_beta2 < 1, "'optimizer.adam_beta1/2' must be in [0, 1)")

    _require(cfg.reward.num_workers >= 0, "'reward.num_workers' must be >= 0 (0 = automatic)")
    _require(cfg.reward.timeout_s > 0, "'reward.timeout_s' must be > 0")
    custom = cfg.reward.custom_function
    if custom.path is not None:
        _require(
            ":" in custom.path or custom.name is not None,
            f"'reward.custom_function.path'={custom.path!r} does not name the function: write "
            "'package.module:function' or '/path/to/file.py:function', or set 'reward.custom_function.name'",
        )
    else:
        _require(custom.name is None, "'reward.custom_function.name' is set but 'reward.custom_function.path' is not")

    if cfg.model.hf_dir:
        model_config = Path(cfg.model.hf_dir) / "config.json"
        if model_config.is_file():
            validate_model_shape(cfg, read_model_config(cfg.model.hf_dir))


def read_model_config(hf_dir: str) -> dict:
    """`model.hf_dir`'s config.json as a dict, refused (ConfigError naming the file and the key) when
    it is not valid JSON or describes an architecture this trainer cannot run: the same check and
    message as `megatron-dapo convert` (`model.hf_config.read_hf_config`)."""
    # The megatron_dapo.model package imports torch, which `megatron-dapo --help` must not load.
    from megatron_dapo.model.hf_config import ModelFileError, UnsupportedModelError, load_config_json, read_hf_config

    try:
        raw = load_config_json(hf_dir)
        read_hf_config(raw)
    except ModelFileError as exc:
        raise ConfigError(f"'model.hf_dir'={hf_dir}: {exc}") from None
    except UnsupportedModelError as exc:
        raise ConfigError(f"'model.hf_dir'={hf_dir} holds a model this trainer cannot run: {exc}") from None
    return raw


def skipped_model_checks(cfg: Config) -> Optional[str]:
    """Why the model-shape checks (heads vs TP, layers vs PP x VPP, architecture) did not run, or None
    when they did: `megatron-dapo config` says so instead of passing a layout it could not check."""
    hf_dir = cfg.model.hf_dir
    if not hf_dir:
        reason = "'model.hf_dir' is empty"
    elif not Path(hf_dir).is_dir():
        reason = f"'model.hf_dir'={hf_dir} does not exist here"
    elif not (Path(hf_dir) / "config.json").is_file():
        reason = f"'model.hf_dir'={hf_dir} has no config.json"
    else:
        return None
    return (
        f"{reason}, so the model-shape checks (architecture, attention heads vs parallel.tp, layers vs "
        "parallel.pp x parallel.vpp) were skipped; set model.hf_dir to the HuggingFace model directory to run "
        "them (train and sft require it)"
    )


def validate_model_shape(cfg: Config, hf_config: dict) -> None:
    """Parallel sizes against the model's shape (`ParallelLayout.validate`) from its HF config.json."""
    heads = int(hf_config.get("num_attention_heads", 0) or 0)
    experts = int(hf_config.get("num_experts") or hf_config.get("num_local_experts") or 0)
    with _config_errors():
        ParallelLayout.from_config(cfg).validate(
            num_layers=int(hf_config.get("num_hidden_layers", 0) or 0),
            num_attention_heads=heads,
            num_query_groups=int(hf_config.get("num_key_value_heads", heads) or heads),
            num_experts=experts,
        )
        if experts:
            check_moe_sequence_parallel(cfg.parallel.tp, cfg.parallel.sequence_parallel)
    _require(
        cfg.actor.router_replay == "off" or experts > 0,
        f"'actor.router_replay'={cfg.actor.router_replay} replays mixture-of-experts routing, but 'model.hf_dir' "
        f"holds a dense model ({hf_config.get('model_type', 'no model_type')}): set actor.router_replay: off",
    )


def engine_returns_routing(cfg: Config, is_moe: bool) -> bool:
    """Whether the rollout engine is asked for each token's routed experts: mixture-of-experts models
    with `actor.router_replay` r3 or `rollout.return_routed_experts`, and always with the embedded
    engine (it records them from its own forward at no cost worth counting) but with partial rollouts
    (no engine records them across a weight push)."""
    embedded = cfg.rollout.engine == "embedded" and not cfg.rollout.partial_rollouts
    wanted = cfg.actor.router_replay == "r3" or cfg.rollout.return_routed_experts or embedded
    return is_moe and wanted


def parallel_layout(cfg: Config, world_size: int) -> ParallelLayout:
    """The run's `ParallelLayout` for `world_size` processes, after every check that needs the number
    of processes (pre-flight, before any model loads): the sizes against the world, and the batches
    split evenly over its data-parallel ranks."""
    t, r = cfg.trainer, cfg.rollout
    with _config_errors():
        layout = ParallelLayout.from_config(cfg, world_size)
        check_batch_split(
            layout.dp,
            ppo_mini_batch_size=t.ppo_mini_batch_size,
            n=r.n,
            micro_batch_size=t.micro_batch_size,
            max_tokens_per_micro_batch=t.max_tokens_per_micro_batch,
            gen_batch_size=t.gen_batch_size,
            train_batch_size=t.train_batch_size,
        )
    return layout
