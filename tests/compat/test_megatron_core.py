"""compat/megatron_core.py: each version difference, for the releases on both sides, and against the
installed Megatron-Core's own loader (CI runs this file on 0.16.1 and 0.19.2)."""

from __future__ import annotations

import io

import pytest
import torch
from megatron.core.dist_checkpointing.core import CheckpointingConfig, save_config

from megatron_dapo.checkpoint.streaming import write_streaming
from megatron_dapo.compat.megatron_core import (
    COMMON_STATE_FILE,
    common_state_in_checkpoint,
    installed_release,
    store_common_state,
)


def test_which_releases_keep_the_common_state_in_the_checkpoint():
    assert not common_state_in_checkpoint((0, 16, 1))
    assert not common_state_in_checkpoint((0, 18, 2))
    assert common_state_in_checkpoint((0, 19, 0)) and common_state_in_checkpoint((0, 19, 2))


def test_before_0_19_the_common_state_is_a_file(tmp_path):
    dcp_state: dict = {}
    store_common_state({"step": 3}, tmp_path, dcp_state, release=(0, 16, 1))
    assert dcp_state == {}
    assert torch.load(tmp_path / COMMON_STATE_FILE, weights_only=True) == {"step": 3}


def test_from_0_19_the_common_state_is_a_dcp_object(tmp_path):
    dcp_state: dict = {}
    store_common_state({"step": 3}, tmp_path, dcp_state, release=(0, 19, 2))
    assert not (tmp_path / COMMON_STATE_FILE).exists()
    (key, buffer), = dcp_state.items()
    assert key == "common_state/shard_0_1"  # ShardedObject("common_state", None, (1,), (0,)).unique_key
    assert torch.load(io.BytesIO(buffer.getvalue()), weights_only=True) == [{"step": 3}]


def test_the_installed_megatron_core_reads_what_we_store(tmp_path):
    """Written as conversion writes a checkpoint (DCP files + Megatron's marker), read back by the
    installed release's own loader."""
    from megatron.core.dist_checkpointing.serialization import load_common_state_dict

    common = {"scheduler": {"num_steps": 7}, "note": "converted"}
    weight = io.BytesIO()
    torch.save([torch.arange(4.0)], weight)  # one more object, as conversion stores `_extra_state`
    weight.seek(0)
    dcp_state = {"decoder.layers.0._extra_state/shard_0_1": weight}
    store_common_state(common, tmp_path, dcp_state)
    write_streaming(dcp_state, tmp_path)
    save_config(CheckpointingConfig("torch_dist", 1), str(tmp_path))
    assert (tmp_path / COMMON_STATE_FILE).exists() != common_state_in_checkpoint()
    assert load_common_state_dict(str(tmp_path)) == common


def test_installed_release_is_the_package_version():
    from megatron.core.package_info import __version__

    assert installed_release()[:2] == tuple(int(part) for part in __version__.split(".")[:2])


@pytest.mark.parametrize("release", [(0, 16, 1), (0, 19, 2)])
def test_store_does_not_touch_other_entries(tmp_path, release):
    dcp_state = {"other": io.BytesIO(b"x")}
    store_common_state({}, tmp_path, dcp_state, release=release)
    assert dcp_state["other"].getvalue() == b"x"
