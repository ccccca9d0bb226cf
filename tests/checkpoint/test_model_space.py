"""The `fully_sharded_model_space` optimizer format's geometry (`checkpoint/model_space.py`), in one process.

- `flat_range_boxes`: for every flat range of small tensors of 0 to 4 dimensions, the boxes are in
  flat order, each one contiguous run of the range (so a view of the rank's flat shard), together
  exactly the range, at most 2 n - 1 of them.
- A gated MLP's fc1 (Megatron's swiglu `ShardedTensorFactory`, TP rank 1 of 2, under a stacked-layer
  axis): the boxes three DP ranks write of a flat state tensor, placed at their global offsets,
  rebuild exactly the tensors the model's own factory writes for the same data (the `_w` and `_v`
  halves land in their halves of the global tensor), each element written once.

The resume tests (test_checkpoint_resume.py) run the format through Megatron's save and load.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from megatron_dapo.checkpoint.model_space import _boxes_of, _sub_tensors, flat_range_boxes


@pytest.mark.parametrize("shape", [(), (7,), (3, 4), (2, 3, 4), (1, 5, 1, 3), (2, 1, 3, 2)])
def test_flat_range_boxes_cover_each_range_exactly_once(shape):
    numel = math.prod(shape)
    index = torch.arange(numel).view(shape)
    for start, stop in itertools.combinations_with_replacement(range(numel + 1), 2):
        boxes = flat_range_boxes(start, stop, shape)
        assert len(boxes) <= max(1, 2 * len(shape) - 1), (shape, start, stop, boxes)
        runs = []
        for box_start, offset, size in boxes:
            assert len(offset) == len(size) == len(shape) and all(s > 0 for s in size)
            region = index[tuple(slice(o, o + s) for o, s in zip(offset, size))].reshape(-1)
            assert torch.equal(region, torch.arange(box_start, box_start + region.numel())), (shape, start, stop, boxes)
            runs.append(region)
        covered = torch.cat(runs) if runs else torch.zeros(0, dtype=torch.long)
        assert torch.equal(covered, torch.arange(start, stop)), (shape, start, stop, boxes)
    with pytest.raises(ValueError):
        flat_range_boxes(0, numel + 1, shape)


def _place(tensors, global_shape) -> tuple[torch.Tensor, torch.Tensor]:
    """Write ShardedTensors (no prepended axes) into a global tensor; also count writes per element."""
    out, writes = torch.full(global_shape, float("nan")), torch.zeros(global_shape, dtype=torch.long)
    for t in tensors:
        region = tuple(slice(o, o + s) for o, s in zip(t.global_offset, t.local_shape))
        out[region] = t.data.reshape(t.local_shape)
        writes[region] += 1
    return out, writes


def test_gated_fc1_boxes_rebuild_what_the_model_factory_writes():
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor
    from megatron.core.transformer.mlp import apply_swiglu_sharded_factory

    layers, layer, tp, tp_rank = 3, 1, 2, 1
    local = torch.arange(2 * 4 * 6, dtype=torch.float32).view(8, 6) + 1000 * layer  # (2 x ffn / TP, hidden)
    offsets = ((0, layer, layers),)  # the stacked-layer axis, prepended
    model = ShardedTensor.from_rank_offsets("fc1", local, *offsets, (1, tp_rank, tp), replica_id=(0, 0, 0), prepend_axis_num=1)
    factory = apply_swiglu_sharded_factory(model, offsets)
    written = [t for t in nested_values(factory.build())]
    global_shape = tuple(written[0].global_shape)
    assert global_shape == (layers, 8 * tp, 6)
    expected = torch.full(global_shape, float("nan"))
    for t in written:  # the model's own sharding of the same data: two halves, one prepended axis
        region = (t.global_offset[0],) + tuple(slice(o, o + s) for o, s in zip(t.global_offset[1:], t.local_shape))
        expected[region] = t.data

    ranges = [(0, 13), (13, 29), (29, 48)]  # three DP ranks' flat ranges, across rows and the halves
    boxes = []
    for start, stop in ranges:
        subs = _sub_tensors(factory, "optimizer.state.exp_avg.fc1", (0, 0, 0))
        boxes += _boxes_of(subs, start, stop, local.reshape(-1)[start:stop])
    assert {b.key for b in boxes} == {"optimizer.state.exp_avg.fc1"}
    assert all(b.axis_fragmentations is None and b.prepend_axis_num == 0 for b in boxes)
    got, writes = _place(boxes, global_shape)
    mine = ~expected.isnan()  # this TP rank's rows of both halves, in this layer
    assert int(mine.sum()) == local.numel() and bool(mine[layer, 4:8].all()) and bool(mine[layer, 12:16].all())
    assert torch.equal(writes, mine.long())  # each of them written once, nothing else
    assert torch.equal(got[mine], expected[mine])
