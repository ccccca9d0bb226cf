"""Launch-environment parsing: SLURM hostlists, torchrun / SLURM / single-process detection."""

from __future__ import annotations

import pytest

from megatron_dapo.distributed.launch import parse_slurm_hostlist, resolve_launch_env, slurm_master_port


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
    assert launch.master_port == 15000 + 123456 % 20000
    assert 1024 < launch.master_port < 65536


def test_slurm_port_and_address_overrides():
    env = {"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_NODELIST": "x[1-2]", "MASTER_PORT": "40000", "MASTER_ADDR": "ib-x1"}
    launch = resolve_launch_env(env)
    assert (launch.master_addr, launch.master_port) == ("ib-x1", 40000)
    assert slurm_master_port({"SLURM_JOB_ID": "7"}) == slurm_master_port({"SLURM_JOB_ID": "7"}) == 15007


def test_slurm_without_port_source_is_an_error():
    with pytest.raises(ValueError, match="MASTER_PORT"):
        resolve_launch_env({"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_JOB_NODELIST": "n1"})


def test_single_process_when_nothing_is_set():
    launch = resolve_launch_env({}, free_port=31337)
    assert (launch.rank, launch.world_size, launch.local_rank, launch.source) == (0, 1, 0, "single")
    assert (launch.master_addr, launch.master_port) == ("127.0.0.1", 31337)
    assert resolve_launch_env({}).master_port > 0  # a free port is found when none is given
