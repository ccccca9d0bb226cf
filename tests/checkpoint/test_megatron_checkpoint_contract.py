"""Contract: the Megatron-Core checkpoint API the checkpoint code calls, read from Megatron's source.

Checked without importing Megatron (Python's `ast` on the source files), so the same checks run
against the installed megatron-core (0.16 here) and against any other release's source tree named
by the MEGATRON_CORE_SOURCE environment variable: the directory that holds `megatron/core`, e.g. a
checkout of NVIDIA/Megatron-LM at tag core_v0.19.0 (Python 3.12 only, so not installable here).
The resume tests run the real calls on the installed version.

What `checkpoint/torch_dist.py` and `checkpoint/optimizer_state.py` rely on:
- `dist_checkpointing.save(sharded_state_dict, checkpoint_dir, sharded_strategy=...)` and
  `load(sharded_state_dict, checkpoint_dir)`;
- `TorchDistSaveShardedStrategy(backend, version)` with `keep_only_main_replica`, and the helpers
  `_replace_state_dict_keys_with_sharded_keys` (3 results) and `mcore_to_pyt_state_dict(state, is_loading)`,
  `MCoreSavePlanner(dedup_replicated_tensors=, can_run_decentralized_global_plan=, **planner kwargs)`;
- `FullyParallelSaveStrategyWrapper(strategy, parallelization_group, do_cache_distribution)`;
- `DistributedOptimizer.sharded_state_dict(model_sharded_state_dict, is_loading, metadata=...)` with
  `metadata["distrib_optim_sharding_type"]` in {dp_reshardable, fully_reshardable}, the loaders
  `load_parameter_state_from_dp_reshardable` / `_fully_reshardable`, and the attributes
  `per_bucket_numel_unpadded` and `data_parallel_group_idx`.

What `checkpoint/model_space.py` (the `fully_sharded_model_space` format, built here) relies on:
- Megatron lists `fully_sharded_model_space` in `DistributedOptimizer.checkpoint_fully_reshardable_formats`
  (so a ChainedOptimizer adds no key prefix for it, as for `fully_reshardable`, and Megatron-LM treats
  it as loadable at any layout);
- the distributed optimizer's `gbuf_ranges` ("param_map" -> "param" ranges),
  `_get_main_param_and_optimizer_states` / `_set_main_param_and_optimizer_states`,
  `distributed_optimizer_instance_id`, `state_dict` / `load_state_dict`;
- uneven sharding in the torch_dist translation (`has_regular_grid` false: `LocalShardsContainer`
  of `CheckpointableShardedTensor`s, several chunks per rank and key).
"""

from __future__ import annotations

import ast
import os
from pathlib import Path

import pytest


def _installed_root() -> Path:
    import importlib.util

    spec = importlib.util.find_spec("megatron.core")
    return Path(spec.origin).parents[2]


ROOTS = [pytest.param(_installed_root(), id="installed")]
if os.environ.get("MEGATRON_CORE_SOURCE"):
    ROOTS.append(pytest.param(Path(os.environ["MEGATRON_CORE_SOURCE"]), id="MEGATRON_CORE_SOURCE"))


def _module(root: Path, relative: str) -> ast.Module:
    path = root / "megatron" / "core" / relative
    return ast.parse(path.read_text(), filename=str(path))


def _function(tree: ast.AST, name: str, cls: str | None = None) -> ast.FunctionDef:
    scope = tree
    if cls is not None:
        scope = next(n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == cls)
    for node in ast.walk(scope):
        if isinstance(node, ast.FunctionDef) and node.name == name:
            return node
    raise AssertionError(f"{cls + '.' if cls else ''}{name} not found")


def _args(fn: ast.FunctionDef) -> list[str]:
    return [a.arg for a in fn.args.posonlyargs + fn.args.args]


def _all_args(fn: ast.FunctionDef) -> set[str]:
    return set(_args(fn)) | {a.arg for a in fn.args.kwonlyargs}


@pytest.mark.parametrize("root", ROOTS)
def test_save_and_load_entry_points(root):
    tree = _module(root, "dist_checkpointing/serialization.py")
    save, load = _function(tree, "save"), _function(tree, "load")
    assert _args(save)[:2] == ["sharded_state_dict", "checkpoint_dir"] and "sharded_strategy" in _all_args(save)
    assert _args(load)[:2] == ["sharded_state_dict", "checkpoint_dir"]


