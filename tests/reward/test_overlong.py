"""overlong_penalty against DAPO eq. 13 written as a plain per-element python function."""

from __future__ import annotations

import pytest
import torch

from megatron_dapo.reward.overlong import overlong_loss_mask, overlong_penalty


def eq13(length: int, max_len: int, buffer: int, factor: float) -> float:
    """DAPO paper eq. 13 times the penalty factor, case by case."""
    if length <= max_len - buffer:
        return 0.0
    if length <= max_len:
        return ((max_len - buffer) - length) / buffer * factor
    return -factor


@pytest.mark.parametrize(
    "max_len, buffer, factor", [(20, 4, 1.0), (20, 20, 0.5), (4096, 1024, 1.0), (7, 1, 2.0), (20, 3, 1.0)]
)
def test_matches_eq13_for_every_length(max_len, buffer, factor):
    lengths = list(range(0, max_len + 10))
    got = overlong_penalty(lengths, max_len, buffer, factor)
    want = torch.tensor([eq13(n, max_len, buffer, factor) for n in lengths], dtype=torch.float64)
    assert got.dtype == torch.float32 and got.shape == (len(lengths),)
    torch.testing.assert_close(got, want.to(torch.float32), rtol=0, atol=0)


def test_hand_values():
    # max 20, buffer 4: free up to 16, then -0.25 per token, -1 from 20 on.
    got = overlong_penalty([0, 16, 17, 18, 19, 20, 21, 100], 20, 4, 1.0)
    assert got.tolist() == [0.0, 0.0, -0.25, -0.5, -0.75, -1.0, -1.0, -1.0]


def test_equals_verl_formula_within_the_limit():
    # verl: min(-(len - (max - buffer)) / buffer * factor, 0) for the lengths the engine can produce.
    max_len, buffer, factor = 1000, 300, 0.7
    lengths = torch.arange(0, max_len + 1)
    got = overlong_penalty(lengths, max_len, buffer, factor, dtype=torch.float64)
    want = [min(-(n - (max_len - buffer)) / buffer * factor, 0.0) for n in range(max_len + 1)]
    assert got.tolist() == want


def test_tensor_and_list_inputs_agree_and_keep_device():
    lengths = [3, 18, 25]
    from_list = overlong_penalty(lengths, 20, 4, 1.0)
    for dtype in (torch.int64, torch.int32, torch.int16):
        from_tensor = overlong_penalty(torch.tensor(lengths, dtype=dtype), 20, 4, 1.0)
        assert torch.equal(from_tensor, from_list)
    assert overlong_penalty(torch.tensor(lengths), 20, 4, 1.0).device == torch.device("cpu")


def test_zero_buffer_or_zero_factor_disables():
    assert overlong_penalty([0, 19, 20, 30], 20, 0, 1.0).tolist() == [0.0] * 4
    assert overlong_penalty([0, 19, 20, 30], 20, 4, 0.0).tolist() == [0.0] * 4


def test_empty_input():
    out = overlong_penalty([], 20, 4, 1.0)
    assert out.shape == (0,) and out.dtype == torch.float32


@pytest.mark.parametrize(
    "args, key",
    [
        ((20, 21, 1.0), "algorithm.overlong_buffer.len"),
        ((20, -1, 1.0), "algorithm.overlong_buffer.len"),
        ((20, 4, -0.1), "algorithm.overlong_buffer.penalty_factor"),
        ((20, 4, float("nan")), "algorithm.overlong_buffer.penalty_factor"),
        ((0, 0, 1.0), "rollout.max_response_length"),
    ],
)
def test_bad_settings_name_the_config_key(args, key):
    with pytest.raises(ValueError, match=key.replace(".", r"\.")):
        overlong_penalty([1, 2], *args)


def test_buffer_longer_than_max_names_both_keys():
    with pytest.raises(ValueError) as info:
        overlong_penalty([1], 10, 11, 1.0)
    assert "algorithm.overlong_buffer.len" in str(info.value) and "rollout.max_response_length" in str(info.value)


@pytest.mark.parametrize(
    "lengths", [torch.tensor([1.0, 2.0]), torch.tensor([[1, 2]]), torch.tensor([True, False]), [3, -1]]
)
def test_bad_lengths(lengths):
    with pytest.raises(ValueError):
        overlong_penalty(lengths, 20, 4, 1.0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.int64, torch.bool])
def test_overlong_loss_mask_zeroes_truncated_rows(dtype):
    mask = torch.tensor([[1, 1, 0], [1, 1, 1], [1, 0, 0], [0, 0, 0]]).to(dtype)
    before = mask.clone()
    truncated = torch.tensor([False, True, False, True])
    out = overlong_loss_mask(truncated, mask)
    want = before.clone()
    want[1] = 0
    want[3] = 0
    assert out.dtype == dtype and torch.equal(out, want)
    assert torch.equal(mask, before)  # input untouched


def test_overlong_loss_mask_validates():
    with pytest.raises(ValueError, match="bool"):
        overlong_loss_mask(torch.tensor([0, 1]), torch.ones(2, 3))
    with pytest.raises(ValueError, match=r"\[B\]"):
        overlong_loss_mask(torch.tensor([True]), torch.ones(2, 3))
    with pytest.raises(ValueError):
        overlong_loss_mask(torch.tensor([True, False]), torch.ones(2))
