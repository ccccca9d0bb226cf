"""Megatron's torch_dist checkpoint format: an in-process writer and checks before loading.

Saving: `save_sharded(state, directory)` is `megatron.core.dist_checkpointing.save` with one change
of strategy. Megatron's default torch_dist writer (`FileSystemWriterAsync`) creates a
`multiprocessing` Manager with the *spawn* start method and forks writer processes even for a
synchronous save. Spawn re-imports the `__main__` module, which re-runs any launcher script without
an `if __name__ == "__main__"` guard, and on our CPU machines the forked writer died and the save
hung. `InProcessTorchDistSaveStrategy` translates the sharded state dict exactly as Megatron does
(same key grouping, same MCore -> PyTorch tensor translation, same MCore save planner) and hands it
to PyTorch's own synchronous `FileSystemWriter`, in this process, with `threads` writer threads
(one file each: `__<rank>_<n>.distcp`). The files are the same torch_dist format (DCP `.metadata` +
`*.distcp`), read back by Megatron's unchanged loader.

With `parallel_group` (the data-parallel group), the strategy is wrapped in Megatron's
`FullyParallelSaveStrategyWrapper`, as Megatron-LM's trainer does (`--ckpt-fully-parallel-save`):
tensors replicated over that group (the weights, the non-distributed optimizer's state) are written
once, by the replica the wrapper picks so that every rank writes about the same number of bytes,
instead of all by DP rank 0.

Loading: `check_against_checkpoint` compares a requested sharded state dict with what the
checkpoint holds (keys and global shapes, read from the DCP metadata alone) and raises one error
listing every problem, instead of the first KeyError deep inside torch.distributed.checkpoint.
`_extra_state` objects that a checkpoint lacks (they carry Transformer Engine FP8 metadata, or
nothing with the local layer spec) are loaded as None, so checkpoints move between the local and
the TE layer specs.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Union

from megatron.core import dist_checkpointing

from megatron_dapo.errors import ConfigError
from megatron.core.dist_checkpointing.mapping import (
    LocalNonpersistentObject,
    ShardedObject,
    ShardedTensor,
    ShardedTensorFactory,
)
from megatron.core.dist_checkpointing.strategies.fully_parallel import FullyParallelSaveStrategyWrapper
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

__all__ = [
    "CheckpointLayoutError",
    "CheckpointMismatchError",
    "InProcessTorchDistSaveStrategy",
    "check_against_checkpoint",
    "load_sharded",
    "save_sharded",
    "stored_entries",
]


class CheckpointMismatchError(ConfigError):
    """The checkpoint cannot be loaded into the objects given (missing keys, different shapes).

    A `ConfigError`: the command line reports it in one line (the checkpoint or the model named is the
    wrong one), without a traceback."""


class CheckpointLayoutError(CheckpointMismatchError):
    """A checkpoint whose optimizer state is tied to its parallel layout (`dp_reshardable`) was asked
    for at another TP / PP / VPP layout, or with other gradient buckets."""


def _build_strategy_class():
    """The in-process strategy, or None when this Megatron lacks the helpers it reuses."""
    try:
        import torch.distributed.checkpoint as dcp
        from megatron.core.dist_checkpointing.strategies.torch import (
            MCoreSavePlanner,
            TorchDistSaveShardedStrategy,
            _replace_state_dict_keys_with_sharded_keys,
            mcore_to_pyt_state_dict,
        )
    except ImportError:  # a Megatron that moved these: fall back to its default strategy
        return None

    class InProcessTorchDistSaveStrategy(TorchDistSaveShardedStrategy):
        """Megatron's torch_dist save, written synchronously by this process (see module doc)."""

        writer_threads = 1
        """Files (and threads) per rank; set by `save_sharded`."""

        def save(self, sharded_state_dict, checkpoint_dir: Union[str, Path]) -> None:
            flat, _, _ = _replace_state_dict_keys_with_sharded_keys(sharded_state_dict, self.keep_only_main_replica)
            pyt_state_dict = mcore_to_pyt_state_dict(flat, False)
            dcp.save(
                pyt_state_dict,
                storage_writer=dcp.FileSystemWriter(str(checkpoint_dir), thread_count=self.writer_threads),
                planner=MCoreSavePlanner(
                    dedup_replicated_tensors=not self.keep_only_main_replica,
                    flatten_state_dict=False,
                    can_run_decentralized_global_plan=False,
                ),
            )

    return InProcessTorchDistSaveStrategy


