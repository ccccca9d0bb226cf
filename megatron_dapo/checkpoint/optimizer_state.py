"""The optimizer's part of a checkpoint: which format, whether it fits this layout, and loading it.

Three formats of Megatron's distributed optimizer (ZeRO-1) state, chosen per save
(`trainer.checkpoint_format`, `trainer.final_checkpoint_reshardable`):

- `dp_reshardable` (Megatron-LM's default for its periodic saves): each DP rank writes its own
  contiguous shard of every gradient bucket, with no communication and no copy. The bucket layout
  follows the model-parallel rank (TP x PP x VPP chunk), so the state loads only at the same TP,
  PP and VPP; DP (and CP) may change as long as the buckets hold the same parameters
  (`bucket_layout`: Megatron's per-bucket element counts, recorded at save and compared at load).
- `fully_reshardable`: the shards are gathered over gloo into the CPU memory of DP rank 0 (the
  memory-efficient variant), which writes the state laid out like the model's parameters; it loads
  at any TP / PP / VPP / EP / DP, but every byte of optimizer state passes through DP rank 0's node
  (`final_save.py` checks that it fits).
- `fully_sharded_model_space` (`model_space.py`): the same tensors as `fully_reshardable`, under the
  same keys, but each DP rank writes its own part of them: no gather, no buffer, every rank writes;
  it loads at any layout too, each rank reading only its own part.

`ANY_LAYOUT_FORMATS` are the last two. Non-distributed optimizers keep the full state on every DP
rank and save it like the weights: any layout. Megatron 0.16 and 0.19 take the format as
`optimizer.sharded_state_dict(..., metadata={"distrib_optim_sharding_type": ...})` and name the
result `param_state_sharding_type`; `fully_sharded_model_space` is built here instead (Megatron's
own builder of that name no longer works, see `model_space.py`), and its state carries that name.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

from megatron_dapo.checkpoint.errors import CheckpointError
from megatron_dapo.checkpoint.model_space import MODEL_SPACE, load_model_space_param_state

__all__ = [
    "ANY_LAYOUT_FORMATS",
    "MODEL_SPACE",
    "OPTIMIZER_FORMATS",
    "bucket_layout",
    "bucket_mismatch",
    "layout_change",
    "load_optimizer_state",
    "materialise_adam_state",
    "optimizer_kind",
    "sharding_metadata",
]

OPTIMIZER_FORMATS = ("dp_reshardable", "fully_reshardable", MODEL_SPACE)
"""Distributed-optimizer checkpoint formats this version writes and reads."""
ANY_LAYOUT_FORMATS = ("fully_reshardable", MODEL_SPACE)
"""The formats whose optimizer state loads at any TP / PP / VPP / EP / DP (laid out like the model)."""

LAYOUT_BOUND_KEYS = ("tp", "pp", "vpp", "ep")
"""Layout sizes a `dp_reshardable` optimizer state is bound to (its keys and buckets follow them;
EP decides which experts' state a rank holds)."""
_LAYOUT_DEFAULTS = {"ep": 1}  # checkpoints saved before a key existed were saved at this value


def sharding_metadata(optimizer_format: str) -> dict:
    """The `metadata` given to `optimizer.sharded_state_dict` for one format."""
    if optimizer_format not in OPTIMIZER_FORMATS:
        raise ValueError(f"unknown optimizer checkpoint format {optimizer_format!r}; valid: {', '.join(OPTIMIZER_FORMATS)}")
    # fully_sharded_model_space: distributed optimizers are not asked for it (`model_space.py` builds
    # it); the name still tells a ChainedOptimizer of local ones that the format is fully reshardable.
    metadata = {"distrib_optim_sharding_type": optimizer_format, "chained_optim_avoid_prefix": True}
    if optimizer_format == "fully_reshardable":
        # Gathered over gloo into DP rank 0's CPU memory: the all-gather over NCCL variant would hold the
        # whole (TP x PP slice of the) optimizer state in every rank's GPU memory.
        metadata["distrib_optim_fully_reshardable_mem_efficient"] = True
    return metadata


def inner_optimizers(optimizer: Any) -> list:
    return list(getattr(optimizer, "chained_optimizers", None) or [optimizer])


def optimizer_kind(optimizer: Any) -> str:
    """"distributed" (ZeRO-1 DistributedOptimizer) or "local" (each DP rank holds the full state)."""
    kinds = {"distributed" if isinstance(o, DistributedOptimizer) else "local" for o in inner_optimizers(optimizer)}
    if len(kinds) != 1:
        raise CheckpointError(f"mixed optimizer kinds {sorted(kinds)} are not supported by checkpointing")
    return kinds.pop()


def layout_change(saved: dict, now: dict) -> Optional[str]:
    """What differs between a `dp_reshardable` checkpoint's layout and this run's in the sizes its
    optimizer state is bound to ("tp 2 -> 1, pp 1 -> 2"), or None when it can load (pure)."""
    def size(layout: dict, key: str):
        return layout.get(key, _LAYOUT_DEFAULTS.get(key))

    changes = [f"{k} {size(saved, k)} -> {size(now, k)}" for k in LAYOUT_BOUND_KEYS if size(saved, k) != size(now, k)]
    return ", ".join(changes) or None


def bucket_layout(optimizer: Any) -> dict[str, list]:
    """This rank's gradient-bucket element counts per distributed optimizer, keyed by
    "<optimizer index>:<model-parallel rank>" (what `dp_reshardable` state is laid out by)."""
    layout = {}
    for index, inner in enumerate(inner_optimizers(optimizer)):
        if isinstance(inner, DistributedOptimizer):
            counts = getattr(inner, "per_bucket_numel_unpadded", None)
            layout[f"{index}:{inner.data_parallel_group_idx}"] = _plain(counts)
    return layout


def _plain(value: Any) -> Any:
    """Megatron's nested dict/list of ints (dict keys may be dtypes) as JSON-comparable lists."""
    if isinstance(value, dict):
        return [[str(k), _plain(v)] for k, v in sorted(value.items(), key=lambda kv: str(kv[0]))]
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return int(value) if isinstance(value, (int, torch.Tensor)) else value


def bucket_mismatch(saved: dict, mine: dict) -> Optional[str]:
    """Which of this rank's buckets differ from those recorded at save, or None (pure)."""
    for key, counts in sorted(mine.items()):
        if key not in saved:
            return f"optimizer {key} (index:model-parallel rank) is not in the checkpoint"
        if saved[key] != counts:
            return f"optimizer {key}: bucket sizes {counts} here, {saved[key]} in the checkpoint"
    return None


def materialise_adam_state(optimizer: Any) -> None:
    """Create the Adam state PyTorch would create at the first step, where it is missing.

    Megatron 0.16's DistributedOptimizer.state_dict() on the PyTorch-Adam path (no Apex / TE: CPU
    machines) reads state["step"] of every parameter, which PyTorch creates lazily at the first
    step, so a never-stepped optimizer cannot describe what to load. Zeros and step 0 are exactly
    PyTorch's initial state, and loading overwrites them.
    """
    for inner in inner_optimizers(optimizer):
        torch_optimizer = getattr(inner, "optimizer", None)
        if not isinstance(torch_optimizer, (torch.optim.Adam, torch.optim.AdamW)):
            continue
        for group in torch_optimizer.param_groups:
            for param in group["params"]:
                state = torch_optimizer.state[param]
                if "step" in state:
                    continue
                # Where PyTorch keeps it: on the parameter's device only for capturable / fused Adam.
                on_param = group.get("capturable") or group.get("fused")
                state["step"] = torch.tensor(0.0, device=param.device if on_param else "cpu")
                state.setdefault("exp_avg", torch.zeros_like(param, memory_format=torch.preserve_format))
                state.setdefault("exp_avg_sq", torch.zeros_like(param, memory_format=torch.preserve_format))
                if group.get("amsgrad"):
                    state.setdefault("max_exp_avg_sq", torch.zeros_like(param, memory_format=torch.preserve_format))


_PARAM_STATE_LOADERS = {
    "fully_reshardable": lambda opt, state: opt.load_parameter_state_from_fully_reshardable(state),
    "dp_reshardable": lambda opt, state: opt.load_parameter_state_from_dp_reshardable(state),
    MODEL_SPACE: load_model_space_param_state,
}


def load_optimizer_state(optimizer: Any, state_dict: Any) -> None:
    """`optimizer.load_state_dict`, working around a Megatron (0.16 - 0.19) bug on the PyTorch-Adam path.

    DistributedOptimizer.load_state_dict first rebuilds the inner optimizer's state (adding a
    per-parameter "step" on the PyTorch path, from the param groups), then copies the loaded
    tensors into every key of that state, "step" included: the model-space tensors (fully_reshardable,
    fully_sharded_model_space) have no "step" (KeyError), and the dp-reshardable ones carry the step tensor of the optimizer *before*
    the load (it is a non-persistent entry), which would silently reset Adam's bias correction. We
    split the two halves and hide "step" during the copy (under no_grad); with Apex / TE optimizers
    there is no per-parameter step and this is the plain call.
    """

    inner = inner_optimizers(optimizer)
    # A ChainedOptimizer's parts are saved under their indices (Megatron chains a second optimizer for
    # the experts at parallel.ep > 1 only), a single optimizer's common state (param groups) at the top.
    # What is loaded merges the saved common state with the tensors asked for by this run's optimizer.
    def common(part: Any) -> bool:
        return isinstance(part, dict) and ("optimizer" in part or "param_groups" in part)

    saved = 1 if common(state_dict) else sum(1 for k, v in state_dict.items() if isinstance(k, int) and common(v))
    if saved and saved != len(inner):
        from megatron_dapo.checkpoint.torch_dist import CheckpointMismatchError

        raise CheckpointMismatchError(
            f"the checkpoint holds the state of {saved} optimizer(s), this run has {len(inner)}: Megatron gives the "
            "experts an optimizer of their own at parallel.ep > 1 only, so the optimizer state of a MoE saved at EP > 1 "
            "does not load at EP = 1 and vice versa; resume at an EP on the same side, or load the weights only"
        )
    parts = [state_dict] if len(inner) == 1 else [state_dict[k] for k in sorted(state_dict)]
    for opt, part in zip(inner, parts):
        loader = _PARAM_STATE_LOADERS.get(part.get("param_state_sharding_type")) if isinstance(part, dict) else None
        if not isinstance(opt, DistributedOptimizer) or loader is None:
            opt.load_state_dict(part)
            continue
        part = dict(part)
        param_state = part.pop("param_state")
        part.pop("param_state_sharding_type")
        opt.load_state_dict(part)  # param groups, step, grad scaler
        hidden = {param: state.pop("step") for param, state in opt.optimizer.state.items() if "step" in state}
        try:
            # no_grad: with fp32 parameters the main-param shards are views of leaves that require grad,
            # and 0.16's dp_reshardable loader copies into them without a no_grad of its own.
            with torch.no_grad():
                loader(opt, param_state)
        finally:
            for param, step in hidden.items():
                opt.optimizer.state[param]["step"] = step
    if len(inner) > 1 and hasattr(optimizer, "_synchronize_steps"):
        optimizer._synchronize_steps()
    _unshare_step_tensors(optimizer)


def _unshare_step_tensors(optimizer: Any) -> None:
    """Give every parameter its own Adam "step" tensor.

    DistributedOptimizer.load_state_dict (PyTorch path) puts ONE step tensor in every parameter's
    state; PyTorch's foreach Adam then increments that shared tensor once per parameter, so after
    one update the bias correction uses step 2 + number of parameters instead of 3. Found by the
    resume test: the loss after the first resumed update differed from the uninterrupted run.
    """
    for inner in inner_optimizers(optimizer):
        torch_optimizer = getattr(inner, "optimizer", None)
        if not isinstance(torch_optimizer, torch.optim.Optimizer):
            continue
        seen: set[int] = set()
        for state in torch_optimizer.state.values():
            step = state.get("step")
            if isinstance(step, torch.Tensor):
                if id(step) in seen:
                    state["step"] = step.clone()
                seen.add(id(step))
