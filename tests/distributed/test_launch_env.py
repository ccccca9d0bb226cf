"""Launch-environment parsing: SLURM hostlists, torchrun / SLURM / single-process detection."""

from __future__ import annotations

import random
import socket

import pytest

from megatron_dapo.distributed.launch import (
    LINUX_DEFAULT_EPHEMERAL_RANGE,
    LISTEN_PORT_FLOOR,
    PORT_DRAWS,
    ephemeral_port_range,
    find_free_port,
    parse_slurm_hostlist,
    resolve_launch_env,
    slurm_master_port,
)


@pytest.mark.parametrize(
    "hostlist,expected",
    [
        ("gpu[01-03,07],cpu5", ["gpu01", "gpu02", "gpu03", "gpu07", "cpu5"]),
        ("node1", ["node1"]),
        ("a,b,c", ["a", "b", "c"]),
        ("n[8-11]", ["n8", "n9", "n10", "n11"]),
        ("n[098-101]", ["n098", "n099", "n100", "n101"]),
        ("rack[1-2]-gpu[1,3]", ["rack1-gpu1", "rack1-gpu3", "rack2-gpu1", "rack2-gpu3"]),
        ("dgx-[004-005].cluster", ["dgx-004.cluster", "dgx-005.cluster"]),
        (" gpu[1-2] , login ", ["gpu1", "gpu2", "login"]),
    ],
)
def test_parse_slurm_hostlist(hostlist, expected):
    assert parse_slurm_hostlist(hostlist) == expected


@pytest.mark.parametrize("bad", ["", "gpu[01-03", "gpu01]", "gpu[3-1]", "gpu[a-b]", "gpu[]", "gpu[1,,2]"])
def test_parse_slurm_hostlist_rejects_malformed(bad):
    with pytest.raises(ValueError):
        parse_slurm_hostlist(bad)


def test_torchrun_environment():
    env = {"RANK": "3", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "MASTER_ADDR": "host0", "MASTER_PORT": "29500"}
    launch = resolve_launch_env(env)
    assert (launch.rank, launch.world_size, launch.local_rank) == (3, 8, 1)
    assert (launch.master_addr, launch.master_port, launch.source) == ("host0", 29500, "torchrun")


def test_torchrun_variables_win_over_slurm():
    env = {"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "a", "MASTER_PORT": "1", "SLURM_PROCID": "7", "SLURM_NTASKS": "16"}
    assert resolve_launch_env(env).source == "torchrun"


def test_torchrun_without_master_is_an_error():
    with pytest.raises(ValueError, match="MASTER_ADDR"):
        resolve_launch_env({"RANK": "0", "WORLD_SIZE": "2", "MASTER_PORT": "1"})


def test_slurm_environment_takes_first_host_and_job_port():
    env = {
        "SLURM_PROCID": "5",
        "SLURM_NTASKS": "16",
        "SLURM_LOCALID": "1",
        "SLURM_JOB_NODELIST": "gpu[07-08,10]",
        "SLURM_JOB_ID": "123456",
    }
    launch = resolve_launch_env(env)
    assert (launch.rank, launch.world_size, launch.local_rank, launch.source) == (5, 16, 1, "slurm")
    assert launch.master_addr == "gpu07"
    assert launch.master_port == 22000 + 123456 % 10000
    assert 1024 < launch.master_port < 65536


def test_slurm_port_and_address_overrides():
    env = {"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_NODELIST": "x[1-2]", "MASTER_PORT": "40000", "MASTER_ADDR": "ib-x1"}
    launch = resolve_launch_env(env)
    assert (launch.master_addr, launch.master_port) == ("ib-x1", 40000)
    assert slurm_master_port({"SLURM_JOB_ID": "7"}) == slurm_master_port({"SLURM_JOB_ID": "7"}) == 22007


def test_every_slurm_job_port_lies_below_the_ephemeral_range():
    ports = {slurm_master_port({"SLURM_JOB_ID": str(job_id)}) for job_id in range(0, 100_000, 7)}
    assert min(ports) == LISTEN_PORT_FLOOR
    assert max(ports) < LINUX_DEFAULT_EPHEMERAL_RANGE[0]
    assert len(ports) == 10_000  # every port of the span is some job's: 10,000 jobs in a row get distinct ones


def test_slurm_without_port_source_is_an_error():
    with pytest.raises(ValueError, match="MASTER_PORT"):
        resolve_launch_env({"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_JOB_NODELIST": "n1"})


def test_single_process_when_nothing_is_set():
    launch = resolve_launch_env({}, free_port=31337)
    assert (launch.rank, launch.world_size, launch.local_rank, launch.source) == (0, 1, 0, "single")
    assert (launch.master_addr, launch.master_port) == ("127.0.0.1", 31337)
    assert resolve_launch_env({}).master_port > 0  # a free port is found when none is given


def test_a_rendezvous_port_is_drawn_below_the_ephemeral_range_and_skips_taken_ones():
    """The port must not be one the kernel can hand to an outgoing connection before the launcher
    binds it (CI: torchrun's EADDRINUSE on an OS-picked port), and one that is taken is passed over."""
    taken = set(range(LISTEN_PORT_FLOOR, 30000))
    rng = random.Random(0)
    ports = [find_free_port(rng=rng, is_free=lambda host, port: port not in taken, ephemeral=(32768, 60999)) for _ in range(50)]
    assert all(30000 <= port < 32768 for port in ports)
    assert len(set(ports)) > 40  # drawn at random, so two launchers starting together rarely meet


def test_a_port_found_on_this_machine_can_be_listened_on():
    low, _ = ephemeral_port_range()
    port = find_free_port()
    if low - LISTEN_PORT_FLOOR >= PORT_DRAWS:  # the range leaves room below it (Linux's default does)
        assert LISTEN_PORT_FLOOR <= port < low
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", port))


def test_without_room_below_the_ephemeral_range_the_os_picks():
    asked = []
    port = find_free_port(is_free=lambda host, port: asked.append(port) or True, ephemeral=(1024, 65535))
    assert asked == [] and port > 0
    assert find_free_port(is_free=lambda host, port: False, ephemeral=(32768, 60999)) > 0  # every draw taken: OS's pick


def test_the_ephemeral_range_is_read_from_the_kernel_or_defaults(tmp_path):
    (tmp_path / "range").write_text("40000\t50000\n")
    assert ephemeral_port_range(str(tmp_path / "range")) == (40000, 50000)
    assert ephemeral_port_range(str(tmp_path / "missing")) == (32768, 60999)