InProcessTorchDistSaveStrategy = _build_strategy_class()


def save_sharded(
    sharded_state_dict: dict, directory: Union[str, os.PathLike], *, threads: int = 1, parallel_group: Any = None
) -> None:
    """`dist_checkpointing.save` into an existing empty `directory` (collective over all ranks).

    `threads`: writer threads (and files) per rank. `parallel_group`: spread the writing of tensors
    replicated over this process group across its ranks (Megatron's fully parallel save); None: the
    main replica (DP rank 0) writes them.
    """
    strategy = None
    if InProcessTorchDistSaveStrategy is not None:
        strategy = InProcessTorchDistSaveStrategy("torch_dist", 1)
        strategy.writer_threads = max(1, int(threads))
        if parallel_group is not None:
            # Positional: (strategy, group, do_cache_distribution) in megatron-core 0.16 and 0.19.
            strategy = FullyParallelSaveStrategyWrapper(strategy, parallel_group, False)
    dist_checkpointing.save(sharded_state_dict, str(directory), sharded_strategy=strategy)


def load_sharded(sharded_state_dict: dict, directory: Union[str, os.PathLike]) -> dict:
    """`dist_checkpointing.load` (collective); call `check_against_checkpoint` first for clear errors."""
    return dist_checkpointing.load(sharded_state_dict, str(directory))


def stored_entries(directory: Union[str, os.PathLike]) -> dict[str, Any]:
    """Key -> DCP storage metadata (TensorStorageMetadata with .size / BytesStorageMetadata) of a checkpoint."""
    return dict(FileSystemReader(str(directory)).read_metadata().state_dict_metadata)


def _describe(keys: list[str], limit: int = 8) -> str:
    shown = ", ".join(keys[:limit])
    return shown + (f", ... ({len(keys) - limit} more)" if len(keys) > limit else "")


def check_against_checkpoint(sharded_state_dict: Any, directory: Union[str, os.PathLike]) -> list[str]:
    """Raise CheckpointMismatchError unless every tensor/object requested is in the checkpoint.

    Compares keys and global shapes (shapes flagged `allow_shape_mismatch`, i.e. the padded
    vocabulary, may differ). Replaces requested `_extra_state` objects the checkpoint lacks by
    None in place and returns their keys.
    """
    stored = stored_entries(directory)
    missing: list[str] = []
    shapes: list[str] = []
    replaced: list[str] = []

    def visit(container: Any) -> None:
        items = container.items() if isinstance(container, dict) else enumerate(container)
        for index, value in list(items):
            if isinstance(value, (dict, list)):
                visit(value)
            elif isinstance(value, ShardedObject):
                if value.unique_key not in stored:
                    if value.key.endswith("._extra_state"):
                        container[index] = LocalNonpersistentObject(None)
                        replaced.append(value.unique_key)
                    else:
                        missing.append(value.unique_key)
            elif isinstance(value, ShardedTensorFactory):
                if value.key not in stored:
                    missing.append(value.key)
            elif isinstance(value, ShardedTensor):
                meta = stored.get(value.key)
                if not isinstance(meta, TensorStorageMetadata):
                    missing.append(value.key)
                elif not value.allow_shape_mismatch and tuple(meta.size) != tuple(value.global_shape):
                    shapes.append(f"{value.key}: checkpoint {tuple(meta.size)}, model {tuple(value.global_shape)}")

    visit(sharded_state_dict)
    problems = []
    if shapes:
        problems.append(
            f"{len(shapes)} tensor(s) have another global shape (was the checkpoint written for a different "
            f"model?):\n    " + "\n    ".join(sorted(set(shapes))[:8])
        )
    if missing:
        missing = sorted(set(missing))
        problems.append(f"{len(missing)} key(s) are not in the checkpoint: {_describe(missing)}")
    if problems:
        raise CheckpointMismatchError(f"cannot load {directory}:\n  " + "\n  ".join(problems))
    return replaced