@pytest.mark.parametrize("root", ROOTS)
def test_torch_dist_save_strategy_and_helpers(root):
    tree = _module(root, "dist_checkpointing/strategies/torch.py")
    init = _function(tree, "__init__", "TorchDistSaveShardedStrategy")
    assert _args(init)[1:3] == ["backend", "version"]
    assert "keep_only_main_replica" in ast.unparse(init)
    replace = _function(tree, "_replace_state_dict_keys_with_sharded_keys")
    assert _args(replace)[:2] == ["sharded_state_dict", "keep_only_main_replica"]
    returns = [n for n in ast.walk(replace) if isinstance(n, ast.Return)]
    assert returns and all(isinstance(r.value, ast.Tuple) and len(r.value.elts) == 3 for r in returns)
    assert _args(_function(tree, "mcore_to_pyt_state_dict"))[:2] == ["state_dict", "is_loading"]
    planner = _function(tree, "__init__", "MCoreSavePlanner")
    assert {"dedup_replicated_tensors", "can_run_decentralized_global_plan"} <= _all_args(planner)
    assert planner.args.kwarg is not None  # flatten_state_dict goes through to DefaultSavePlanner


@pytest.mark.parametrize("root", ROOTS)
def test_fully_parallel_save_wrapper(root):
    tree = _module(root, "dist_checkpointing/strategies/fully_parallel.py")
    init = _function(tree, "__init__", "FullyParallelSaveStrategyWrapper")
    assert _args(init)[1:4] == ["strategy", "parallelization_group", "do_cache_distribution"]
    assert "base_strategy.save" in ast.unparse(_function(tree, "save", "FullyParallelSaveStrategyWrapper"))


@pytest.mark.parametrize("root", ROOTS)
def test_distributed_optimizer_formats(root):
    tree = _module(root, "optimizer/distrib_optimizer.py")
    cls = "DistributedOptimizer"
    sharded = _function(tree, "sharded_state_dict", cls)
    assert _args(sharded)[1:3] == ["model_sharded_state_dict", "is_loading"] and "metadata" in _all_args(sharded)
    body = ast.unparse(sharded)
    assert "distrib_optim_sharding_type" in body
    for fmt in ("dp_reshardable", "fully_reshardable"):
        assert f"'{fmt}'" in body or f'"{fmt}"' in body, fmt
        _function(tree, f"load_parameter_state_from_{fmt}", cls)
    assert "param_state_sharding_type" in body
    source = ast.unparse(_function(tree, "__init__", cls))
    assert "self.per_bucket_numel_unpadded" in source and "self.data_parallel_group_idx" in source
    # The reason `load_optimizer_state` hides Adam's "step": the loaders copy into every state key.
    setter = ast.unparse(_function(tree, "_set_main_param_and_optimizer_states", cls))
    assert "for key in dst_tensors" in setter


def _class_attribute(tree: ast.AST, cls: str, name: str) -> ast.AST:
    scope = next(n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == cls)
    for node in scope.body:
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) else []
        if any(isinstance(t, ast.Name) and t.id == name for t in targets):
            return node.value
    raise AssertionError(f"{cls}.{name} not found")


@pytest.mark.parametrize("root", ROOTS)
def test_model_space_format(root):
    tree = _module(root, "optimizer/distrib_optimizer.py")
    cls = "DistributedOptimizer"
    formats = ast.literal_eval(_class_attribute(tree, cls, "checkpoint_fully_reshardable_formats"))
    assert {"fully_reshardable", "fully_sharded_model_space"} <= set(formats), formats
    getter = ast.unparse(_function(tree, "_get_main_param_and_optimizer_states", cls))
    assert _args(_function(tree, "_get_main_param_and_optimizer_states", cls))[1:] == ["model_param"]
    assert _args(_function(tree, "_set_main_param_and_optimizer_states", cls))[1:] == ["model_param", "tensors"]
    assert "'param'" in getter or '"param"' in getter
    init = ast.unparse(_function(tree, "__init__", cls))
    assert "self.gbuf_ranges" in init and "distributed_optimizer_instance_id" in init
    assert "'param_map'" in ast.unparse(_function(tree, "_build_model_gbuf_range", cls))
    assert "'param':" in ast.unparse(_function(tree, "_build_model_gbuf_param_range_map", cls))  # {"param": Range, ...}
    _function(tree, "state_dict", cls), _function(tree, "load_state_dict", cls)
    chained = ast.unparse(_function(_module(root, "optimizer/optimizer.py"), "sharded_state_dict", "ChainedOptimizer"))
    assert "checkpoint_fully_reshardable_formats" in chained
    translate = ast.unparse(_function(_module(root, "dist_checkpointing/strategies/torch.py"), "mcore_to_pyt_state_dict"))
    assert "has_regular_grid" in translate and "LocalShardsContainer" in translate and "CheckpointableShardedTensor" in translate
