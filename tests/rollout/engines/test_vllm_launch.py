"""How engines start (`vllm_launch`, `group.make_engine`): environments, devices, shared-memory names.

Pure functions, checked against the code of the installed vLLM 0.32 where they rely on it (how a
CUDA worker maps its local rank through CUDA_VISIBLE_DEVICES, how the CPU communicator names its
/dev/shm segments, what the external launcher hands its worker), against SGLang 0.5.23's server
arguments (not installable here: its field list is recorded below), and one real leader-placement
vLLM engine whose spawned processes must carry the environment the trainer chose.
"""

from __future__ import annotations

import os
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from megatron_dapo.config import Config
from megatron_dapo.rollout import group
from megatron_dapo.rollout.engines.vllm import launch as vllm_launch
from megatron_dapo.distributed.placement import EngineDevices
from megatron_dapo.rollout.engines.vllm.launch import (
    leader_environment,
    own_shared_memory_segments,
    remove_own_shared_memory_segments,
    shared_memory_init_method,
    spmd_environment,
    unique_shared_memory_names,
)
from tests.support.tiny_models import save_tiny_model


def test_spmd_sets_what_the_external_launcher_needs():
    assert spmd_environment(rank=5, local_device=1) == {"RANK": "5", "LOCAL_RANK": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    with pytest.raises(ValueError, match=">= 0"):
        spmd_environment(-1, 0)


def test_the_external_launcher_reads_these_variables():
    """vLLM 0.32: the executor reads RANK / LOCAL_RANK and refuses a multiprocessing engine core."""
    import inspect

    from vllm.v1.executor.uniproc_executor import ExecutorWithExternalLauncher

    source = inspect.getsource(ExecutorWithExternalLauncher)
    assert 'os.environ["RANK"]' in source and 'os.environ["LOCAL_RANK"]' in source
    assert "assert not envs.VLLM_ENABLE_V1_MULTIPROCESSING" in source


def test_leader_environment():
    spawned = {"VLLM_ENABLE_V1_MULTIPROCESSING": "1", "VLLM_WORKER_MULTIPROC_METHOD": "spawn"}
    assert leader_environment() == spawned
    assert leader_environment("4,5") == {**spawned, "CUDA_VISIBLE_DEVICES": "4,5"}
    with pytest.raises(ValueError, match="at least one GPU"):
        leader_environment("")


def test_vllm_opens_tp_rank_i_on_the_i_th_listed_gpu(monkeypatch):
    """vLLM's CUDA worker opens cuda:logical_device_id_to_visible_device_id(local_rank), its CUDA
    platform's device-control variable is CUDA_VISIBLE_DEVICES, and a worker process that sees
    "4,5" maps TP rank 1 to its visible device 1 (physical GPU 5)."""
    import inspect

    import vllm
    from vllm.platforms.interface import Platform
    from vllm.v1.worker import gpu_worker

    assert "logical_device_id_to_visible_device_id(self.local_rank)" in inspect.getsource(gpu_worker.Worker.init_device)
    cuda_platform = (Path(vllm.__file__).parent / "platforms" / "cuda.py").read_text()  # needs CUDA libraries to import
    assert 'device_control_env_var: str = "CUDA_VISIBLE_DEVICES"' in cuda_platform

    class Cuda(Platform):
        device_control_env_var = "CUDA_VISIBLE_DEVICES"

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5")
    assert [Cuda.device_id_to_physical_device_id(i) for i in (0, 1)] == [4, 5]
    assert [Cuda.logical_device_id_to_visible_device_id(i) for i in (0, 1)] == [0, 1]


# ---- shared-memory names ------------------------------------------------------------------------


def vllm_segment_names(prefix: str, unique_name: str, ranks: list[int]) -> list[str]:
    """The /dev/shm names vLLM's CPU communicator creates for one group: its own `make_group_name`
    plus the per-rank suffix of `csrc/cpu/shm.cpp` (`name + "_" + rank`)."""
    from vllm.distributed.device_communicators.cpu_communicator import _CPUSHMDistributed

    saved = os.environ.get("VLLM_DIST_IDENT")
    os.environ["VLLM_DIST_IDENT"] = prefix
    try:
        group_name = _CPUSHMDistributed.make_group_name(SimpleNamespace(unique_name=unique_name, ranks=ranks))
    finally:
        if saved is None:
            del os.environ["VLLM_DIST_IDENT"]
        else:
            os.environ["VLLM_DIST_IDENT"] = saved
    return [f"{group_name}_{index}" for index in range(len(ranks))]


def test_the_init_method_becomes_the_segment_prefix():
    """vLLM 0.32's CPU worker names its segments after the init method: a file:// path's base name."""
    import inspect

    from vllm.v1.worker.cpu_worker import CPUWorker

    source = inspect.getsource(CPUWorker.init_device)
    assert 'os.environ["VLLM_DIST_IDENT"]' in source and 'os.path.basename(init_method.removeprefix("file://"))' in source
    method = shared_memory_init_method("mdapo_spmd_0123abcd")
    assert method.startswith("file://") and os.path.basename(method.removeprefix("file://")) == "mdapo_spmd_0123abcd"
    with pytest.raises(ValueError, match="letters, digits"):
        shared_memory_init_method("a/b")
    # Without it, every job's prefix is the same: "env://" -> "//".
    assert "env://".split(":")[-1] == "//"


def test_the_external_launcher_hands_the_unique_init_method_while_the_engine_starts(monkeypatch):
    from vllm.v1.executor.uniproc_executor import ExecutorWithExternalLauncher

    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.delenv("VLLM_DIST_IDENT", raising=False)
    assert ExecutorWithExternalLauncher._distributed_args(None) == ("env://", 3, 1)
    with unique_shared_memory_names("mdapo_spmd_feed") as seen:
        assert ExecutorWithExternalLauncher._distributed_args(None) == (shared_memory_init_method("mdapo_spmd_feed"), 3, 1)
        os.environ["VLLM_DIST_IDENT"] = "mdapo_spmd_feed"  # what vLLM's CPU worker does while starting
    assert seen["prefix"] == "mdapo_spmd_feed"
    assert ExecutorWithExternalLauncher._distributed_args(None) == ("env://", 3, 1)
    with unique_shared_memory_names(None) as seen:  # GPU: nothing changes
        assert ExecutorWithExternalLauncher._distributed_args(None) == ("env://", 3, 1)
    assert seen["prefix"] is None


def test_each_rank_removes_exactly_the_segments_it_created(tmp_path):
    token, other = "mdapo_spmd_aa11", "mdapo_spmd_bb22"
    names = [
        *vllm_segment_names(token, "tp:0", [0, 1]),
        *vllm_segment_names(token, "tp:0", [2, 3]),
        *vllm_segment_names(token, "pp:0", [1, 3]),
        *vllm_segment_names(other, "tp:0", [0, 1]),  # another job's engine
        "-tp:0-[0-1]-cpushm_0",  # the "//" prefix of an unpatched job, after shm_open drops the slashes
        "psm_1234",
    ]
    assert names[0] == "mdapo_spmd_aa11-tp:0-[0-1]-cpushm_0"
    assert own_shared_memory_segments(names, token, 1) == ["mdapo_spmd_aa11-pp:0-[1-3]-cpushm_0", "mdapo_spmd_aa11-tp:0-[0-1]-cpushm_1"]
    assert own_shared_memory_segments(names, token, 3) == ["mdapo_spmd_aa11-pp:0-[1-3]-cpushm_1", "mdapo_spmd_aa11-tp:0-[2-3]-cpushm_1"]
    assert own_shared_memory_segments(names, other, 0) == ["mdapo_spmd_bb22-tp:0-[0-1]-cpushm_0"]
    for name in names:
        (tmp_path / name).write_bytes(b"x")
    removed = remove_own_shared_memory_segments(token, 0, root=str(tmp_path))
    assert removed == ["mdapo_spmd_aa11-tp:0-[0-1]-cpushm_0"]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(set(names) - set(removed))
    assert remove_own_shared_memory_segments(None, 0, root=str(tmp_path)) == []


# ---- devices handed to the engines --------------------------------------------------------------


def _config(engine: str, hf_dir: str = "") -> Config:
    cfg = Config()
    cfg.model.hf_dir, cfg.model.dtype = hf_dir, "float32"
    cfg.rollout.engine, cfg.rollout.tp = engine, 2
    cfg.rollout.max_prompt_length, cfg.rollout.max_response_length = 32, 32
    return cfg


# SGLang 0.5.23 (pip download sglang==0.5.23): the flat keyword arguments `sglang.Engine(**kwargs)`
# turns into ServerArgs, and the namespace file that declares each (python/sglang/srt/arg_groups/
# fields/*.py). `Engine.__init__` builds `ServerArgs(**kwargs)` (entrypoints/engine.py), and
# `_launch_scheduler_processes` puts TP rank i on GPU base_gpu_id + i * gpu_id_step.
SGLANG_0_5_23_FIELDS = {
    "model_path": "model.py", "dtype": "model.py", "context_length": "model.py",
    "tp_size": "parallel.py", "mem_fraction_static": "schedule.py", "random_seed": "device.py",
    "base_gpu_id": "device.py", "gpu_id_step": "device.py", "enable_memory_saver": "exec_.py",
    "log_level": "observability.py",
}  # fmt: skip


def test_sglang_leaders_get_their_own_gpus(fake, tmp_path):
    """GPU-only (the engine's GPU ids): SGLang's Engine is the 0.5.23-shaped fake of the contract tests."""
    devices = EngineDevices(owner=4, ranks=(4, 5), node="node0", gpus=("4", "5"), indices=(4, 5))
    group.make_engine(_config("sglang", str(tmp_path)), tmp_path, torch.device("cuda"), devices=devices)
    ((name, kwargs),) = fake.calls
    assert name == "Engine" and (kwargs["base_gpu_id"], kwargs["gpu_id_step"]) == (4, 1)
    assert set(kwargs) <= set(SGLANG_0_5_23_FIELDS), set(kwargs) - set(SGLANG_0_5_23_FIELDS)
    fake.clear()
    group.make_engine(_config("sglang", str(tmp_path)), tmp_path, torch.device("cuda"))  # no GPUs known: SGLang's default
    assert "base_gpu_id" not in fake.calls[0][1]
    with pytest.raises(ValueError, match="gpu_id_step >= 1"):
        from megatron_dapo.rollout.engines.sglang.engine import SGLangEngine

        SGLangEngine(tmp_path, base_gpu_id=0, gpu_id_step=0, device="cuda")


def test_sglang_fields_match_the_installed_sglang():
    """Where SGLang is installed, its ServerArgs must still take every keyword the adapter sends."""
    sglang_server_args = pytest.importorskip("sglang.srt.server_args")

    fields = set(getattr(sglang_server_args.ServerArgs, "__annotations__", {})) | set(
        getattr(sglang_server_args, "_annotations", {})
    )
    assert set(SGLANG_0_5_23_FIELDS) <= fields, set(SGLANG_0_5_23_FIELDS) - fields


@pytest.fixture(scope="module")
def tiny_qwen3(tmp_path_factory) -> Path:
    return save_tiny_model("qwen3", tmp_path_factory.mktemp("launch") / "qwen3")


def test_a_leader_engine_starts_its_processes_on_its_gpus(tiny_qwen3, require_vllm):
    """A real leader-placement engine: vLLM's engine core (a spawned process) carries the engine's
    CUDA_VISIBLE_DEVICES and runs with multiprocessing (in another process); this process's
    environment is unchanged.
    vLLM's view of the environment starts frozen, as an earlier in-process engine core leaves it
    (its default start method 'fork' would hide the engine's variables from /proc/PID/environ)."""
    import vllm
    import vllm.envs

    vllm.envs.enable_envs_cache()
    before = dict(os.environ)  # after vLLM's import, which sets variables of its own
    cfg = _config("vllm", str(tiny_qwen3))
    cfg.rollout.tp = 1
    devices = EngineDevices(owner=0, ranks=(0,), node="node0", gpus=("GPU-test-0",), indices=(0,))
    engine = group.make_engine(cfg, tiny_qwen3, torch.device("cpu"), placement="leader", devices=devices)
    try:
        # What vLLM's worker process (spawned by its engine core, spawned by this process) received.
        (worker,) = engine._rpc("mdapo_process", ["CUDA_VISIBLE_DEVICES", "VLLM_ENABLE_V1_MULTIPROCESSING"])
        assert worker["environment"] == {"CUDA_VISIBLE_DEVICES": "GPU-test-0", "VLLM_ENABLE_V1_MULTIPROCESSING": "1"}
        assert worker["pid"] != os.getpid()
        after = {k: v for k, v in os.environ.items() if k != "VLLM_LOGGING_LEVEL"}  # make_engine's default
        assert after == {k: v for k, v in before.items() if k != "VLLM_LOGGING_LEVEL"}
        from megatron_dapo.rollout.base import SamplingParams

        out = engine.generate([[1, 2, 3]], SamplingParams(n=2, max_new_tokens=3, seed=0))
        assert len(out.response_ids) == 2
    finally:
        engine.shutdown()
    with pytest.raises(ValueError, match="leader placement"):
        from megatron_dapo.rollout.engines.vllm.engine import VLLMEngine

        VLLMEngine(tiny_qwen3, placement="spmd", visible_devices="0")
    assert vllm_launch.SHM_TOKEN_PREFIX == "mdapo_spmd_"
