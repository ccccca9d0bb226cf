"""The pre-flight behind `megatron-dapo doctor` (cli/doctor.py): check the machines of a job before
it queues, in under a minute.

It prints one table of what passes, warns or fails, each with what to change: the config's layout
against the world size; torch, CUDA and NCCL versions; the GPUs each task sees against the tasks
per node (and, across tasks, that no two share one); GPU memory against the memory plan at the
GPU's real capacity; Transformer Engine and flash attention (with the import error); vLLM / SGLang
and Megatron-Core in their tested ranges with every API the project calls (`versions.py`);
/dev/shm (NCCL, CUDA IPC, shared-memory weight sync); the locked-memory limit and host RAM against
the pinned memory the plan says offload takes; free disk at trainer.output_dir against the
checkpoints kept; GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME. Launched as several processes (srun,
torchrun) it also meets them over gloo (and NCCL on GPUs) and all-reduces a few MiB: reachability
across nodes and a bus-bandwidth figure. Rank 0 prints the table of every rank, rows that agree
merged; the sbatch scripts run it as their first step.

The result: 0 nothing failed (warnings allowed), 1 a check failed (the same on every rank).

The checks are small pure functions of facts in `doctor/checks.py`, so tests reach every one on
a CPU with the library calls replaced at their boundary (a fake `torch` for the CUDA facts); this
module gathers the facts, meets the other ranks and prints the table. The checks that apply on a
CPU run for real, under SLURM too (tests/doctor/test_doctor.py, tests/slurm/test_sbatch.py).
"""

from __future__ import annotations

import datetime
import os
import socket
import time
from dataclasses import asdict, dataclass
from typing import Any, Callable, Mapping, Optional, Sequence

import torch
import torch.distributed as dist

from megatron_dapo.distributed.launch import resolve_launch_env
from megatron_dapo.distributed.socket_interfaces import choose_interface, interface_addresses, resolve_ipv4, route_source
from megatron_dapo.doctor.checks import (
    FAIL,
    GIB,
    PASS,
    SKIP,
    WARN,
    Check,
    CollectiveResult,
    FlashFacts,
    JobShape,
    TorchFacts,
    check_collective,
    check_config,
    check_disk,
    check_engine,
    check_flash_attention,
    check_gloo_interface,
    check_gpu_memory,
    check_gpu_sharing,
    check_gpus,
    check_host_memory,
    check_megatron,
    check_memlock,
    check_nccl_interface,
    check_shm,
    check_torch,
    check_transformer_engine,
    checkpoint_bytes,
    config_facts,
    flash_facts,
    has_infiniband,
    host_memory_need,
    installed_version,
    job_shape,
    read_meminfo,
    read_memlock_limit,
    shm_need,
    space_facts,
    torch_facts,
    _ranges,
    ENGINE_DISTRIBUTIONS,
)
from megatron_dapo.compat.versions import MEGATRON_CORE, TRANSFORMER_ENGINE, probe
from megatron_dapo.errors import InputError

__all__ = ["EXIT_FAILED", "EXIT_OK", "DoctorOptions", "LaunchEnvironmentError", "RankReport", "format_table", "merge", "run_doctor"]

EXIT_OK, EXIT_FAILED = 0, 1
"""The doctor's result: nothing failed (warnings allowed), or a check failed."""


class LaunchEnvironmentError(InputError, ValueError):
    """The launcher's variables are half set (e.g. RANK without WORLD_SIZE): the message names them."""


@dataclass(frozen=True)
class DoctorOptions:
    """What `megatron-dapo doctor` was asked (see its --help)."""

    config: Optional[str]
    overrides: tuple[str, ...]
    world_size: Optional[int]
    model: Optional[str]
    timeout_s: float
    bandwidth_mib: int


# ---------------------------------------------------------------------------------------------
# Collectives across the ranks of the job
# ---------------------------------------------------------------------------------------------


def _error_text(exc: BaseException) -> str:
    lines = [line for line in str(exc).strip().splitlines() if line.strip()]
    return f"{type(exc).__name__}: {lines[0] if lines else ''}"[:300]


