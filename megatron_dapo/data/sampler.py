"""Which prompts each step uses: a deterministic, resumable stream of dataset indices, and DP sharding.

The sampler hands out a stream of indices made of one permutation of the dataset per epoch, epoch
after epoch. A global batch is the next `batch_size` indices of that stream, so:

* every index appears exactly once per epoch, nothing is dropped at the end of an epoch: the batch
  that reaches the end of epoch e continues with the start of epoch e+1 (it straddles the boundary;
  when the dataset is smaller than a batch, a batch can hold an index twice);
* the stream never runs dry, which DAPO's dynamic sampling needs (it draws generation batches until
  the train batch is full);
* the whole state is one number, the count of indices handed out, so a resumed run continues the
  same order bit for bit.

Every rank builds the same sampler from the same seed and gets the same global batch without any
communication; `shard_for_rank` then gives each data-parallel rank its contiguous share (the same
rule splits the validation set among the rollout replicas).
"""

from __future__ import annotations

from typing import Any, Sequence, TypeVar

import numpy as np

from megatron_dapo.errors import ConfigError

__all__ = ["PromptSampler", "shard_for_rank"]

T = TypeVar("T")
_STATE_VERSION = 1


class PromptSampler:
    """Global batches of dataset indices, identical on every rank; epochs roll over, reshuffled each time.

    Epoch `e` uses the permutation drawn from a numpy PCG64 generator seeded with the pair
    ``(seed, e)`` (not ``seed + e``, so that run ``seed=1`` epoch 1 is not run ``seed=2`` epoch 0);
    with ``shuffle=False`` every epoch is ``0, 1, ..., num_examples - 1``.
    """

    def __init__(self, num_examples: int, batch_size: int, *, shuffle: bool, seed: int) -> None:
        if num_examples < 1:
            raise ValueError(f"PromptSampler needs at least one example, got num_examples={num_examples}")
        if batch_size < 1:
            raise ValueError(f"PromptSampler batch_size must be >= 1, got {batch_size}")
        if seed < 0:
            raise ValueError(f"data.seed must be >= 0, got {seed}")
        self.num_examples = int(num_examples)
        self.batch_size = int(batch_size)
        self.shuffle = bool(shuffle)
        self.seed = int(seed)
        self._consumed = 0
        self._order_epoch = -1
        self._order = np.arange(0)

    @property
    def consumed(self) -> int:
        """Indices handed out so far, over all epochs."""
        return self._consumed

    @property
    def epoch(self) -> int:
        """The epoch the next index comes from (0 for the first pass)."""
        return self._consumed // self.num_examples

    def epoch_order(self, epoch: int) -> np.ndarray:
        """The order of epoch `epoch`: a permutation of ``range(num_examples)`` (read-only)."""
        if epoch != self._order_epoch:
            if self.shuffle:
                order = np.random.Generator(np.random.PCG64([self.seed, epoch])).permutation(self.num_examples)
            else:
                order = np.arange(self.num_examples)
            order.setflags(write=False)
            self._order, self._order_epoch = order, epoch
        return self._order

    def next_batch(self) -> list[int]:
        """The next `batch_size` indices of the stream (may continue into the next epoch)."""
        batch: list[int] = []
        while len(batch) < self.batch_size:
            epoch, position = divmod(self._consumed, self.num_examples)
            take = min(self.batch_size - len(batch), self.num_examples - position)
            batch.extend(self.epoch_order(epoch)[position : position + take].tolist())
            self._consumed += take
        return batch

    def state_dict(self) -> dict[str, Any]:
        """Plain ints and bools (JSON-safe) for the checkpoint."""
        return {
            "version": _STATE_VERSION,
            "consumed": self._consumed,
            "num_examples": self.num_examples,
            "batch_size": self.batch_size,
            "shuffle": self.shuffle,
            "seed": self.seed,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from a saved state.

        The dataset size, `shuffle` and `seed` must match the saved ones, or the order would not be
        the one the run was following (ValueError naming what changed). `batch_size` may differ: the
        stream is defined per index, so a new batch size continues from the same position.
        """
        missing = {"consumed", "num_examples", "shuffle", "seed"} - set(state)
        if missing:
            raise ValueError(f"sampler state lacks {sorted(missing)}; it was not written by PromptSampler.state_dict")
        if state.get("version", _STATE_VERSION) != _STATE_VERSION:
            raise ValueError(f"sampler state version {state['version']} is not supported (expected {_STATE_VERSION})")
        mismatches = []
        if int(state["num_examples"]) != self.num_examples:
            mismatches.append(
                f"the dataset has {self.num_examples} prompts but the checkpoint's had {state['num_examples']} "
                "(did data.train_files, rollout.max_prompt_length or data.overlong_prompts change?)"
            )
        if bool(state["shuffle"]) != self.shuffle:
            mismatches.append(f"data.shuffle is {self.shuffle} but was {state['shuffle']}")
        if int(state["seed"]) != self.seed:
            mismatches.append(f"data.seed is {self.seed} but was {state['seed']}")
        if mismatches:
            raise ConfigError(
                "cannot resume the prompt order of the checkpoint: " + "; ".join(mismatches) + ". To resume, set "
                "them back to the values the checkpoint was written with (its metadata.json records them under "
                "'config'); to start a new run with the new values, run without --resume in a new trainer.output_dir"
            )
        consumed = int(state["consumed"])
        if consumed < 0:
            raise ValueError(f"sampler state has consumed={consumed} < 0")
        self._consumed = consumed

    def __repr__(self) -> str:
        return (
            f"PromptSampler(num_examples={self.num_examples}, batch_size={self.batch_size}, shuffle={self.shuffle}, "
            f"seed={self.seed}, epoch={self.epoch}, consumed={self.consumed})"
        )


def shard_for_rank(items: Sequence[T], rank: int, world: int, *, even: bool = True) -> list[T]:
    """Rank `rank`'s contiguous share of `items` among `world` ranks: the one sharding rule of prompts.

    Rank r gets ``items[r * len // world : (r + 1) * len // world]``: shares differ in size by at
    most one, and concatenating the shares of ranks 0..world-1 gives back `items`. When `world`
    divides the length, rank r gets ``items[r * k : (r + 1) * k]`` with ``k = len(items) // world``.

    `even` (training batches: every data-parallel rank must hold the same number of samples): raise
    ValueError when the split is not even. A validation set has whatever size it has: ``even=False``.
    """
    if world < 1:
        raise ValueError(f"world size must be >= 1, got {world}")
    if not 0 <= rank < world:
        raise ValueError(f"rank {rank} is outside 0..{world - 1}")
    if even and len(items) % world:
        raise ValueError(
            f"cannot split {len(items)} items evenly over {world} data-parallel ranks; "
            f"use a batch size that is a multiple of {world}"
        )
    return list(items[rank * len(items) // world : (rank + 1) * len(items) // world])
