"""Which experts travel together when the weight export moves them between ranks. Pure.

Under expert parallelism (and to other pipeline stages) an expert's HF tensors exist on one rank
only and must be sent to the others. One collective per tensor costs its fixed latency thousands
of times per sync (Qwen3-30B-A3B: 48 layers x 128 experts x 3 tensors); the bytes are not the
cost. So the export packs consecutive experts held by the same rank into one flat buffer and moves
the buffer in one collective (`model.load.export_megatron_to_hf`). The groups are cut here:

* by source: a buffer has one sender (the expert-parallel rank holding the experts) and one dtype;
* by bytes: a buffer holds at most `expert_group_limit(bucket)`, half a weight-sync bucket. The
  export yields views of the buffer, so a bucket still holding the last tensors of one group keeps
  that whole buffer alive while the next group is filled: at most half a bucket of delivered bytes
  plus half a bucket being filled, i.e. the export holds no more than one bucket beyond the bucket
  the consumer is filling, whatever the layer's size. A single tensor larger than the limit forms a
  group of its own (a bucket takes a tensor larger than itself alone, too).

Items are taken in the mapping table's order and never reordered, so every rank yields the same
(name, tensor) sequence as one collective per tensor would.
"""

from __future__ import annotations

from typing import Hashable, Sequence

__all__ = ["expert_group_limit", "plan_expert_groups"]


def expert_group_limit(bucket_bytes: int) -> int:
    """Most bytes one expert exchange packs for a weight stream cut into buckets of `bucket_bytes`
    (half of it: see the module doc); at least 1."""
    if bucket_bytes < 1:
        raise ValueError(f"bucket size must be at least 1 byte, got {bucket_bytes}")
    return max(1, bucket_bytes // 2)


def plan_expert_groups(sources: Sequence[Hashable], nbytes: Sequence[int], limit_bytes: int) -> list[range]:
    """Consecutive runs of items (indices into `sources`/`nbytes`) that travel as one buffer.

    `sources[i]`: what must be equal for items to share a buffer (the sending rank and the dtype);
    `nbytes[i]`: the item's bytes (all HF tensors of one mapping row). A run never mixes sources and
    holds at most `limit_bytes`, unless it is one item larger than that. The runs cover every item,
    in order. Every rank computes the same runs from the same shapes, so the collectives match.
    """
    if len(sources) != len(nbytes):
        raise ValueError(f"{len(sources)} sources but {len(nbytes)} sizes")
    if limit_bytes < 1:
        raise ValueError(f"expert group limit must be at least 1 byte, got {limit_bytes}")
    groups: list[range] = []
    start, size = 0, 0
    for index, (source, item_bytes) in enumerate(zip(sources, nbytes)):
        if item_bytes < 0:
            raise ValueError(f"item {index} has a negative size {item_bytes}")
        if index > start and (source != sources[start] or size + item_bytes > limit_bytes):
            groups.append(range(start, index))
            start, size = index, 0
        size += item_bytes
    if len(sources) > start:
        groups.append(range(start, len(sources)))
    return groups