def time_all_reduce(dist: Any, tensor: Any, group: Any, rounds: int, synchronize: Callable[[], None], barrier: bool) -> tuple[float, ...]:
    """One warm-up all-reduce, then `rounds` timed ones (each synchronised; with `barrier` the ranks
    start each round together, so the time is the collective's, not the wait for a late rank)."""
    dist.all_reduce(tensor, group=group)
    synchronize()
    times = []
    for _ in range(rounds):
        if barrier:
            dist.barrier(group=group)
        start = time.perf_counter()
        dist.all_reduce(tensor, group=group)
        synchronize()
        times.append(time.perf_counter() - start)
    return tuple(times)


def init_process_group(shape: JobShape, timeout_s: float, env: Mapping[str, str]) -> Optional[str]:
    """Join the launch's gloo world; returns the error, None on success."""
    launch = resolve_launch_env(env, free_port=0)
    os.environ.update(
        MASTER_ADDR=launch.master_addr,
        MASTER_PORT=str(launch.master_port),
        RANK=str(launch.rank),
        WORLD_SIZE=str(launch.world_size),
        LOCAL_RANK=str(launch.local_rank),
    )
    try:
        dist.init_process_group(
            backend="gloo",
            init_method="env://",
            rank=launch.rank,
            world_size=launch.world_size,
            timeout=datetime.timedelta(seconds=timeout_s),
        )
    except Exception as exc:
        return f"could not join the {launch.world_size} ranks at {launch.master_addr}:{launch.master_port}: {_error_text(exc)}"
    return None


