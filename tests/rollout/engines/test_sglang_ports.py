"""Pure decisions of the SGLang adapter about where its engine meets the rest of the node: the device
weight buckets are handed over on (never the host on a GPU, issue 26 item 6) and the engine's own
`port` / `nccl_port` (engines started at once on one node never pick the same, item 8). The real
engines starting at once: test_sglang_parallel_start.py."""

from __future__ import annotations

import socket

import pytest
import torch

from megatron_dapo.rollout.engines.sglang.engine import (
    NODE_SLOTS,
    SGLANG_BASE_PORT,
    engine_ports,
    handover_device,
    node_slot,
    port_is_free,
)


def test_buckets_stay_on_the_gpu_on_cuda():
    assert handover_device("cuda", 3) == torch.device("cuda", 3)
    assert handover_device("cuda", None) == torch.device("cuda")  # the current GPU when the bucket moves
    assert handover_device("cpu", None) == torch.device("cpu")
    assert handover_device("cpu", 0) == torch.device("cpu")  # a CPU engine on a GPU machine
    with pytest.raises(ValueError, match="'cuda' or 'cpu'"):
        handover_device("xpu", 0)


def test_node_slot_comes_from_the_launcher():
    assert node_slot({"LOCAL_RANK": "5", "SLURM_LOCALID": "2"}) == 5  # init_distributed sets LOCAL_RANK for every launch
    assert node_slot({"SLURM_LOCALID": "2"}) == 2
    assert node_slot({}) is None and node_slot({"LOCAL_RANK": ""}) is None


def test_engines_of_one_node_get_disjoint_ports():
    always = lambda port: True  # noqa: E731
    pairs = [engine_ports(slot, is_free=always) for slot in range(NODE_SLOTS)]
    ports = [port for pair in pairs for port in pair]
    assert len(set(ports)) == len(ports) == 2 * NODE_SLOTS
    assert pairs[0] == (SGLANG_BASE_PORT, SGLANG_BASE_PORT + 1) and pairs[3] == (SGLANG_BASE_PORT + 6, SGLANG_BASE_PORT + 7)
    assert max(ports) < 22000  # below SGLang's own random pick (22000-29999) and the ephemeral range
    assert engine_ports(2, base_port=40000, is_free=always) == (40004, 40005)


def test_a_busy_port_moves_the_engine_to_its_next_pair_only():
    busy = {SGLANG_BASE_PORT + 1}  # slot 0's nccl_port is taken by someone else
    first = engine_ports(0, is_free=lambda port: port not in busy)
    assert first == (SGLANG_BASE_PORT + 2 * NODE_SLOTS, SGLANG_BASE_PORT + 2 * NODE_SLOTS + 1)
    # No other slot's candidates are ever tried by slot 0: starting together, they cannot meet.
    tried: dict[int, list[int]] = {}
    for slot in range(NODE_SLOTS):
        seen: list[int] = []
        with pytest.raises(RuntimeError, match=f"node slot {slot}"):
            engine_ports(slot, is_free=lambda port: seen.append(port) or False)
        tried[slot] = seen
    everything = [port for seen in tried.values() for port in seen]
    assert len(everything) == len(set(everything))
    with pytest.raises(ValueError, match="base_port"):
        engine_ports(0, base_port=65000)
    with pytest.raises(ValueError, match=">= 0"):
        engine_ports(-1)


def test_port_is_free_sees_a_listener():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(1)
        port = listener.getsockname()[1]
        assert not port_is_free(port)
    assert port_is_free(port)
