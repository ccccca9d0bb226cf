"""grpo_advantages / token_advantages against an independent per-group numpy reference."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from megatron_dapo.algorithm.advantage import grpo_advantages, index_groups, token_advantages


def reference_advantages(scores, ids, norm_by_std=True, eps=1e-6):
    """Loop over groups with numpy (ddof=1 std), independent of the implementation."""
    scores = np.asarray(scores, dtype=np.float64)
    out = np.zeros_like(scores)
    for gid in dict.fromkeys(ids):
        members = [i for i, g in enumerate(ids) if g == gid]
        vals = scores[members]
        if len(vals) == 1 or np.all(vals == vals[0]):
            continue  # advantage 0
        centred = vals - vals.mean()
        out[members] = centred / (vals.std(ddof=1) + eps) if norm_by_std else centred
    return out


@pytest.mark.parametrize("norm_by_std", [True, False])
@pytest.mark.parametrize("id_kind", ["tensor", "strings"])
def test_matches_reference_on_random_non_contiguous_groups(norm_by_std, id_kind):
    rng = np.random.default_rng(0)
    ids = rng.integers(0, 12, size=100).tolist()  # shuffled: groups are not contiguous
    scores = rng.normal(size=100)
    scores[np.asarray(ids) == 3] = 0.7  # a constant group
    group_ids = torch.tensor(ids) if id_kind == "tensor" else [f"uid-{i}" for i in ids]
    got = grpo_advantages(torch.tensor(scores), group_ids, norm_by_std=norm_by_std)
    want = reference_advantages(scores, ids, norm_by_std=norm_by_std)
    assert got.dtype == torch.float64
    np.testing.assert_allclose(got.numpy(), want, rtol=1e-12, atol=1e-12)


def test_bessel_corrected_std_on_a_hand_example():
    # group scores [1, -1, -1, -1]: mean -0.5, unbiased var = (2.25 + 3 * 0.25) / 3 = 1
    adv = grpo_advantages(torch.tensor([1.0, -1.0, -1.0, -1.0], dtype=torch.float64), [0, 0, 0, 0], eps=0.0)
    torch.testing.assert_close(adv, torch.tensor([1.5, -0.5, -0.5, -0.5], dtype=torch.float64))


def test_eps_is_added_to_std():
    adv = grpo_advantages(torch.tensor([1.0, -1.0], dtype=torch.float64), ["a", "a"], eps=0.5)
    std = np.sqrt(2.0)
    torch.testing.assert_close(adv, torch.tensor([1 / (std + 0.5), -1 / (std + 0.5)], dtype=torch.float64))


def test_degenerate_groups_give_exact_zeros_without_nan():
    # 0.1 three times: the float mean need not be exactly 0.1, so a naive (x - mean) / (std + eps)
    # can return ~1e-11 instead of 0; a single-sample group must not divide by an undefined std.
    scores = torch.tensor([0.1, 0.1, 0.1, 5.0, 1.0, 0.0], dtype=torch.float32)
    ids = torch.tensor([7, 7, 7, 8, 9, 9])
    for norm in (True, False):
        adv = grpo_advantages(scores, ids, norm_by_std=norm)
        assert adv.dtype == torch.float32
        assert torch.isfinite(adv).all()
        assert adv[:4].eq(0).all(), adv
        assert adv[4] > 0 > adv[5]


def test_dr_grpo_is_mean_centred_only():
    adv = grpo_advantages(torch.tensor([3.0, 1.0, 2.0]), ["p", "p", "q"], norm_by_std=False)
    torch.testing.assert_close(adv, torch.tensor([1.0, -1.0, 0.0]))


def test_empty_input():
    assert grpo_advantages(torch.zeros(0), torch.zeros(0, dtype=torch.long)).numel() == 0


def test_rejects_bad_inputs():
    with pytest.raises(ValueError, match="group ids"):
        grpo_advantages(torch.zeros(3), [0, 0])
    with pytest.raises(ValueError, match="non-finite"):
        grpo_advantages(torch.tensor([0.0, float("nan")]), [0, 0])
    with pytest.raises(ValueError, match="1-D float"):
        grpo_advantages(torch.zeros(2, 2), [0, 1])
    with pytest.raises(TypeError):
        grpo_advantages(torch.zeros(2), torch.tensor([0.0, 1.0]))


def test_index_groups_numbers_groups_by_first_appearance_for_both_id_kinds():
    inv_t, ids_t = index_groups(torch.tensor([30, 10, 30, 20, 10]))
    inv_l, ids_l = index_groups(["c", "a", "c", "b", "a"])
    assert inv_t.tolist() == inv_l.tolist() == [0, 1, 0, 2, 1]
    assert ids_t == [30, 10, 20] and ids_l == ["c", "a", "b"]


def test_token_advantages_broadcasts_under_the_mask():
    mask = torch.tensor([[1, 1, 0], [0, 0, 0], [1, 0, 0]])
    got = token_advantages(torch.tensor([2.0, -1.0, float("nan")]), mask)
    want = torch.tensor([[2.0, 2.0, 0.0], [0.0, 0.0, 0.0], [float("nan"), 0.0, 0.0]])
    torch.testing.assert_close(got, want, equal_nan=True)
    with pytest.raises(ValueError):
        token_advantages(torch.zeros(2), mask)