def measure_collective(backend: str, nbytes: int, rounds: int, timeout_s: float, device: Any = None) -> CollectiveResult:
    """All-reduce `nbytes` over every rank of the (initialised) world with `backend`."""
    world = dist.get_world_size()
    try:
        if backend == "gloo":
            group, tensor, sync = None, torch.ones(nbytes // 4, dtype=torch.float32), (lambda: None)
        else:
            group = dist.new_group(backend="nccl", timeout=datetime.timedelta(seconds=timeout_s))
            tensor = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
            sync = torch.cuda.synchronize
        seconds = time_all_reduce(dist, tensor, group, rounds, sync, barrier=backend == "gloo")
        # Each round took as long as its slowest rank: the same figures on every rank (one table row).
        slowest = torch.tensor(seconds, dtype=torch.float64)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
        seconds = tuple(float(s) for s in slowest)
        expected = float(world ** (rounds + 1))  # every round multiplies each element by the world size
        if abs(float(tensor[0]) - expected) > 1e-3 * expected:
            return CollectiveResult(backend, world, False, f"wrong sum {float(tensor[0])}, expected {expected}")
    except Exception as exc:
        return CollectiveResult(backend, world, False, _error_text(exc))
    return CollectiveResult(backend, world, True, nbytes=nbytes, seconds=seconds)


# ---------------------------------------------------------------------------------------------
# The table
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RankReport:
    rank: int
    host: str
    checks: tuple[Check, ...]


def merge(reports: Sequence[RankReport]) -> list[tuple[Check, str]]:
    """(check, where) rows: a check every rank agrees on once ("all"), else one row per variant."""
    world = len(reports)
    order: list[str] = []
    variants: dict[str, dict[Check, list[RankReport]]] = {}
    for report in sorted(reports, key=lambda r: r.rank):
        for check in report.checks:
            if check.name not in variants:
                order.append(check.name)
                variants[check.name] = {}
            variants[check.name].setdefault(check, []).append(report)
    rows = []
    for name in order:
        groups = variants[name]
        if len(groups) == 1 and len(next(iter(groups.values()))) == world:
            rows.append((next(iter(groups)), "all" if world > 1 else "-"))
            continue
        for check, holders in sorted(groups.items(), key=lambda kv: min(r.rank for r in kv[1])):
            hosts = sorted({r.host for r in holders})
            rows.append((check, f"rank {_ranges([r.rank for r in holders])} ({','.join(hosts)})"))
    return rows


def format_table(rows: Sequence[tuple[Check, str]], title: str) -> str:
    name_width = max([len("check")] + [len(c.name) for c, _ in rows])
    where_width = max([len("where")] + [len(w) for _, w in rows])
    indent = " " * (2 + name_width + 2 + 6 + 2 + where_width + 2)
    lines = [title, f"  {'check':<{name_width}}  {'status':<6}  {'where':<{where_width}}  detail / what to change"]
    for check, where in rows:
        lines.append(f"  {check.name:<{name_width}}  {check.status:<6}  {where:<{where_width}}  {check.detail}")
        if check.fix and check.status in (FAIL, WARN, SKIP):
            lines.append(f"{indent}-> {check.fix}")
    counts = {status: sum(1 for c, _ in rows if c.status == status) for status in (PASS, WARN, FAIL, SKIP)}
    code = EXIT_FAILED if counts[FAIL] else EXIT_OK
    lines.append(
        f"doctor: {counts[PASS]} pass, {counts[WARN]} warn, {counts[FAIL]} fail, {counts[SKIP]} skipped -> exit {code}"
    )
    return "\n".join(lines)


def exit_code(rows: Sequence[tuple[Check, str]]) -> int:
    return EXIT_FAILED if any(check.status == FAIL for check, _ in rows) else EXIT_OK


# ---------------------------------------------------------------------------------------------
# The pre-flight
# ---------------------------------------------------------------------------------------------

_DEFAULT_ROUTE_PROBE = "192.0.2.1"
"""A documentation address (RFC 5737): the route to it is the default route; nothing is sent."""


def local_checks(options: DoctorOptions, shape: JobShape, facts: TorchFacts, env: Mapping[str, str]) -> list[Check]:
    """Every check of this process that needs no other rank."""
    gpu_gib = facts.gpus[shape.local_rank % len(facts.gpus)].total_memory / GIB if facts.gpus else 80.0
    conf = config_facts(options.config, list(options.overrides), shape, gpu_gib, options.model)
    cfg = conf.cfg
    checks = [check_config(conf, options.config, shape), check_torch(facts), check_gpus(facts, shape), check_gpu_memory(conf, facts)]

    mode = cfg.model.transformer_engine if cfg is not None else "auto"
    te_report = probe(TRANSFORMER_ENGINE) if facts.cuda_available and mode != "off" else None
    checks.append(check_transformer_engine(mode, te_report, facts.cuda_available))
    checks.append(check_flash_attention(flash_facts() if facts.cuda_available else FlashFacts(None, None), facts, mode))
    engine = cfg.rollout.engine if cfg is not None else None
    for package in ("vllm", "sglang"):
        used = engine == package
        checks.append(check_engine(package, engine, probe(package) if used else None, installed_version(ENGINE_DISTRIBUTIONS[package])))
    checks.append(check_megatron(probe(MEGATRON_CORE)))

    need, why = shm_need(cfg, conf.parallel_layout, shape.tasks_per_node, shape.host)
    checks.append(check_shm(space_facts("/dev/shm") if os.path.isdir("/dev/shm") else None, need, why))
    plan = conf.plan
    pinned = plan.rollout.host_per_gpu if plan is not None else None
    checks.append(check_memlock(read_memlock_limit(), pinned, facts.cuda_available, has_infiniband()))
    total, available = read_meminfo()
    if plan is not None:
        host_need, host_why = host_memory_need(plan, shape.tasks_per_node, facts.cuda_available)
    else:
        host_need, host_why = None, conf.plan_error or conf.error or "no config"
    checks.append(check_host_memory(total, available, host_need, host_why))
    if cfg is not None:
        output_dir = cfg.trainer.output_dir
        one = checkpoint_bytes(conf.model, cfg.model.dtype) if conf.model is not None else None
        checks.append(check_disk(space_facts(output_dir), output_dir, one, cfg.trainer.keep_last))
    else:
        checks.append(Check("disk", SKIP, "the config did not load"))

    interfaces = interface_addresses()
    peers = [env.get("MASTER_ADDR", "")] if env.get("MASTER_ADDR") else []
    suggestion = choose_interface(interfaces, [ip for p in peers for ip in resolve_ipv4(p)], route_source)
    suggestion = suggestion or choose_interface(interfaces, [_DEFAULT_ROUTE_PROBE], route_source)
    host_ips = resolve_ipv4(shape.host)
    checks.append(check_gloo_interface(env.get("GLOO_SOCKET_IFNAME"), interfaces, shape.nodes, host_ips, suggestion))
    checks.append(check_nccl_interface(env.get("NCCL_SOCKET_IFNAME"), interfaces, facts.cuda_available))
    return checks


def _title(shape: JobShape, options: DoctorOptions, hosts: Sequence[str]) -> str:
    where = ",".join(sorted(set(hosts)))
    return (
        f"megatron-dapo doctor: {shape.world_size} task(s) on {shape.nodes} node(s) ({where}), "
        f"launcher {shape.launcher}, config {options.config or 'built-in defaults'}"
    )


def run_doctor(options: DoctorOptions) -> int:
    """Check this process's machine and, launched as several processes, meet the others; rank 0 (or
    a rank that could not meet them) prints the table. Returns EXIT_FAILED when a check failed (the
    same on every rank that met the others), else EXIT_OK."""
    started = time.perf_counter()
    env = dict(os.environ)
    facts = torch_facts()
    host = socket.gethostname()
    try:
        shape = job_shape(env, options.world_size, host, len(facts.gpus))
    except ValueError as exc:  # a half-set launch environment
        raise LaunchEnvironmentError(str(exc)) from None
    checks = local_checks(options, shape, facts, env)
    device_uuid = facts.gpus[shape.local_rank % len(facts.gpus)].uuid if facts.gpus else None

    reports = [RankReport(shape.rank, host, tuple(checks))]
    devices = [(shape.rank, host, device_uuid)]
    joined = False
    if shape.world_size > 1:
        error = init_process_group(shape, options.timeout_s, env)
        if error is not None:
            result = CollectiveResult("gloo", shape.world_size, False, error)
            reports = [RankReport(shape.rank, host, tuple(checks) + (check_collective(result, "gloo", shape),))]
        else:
            gathered, extra = _across_ranks(options, shape, facts, host, checks, device_uuid)
            if gathered is None:
                reports = [RankReport(shape.rank, host, tuple(checks) + tuple(extra))]
            else:
                joined = True
                reports, devices = gathered
    else:
        extra = (check_collective(None, "gloo", shape), check_collective(None, "nccl", shape, facts.cuda_available))
        reports = [RankReport(shape.rank, host, tuple(checks) + extra)]

    rows = merge(reports)
    sharing = check_gpu_sharing(devices)
    if sharing is not None:
        rows.append((sharing, "all" if len(reports) > 1 else "-"))
    code = exit_code(rows)
    if shape.rank == 0 or not joined:
        title = _title(shape, options, [r.host for r in reports])
        if not joined and shape.world_size > 1:
            title += f" -- rank {shape.rank} alone: it could not meet the others"
        print(format_table(rows, title) + f" ({time.perf_counter() - started:.0f} s)", flush=True)
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    return code


def _across_ranks(options: DoctorOptions, shape, facts, host, checks, device_uuid):
    """gloo (and NCCL on GPUs) all-reduce, then every rank's checks to every rank."""
    nbytes = options.bandwidth_mib * 2**20
    gloo = measure_collective("gloo", nbytes, rounds=5, timeout_s=options.timeout_s)
    extra = [check_collective(gloo, "gloo", shape)]
    if not gloo.ok:  # the world is broken: no gather either, this rank reports alone
        return None, extra
    # NCCL only where every rank has a GPU: creating its group is collective, a rank without one
    # would leave the others waiting (that rank's GPUs row says why).
    with_gpu = torch.tensor([1 if facts.cuda_available else 0])
    dist.all_reduce(with_gpu, op=dist.ReduceOp.MIN)
    if facts.cuda_available and not with_gpu.item():
        extra.append(Check("nccl all-reduce", FAIL, "not run: some ranks have no usable GPU (see their GPUs row)"))
    elif facts.cuda_available:
        device = torch.device("cuda", facts.gpus[shape.local_rank % len(facts.gpus)].index)
        torch.cuda.set_device(device)
        extra.append(check_collective(measure_collective("nccl", nbytes, 5, options.timeout_s, device), "nccl", shape))
    else:
        extra.append(check_collective(None, "nccl", shape))
    mine = (shape.rank, host, [asdict(c) for c in (*checks, *extra)], device_uuid)
    everyone: list = [None] * shape.world_size
    dist.all_gather_object(everyone, mine)
    reports = [RankReport(rank, h, tuple(Check(**c) for c in rows)) for rank, h, rows, _ in everyone]
    devices = [(rank, h, uuid) for rank, h, _, uuid in everyone]
    return (reports, devices), extra
