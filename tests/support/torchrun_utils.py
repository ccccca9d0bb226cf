"""Run Python code in several processes under torchrun (gloo on the CPU) from a pytest test.

Two entry points, both returning a `TorchrunResult` (exit code, output, per-rank results):

    result = run_torchrun_function(Path(__file__).parent / "_worker.py", "main", nproc=4,
                                   kwargs={"model_dir": str(path)}, timeout=300)
    result.check()                      # raises with the output tail if any rank failed
    for rank_result in result.rank_results: ...

    result = run_torchrun_script("path/to/script.py", nproc=2, args=["--flag"])

    result = run_slurm_function(worker_file, "main", ntasks=2)   # emulates `srun --ntasks 2`

    outcomes = two_at_a_time({"a": lambda: subprocess.run(...), "b": ...})   # name -> what each returned

`nproc=1` without torchrun (`use_torchrun=False`) runs the same code as a plain `python` process,
which exercises the single-process launch path of `init_distributed`.

Conventions:
- The target function gets `**kwargs` (JSON-serialisable) and runs on every rank with the torchrun
  environment (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT) set; a free port is chosen.
- Results come back through files: inside a worker call `write_rank_result(obj)` (JSON-serialisable)
  and read them in the test from `result.rank_results` (a list indexed by rank; None where a rank
  wrote nothing). If the function returns a value that is not None, it is written the same way.
- The child processes get the repository root on PYTHONPATH (helpers import as
  `from tests.support.<module> import ...`), OMP_NUM_THREADS=1 (many ranks share few cores) and a
  wall-clock `timeout` after which the whole process group is killed.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import threading
import os
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
import traceback
from dataclasses import dataclass, field
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

from megatron_dapo.distributed.launch import find_free_port
from tests.support import rank_zygote

__all__ = [
    "RESULT_DIR_ENV",
    "TorchrunResult",
    "free_port",
    "launch_slot",
    "read_rank_results",
    "run_slurm_function",
    "run_torchrun_function",
    "run_torchrun_script",
    "two_at_a_time",
    "write_rank_result",
]

REPO_ROOT = Path(__file__).resolve().parents[2]
RESULT_DIR_ENV = "TORCHRUN_TEST_RESULT_DIR"

# ---- how many launches run at once on this machine ---------------------------------------------
LAUNCH_SLOTS_ENV = "TEST_LAUNCH_SLOTS"
"""How many launches (torchrun jobs, SLURM-style tasks, trainer CLI runs) may run at once on this
machine, over every pytest worker together; default: the number of cores."""
_SLOT_HELD_ENV = "TEST_LAUNCH_SLOT_HELD"
_held = threading.local()


def launch_slots() -> int:
    return max(1, int(os.environ.get(LAUNCH_SLOTS_ENV) or os.cpu_count() or 2))


@contextlib.contextmanager
def launch_slot():
    """Hold one of the machine's launch slots while a launch runs (waits for a free one).

    `make test` runs two test files at a time and some files start two launches at a time; without a
    bound, four launches with their ranks, engines and reward pools shared 2 cores (load average 25
    in a CI run), and a rendezvous or a listing made under that load failed by chance. The slots are
    file locks in the temporary directory, so every pytest worker of the machine shares them; a
    thread that holds one, or a process launched under one, takes no second (no nested wait)."""
    if getattr(_held, "slot", False) or os.environ.get(_SLOT_HELD_ENV):
        yield
        return
    directory = Path(tempfile.gettempdir()) / f"megatron_dapo_test_launch_slots_{os.getuid()}"
    directory.mkdir(exist_ok=True)
    handle = None
    while handle is None:
        for index in range(launch_slots()):
            candidate = open(directory / f"slot{index}", "a+")
            try:
                fcntl.flock(candidate, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                candidate.close()
                continue
            handle = candidate
            break
        else:
            time.sleep(0.2)
    _held.slot = True
    try:
        yield
    finally:
        _held.slot = False
        fcntl.flock(handle, fcntl.LOCK_UN)
        handle.close()


def free_port() -> int:
    """A local TCP port for a rank-0 rendezvous server (`launch.find_free_port`: below the ephemeral
    range, where no outgoing connection can be handed it before the server binds it)."""
    return find_free_port()


def write_rank_result(obj: Any) -> None:
    """In a worker: store this rank's JSON-serialisable result for the test to read."""
    directory = os.environ.get(RESULT_DIR_ENV)
    if not directory:
        raise RuntimeError(f"{RESULT_DIR_ENV} is not set: run this worker through torchrun_utils")
    rank = int(os.environ.get("RANK") or os.environ.get("SLURM_PROCID") or "0")
    path = Path(directory) / f"rank{rank}.json"
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(obj))
    tmp.replace(path)


@contextlib.contextmanager
def reporting(out: dict, teardown: bool = True):
    """In a worker: run the body; on failure record the traceback as ``out["error"]`` and re-raise;
    always write ``out`` as this rank's result and (by default) tear the process groups down."""
    try:
        yield out
    except BaseException:
        out["error"] = traceback.format_exc()
        raise
    finally:
        write_rank_result(out)
        if teardown:
            from megatron_dapo.distributed import teardown as destroy_process_groups

            destroy_process_groups()


def read_rank_results(directory: Path, nproc: int) -> list[Any]:
    """Per-rank results written with `write_rank_result` (None for a rank that wrote nothing)."""
    results = []
    for rank in range(nproc):
        path = Path(directory) / f"rank{rank}.json"
        results.append(json.loads(path.read_text()) if path.exists() else None)
    return results


@dataclass
class TorchrunResult:
    returncode: int
    output: str
    """stdout and stderr of all ranks, interleaved."""
    seconds: float
    rank_results: list[Any] = field(default_factory=list)
    timed_out: bool = False

    def tail(self, chars: int = 10000) -> str:
        return self.output[-chars:]

    def check(self) -> "TorchrunResult":
        """Raise AssertionError with the output tail unless every rank exited 0."""
        if self.timed_out:
            raise AssertionError(f"torchrun timed out after {self.seconds:.0f}s; output tail:\n{self.tail()}")
        if self.returncode != 0:
            raise AssertionError(f"torchrun exited with {self.returncode}; output tail:\n{self.tail()}")
        return self


def _child_env(result_dir: Optional[Path], extra: Optional[dict[str, str]]) -> dict[str, str]:
    env = dict(os.environ)
    paths = [str(REPO_ROOT)]
    if env.get("PYTHONPATH"):
        paths.append(env["PYTHONPATH"])
    env["PYTHONPATH"] = os.pathsep.join(paths)
    env.setdefault("OMP_NUM_THREADS", "1")
    env["PYTHONUNBUFFERED"] = "1"
    env["PYTHONFAULTHANDLER"] = "1"  # a hung rank stopped with SIGABRT prints every thread's stack
    env[_SLOT_HELD_ENV] = "1"  # launched under a slot: a launch of its own takes none
    if result_dir is not None:
        env[RESULT_DIR_ENV] = str(result_dir)
    # The parent may run under a torchrun itself; its variables must not leak into the children.
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "LOCAL_WORLD_SIZE", "GROUP_RANK"):
        env.pop(key, None)
    env.update(extra or {})
    return env


def _run(cmd: list[str], env: dict[str, str], timeout: float, result_dir: Path, nproc: int) -> TorchrunResult:
    with launch_slot():
        start = time.monotonic()  # the timeout starts once the launch does, not while it waits for a slot
        proc = subprocess.Popen(
            cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
        )
        timed_out = False
        try:
            output, _ = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            timed_out = True
            _stop_process_groups([proc])  # the launcher and every rank it started
            output, _ = proc.communicate()
    _log_launch(cmd, nproc, time.monotonic() - start)
    return TorchrunResult(
        returncode=proc.returncode,
        output=output or "",
        seconds=time.monotonic() - start,
        rank_results=read_rank_results(result_dir, nproc),
        timed_out=timed_out,
    )


LAUNCH_LOG_ENV = "TORCHRUN_TEST_LAUNCH_LOG"


def _log_launch(cmd: Sequence[str], nproc: int, seconds: float) -> None:
    """With TORCHRUN_TEST_LAUNCH_LOG=path, append one JSON line per launch (which test, what, how
    long): how the suite's time splits into launches, for docs/TEST_DURATIONS.md."""
    path = os.environ.get(LAUNCH_LOG_ENV)
    if path:
        line = {"test": os.environ.get("PYTEST_CURRENT_TEST", ""), "cmd": " ".join(map(str, cmd))[-200:],
                "nproc": nproc, "seconds": round(seconds, 2)}  # fmt: skip
        with open(path, "a") as f:
            f.write(json.dumps(line) + "\n")


HANG_STACKS_GRACE_S = rank_zygote.STACKS_GRACE_S


def _stop_process_groups(procs: Sequence[subprocess.Popen]) -> None:
    """Stop each still-running process's whole group: SIGABRT first, so that every hung Python
    process prints its threads' stacks (PYTHONFAULTHANDLER) into the output, then SIGKILL."""
    running = [p for p in procs if p.poll() is None]
    for p in running:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(p.pid, signal.SIGABRT)
    deadline = time.monotonic() + HANG_STACKS_GRACE_S
    while time.monotonic() < deadline and any(p.poll() is None for p in running):
        time.sleep(0.1)
    for p in running:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(p.pid, signal.SIGKILL)
    for p in running:
        p.wait()


def _launcher(nproc: int, use_torchrun: bool) -> list[str]:
    if not use_torchrun:
        if nproc != 1:
            raise ValueError("use_torchrun=False runs exactly one process")
        return [sys.executable]
    return [
        sys.executable, "-m", "torch.distributed.run",
        "--nnodes", "1", "--nproc_per_node", str(nproc),
        "--master_addr", "127.0.0.1", "--master_port", str(free_port()),
    ]  # fmt: skip


def run_torchrun_script(
    script: os.PathLike | str,
    nproc: int,
    args: Sequence[str] = (),
    timeout: float = 300.0,
    env: Optional[dict[str, str]] = None,
    use_torchrun: bool = True,
    preloaded: bool = False,
) -> TorchrunResult:
    """Run `script` with `args` on `nproc` ranks; returns when all exit or `timeout` passes.

    `preloaded`: fork the ranks from the zygote, as `run_torchrun_function` does (not for scripts
    that measure their own memory or imports)."""
    with tempfile.TemporaryDirectory(prefix="torchrun-") as tmp:
        result_dir = Path(tmp) / "results"
        result_dir.mkdir()
        zygote = rank_zygote.shared_zygote(_child_env(None, None)) if preloaded and not env else None
        forked = None if zygote is None else _run_forked(zygote, Path(script).resolve(), nproc, use_torchrun, timeout, result_dir,
                                                         Path(tmp), args=args)  # fmt: skip
        if forked is not None:
            return forked
        cmd = [*_launcher(nproc, use_torchrun), str(script), *map(str, args)]
        return _run(cmd, _child_env(result_dir, env), timeout, result_dir, nproc)


_BOOTSTRAP = """\
import importlib.util, json, sys
sys.path[:0] = {paths!r}
spec = importlib.util.spec_from_file_location("torchrun_target", {module_file!r})
module = importlib.util.module_from_spec(spec)
spec.loader.exec_module(module)
with open({kwargs_file!r}) as f:
    kwargs = json.load(f)
result = getattr(module, {function!r})(**kwargs)
if result is not None:
    from tests.support.torchrun_utils import write_rank_result
    write_rank_result(result)
"""


def run_torchrun_function(
    module_file: os.PathLike | str,
    function: str,
    nproc: int,
    kwargs: Optional[dict[str, Any]] = None,
    timeout: float = 300.0,
    env: Optional[dict[str, str]] = None,
    use_torchrun: bool = True,
    fresh_interpreter: bool = False,
) -> TorchrunResult:
    """Call `function(**kwargs)` from the Python file `module_file` on `nproc` ranks.

    The ranks are forked from this process's zygote (TORCHRUN_TEST_LAUNCHER=torchrun: never)
    (`rank_zygote`: the libraries already imported, torchrun's environment), unless `env` is given
    (it might be read at import time) or `fresh_interpreter` (a test of what gets imported);
    otherwise torchrun (or `python`) starts them.
    """
    with tempfile.TemporaryDirectory(prefix="torchrun-") as tmp:
        result_dir, entry = _write_entry(Path(tmp), module_file, function, kwargs)
        zygote = rank_zygote.shared_zygote(_child_env(None, None)) if not env and not fresh_interpreter else None
        forked = None if zygote is None else _run_forked(zygote, entry, nproc, use_torchrun, timeout, result_dir, Path(tmp))
        if forked is not None:
            return forked
        cmd = [*_launcher(nproc, use_torchrun), str(entry)]
        return _run(cmd, _child_env(result_dir, env), timeout, result_dir, nproc)


RUNTIME_ENV = {"OMP_NUM_THREADS", "PYTHONUNBUFFERED", "PYTHONPATH", "PYTHONFAULTHANDLER", RESULT_DIR_ENV, _SLOT_HELD_ENV}
"""Variables a forked rank may have different from the zygote's environment: read after start-up
(OMP_NUM_THREADS is applied with torch.set_num_threads) or harmless to differ (PYTHONPATH: the
zygote's sys.path holds the repository as well)."""


def run_module_forked(
    module: str, args: Sequence[str], nproc: int, env: dict[str, str], cwd: os.PathLike | str, timeout: float
) -> Optional[subprocess.CompletedProcess]:
    """`python -m module args` (nproc 1) or `torchrun --nproc_per_node nproc -m module args`, with
    the ranks forked from the zygote; the result and `TimeoutExpired` as `subprocess.run(...,
    capture_output=True, text=True, timeout=timeout)` gives them. None where the zygote cannot run
    it faithfully (turned off or refused, or `env` differs from the zygote's in a variable that
    may be read at import time): run it as a real subprocess then."""
    base = _child_env(None, None)
    zygote = rank_zygote.shared_zygote(base)
    differing = {k for k in set(env) | set(base) if env.get(k) != base.get(k)} - RUNTIME_ENV
    if zygote is None or any(not k.startswith("MDAPO_TEST_") for k in differing):
        return None
    envs = rank_zygote.torchrun_environments(dict(env), nproc, free_port()) if nproc > 1 else [dict(env)]
    cmd = ["torchrun" if nproc > 1 else "python", "-m", module, *args]
    with tempfile.TemporaryDirectory(prefix="forked-") as tmp:
        log_dir = Path(tmp)
        with launch_slot():
            start = time.monotonic()
            try:
                codes = zygote.run(envs, log_dir, timeout, module=module, args=args, cwd=str(cwd), split_streams=True)
            except rank_zygote.ZygoteGone as gone:
                return _without_zygote(gone)
        streams = {
            name: "".join((log_dir / f"rank{rank}.{name}").read_text(errors="replace")
                          for rank in range(nproc) if (log_dir / f"rank{rank}.{name}").exists())
            for name in ("stdout", "stderr")
        }  # fmt: skip
    _log_launch(["zygote", *cmd], nproc, time.monotonic() - start)
    if codes is None:
        raise subprocess.TimeoutExpired(cmd, timeout, output=streams["stdout"], stderr=streams["stderr"])
    failed = [c for c in codes if c != 0]
    returncode = (failed[0] if nproc == 1 else 1) if failed else 0  # torchrun exits 1 when a rank fails
    return subprocess.CompletedProcess(cmd, returncode, streams["stdout"], streams["stderr"])


def _without_zygote(gone: Exception) -> None:
    """Say that a launch the dead zygote could not take starts the usual way (its caller does that)."""
    print(f"torchrun_utils: {gone}\nthis launch starts with torchrun", file=sys.stderr)


def _run_forked(
    zygote, entry: Path, nproc: int, use_torchrun: bool, timeout: float, result_dir: Path, tmp: Path, args: Sequence[str] = ()
) -> Optional[TorchrunResult]:
    """The launch's ranks forked from `zygote`; None if the zygote died before it took the launch."""
    if not use_torchrun and nproc != 1:
        raise ValueError("use_torchrun=False runs exactly one process")
    base = _child_env(result_dir, None)
    envs = rank_zygote.torchrun_environments(base, nproc, free_port()) if use_torchrun else [base]
    log_dir = tmp / "ranks"
    log_dir.mkdir()
    with launch_slot():
        start = time.monotonic()
        try:
            codes = zygote.run(envs, log_dir, timeout, entry=str(entry), args=[str(a) for a in args], cwd=os.getcwd())
        except rank_zygote.ZygoteGone as gone:
            return _without_zygote(gone)
    timed_out = codes is None
    codes = codes or [-signal.SIGKILL] * nproc
    seconds = time.monotonic() - start
    _log_launch(["zygote", str(entry)], nproc, seconds)
    logs = []
    for rank in range(nproc):
        path = log_dir / f"rank{rank}.stdout"
        logs.append(f"----- rank {rank} -----\n{path.read_text(errors='replace') if path.exists() else ''}")
    failed = [c for c in codes if c != 0]
    returncode = (failed[0] if not use_torchrun or timed_out else 1) if failed else 0  # torchrun exits 1
    return TorchrunResult(returncode=returncode, output="\n".join(logs), seconds=seconds,
                          rank_results=read_rank_results(result_dir, nproc), timed_out=timed_out)  # fmt: skip


def _write_entry(tmp: Path, module_file, function: str, kwargs) -> tuple[Path, Path]:
    result_dir = tmp / "results"
    result_dir.mkdir()
    kwargs_file = tmp / "kwargs.json"
    kwargs_file.write_text(json.dumps(kwargs or {}))
    entry = tmp / "entry.py"
    entry.write_text(
        textwrap.dedent(
            _BOOTSTRAP.format(
                paths=[str(REPO_ROOT)],
                module_file=str(Path(module_file).resolve()),
                kwargs_file=str(kwargs_file),
                function=function,
            )
        )
    )
    return result_dir, entry


def run_slurm_function(
    module_file: os.PathLike | str,
    function: str,
    ntasks: int,
    kwargs: Optional[dict[str, Any]] = None,
    timeout: float = 300.0,
    env: Optional[dict[str, str]] = None,
    nodelist: str = "localhost",
    job_id: str = "4242",
) -> TorchrunResult:
    """Like `run_torchrun_function`, but as `srun --ntasks N` on one node would start it.

    Starts `ntasks` plain Python processes with SLURM_PROCID / SLURM_NTASKS / SLURM_LOCALID /
    SLURM_JOB_NODELIST / SLURM_JOB_ID set and no torchrun variables, so the code under test has to
    find its rank and rendezvous from SLURM's variables. MASTER_PORT is set to a free port unless
    `env` sets it (the port SLURM_JOB_ID derives could be taken on a shared machine).
    """
    with tempfile.TemporaryDirectory(prefix="slurm-") as tmp:
        result_dir, entry = _write_entry(Path(tmp), module_file, function, kwargs)
        base = _child_env(result_dir, None)
        base.update({"SLURM_NTASKS": str(ntasks), "SLURM_JOB_NODELIST": nodelist, "SLURM_JOB_ID": job_id})
        base["MASTER_PORT"] = str(free_port())
        base.update(env or {})
        with launch_slot():
            start = time.monotonic()
            procs, logs = [], []
            for task in range(ntasks):
                task_env = dict(base, SLURM_PROCID=str(task), SLURM_LOCALID=str(task))
                log = open(Path(tmp) / f"task{task}.log", "w+")
                logs.append(log)
                procs.append(
                    subprocess.Popen(
                        [sys.executable, str(entry)], env=task_env, stdout=log,
                        stderr=subprocess.STDOUT, text=True, start_new_session=True,
                    )  # fmt: skip
                )
            # Poll: a task that fails makes the others wait in a collective, so stop them all at once.
            timed_out = False
            stopped: set[int] = set()
            while any(p.poll() is None for p in procs):
                failed = any(p.poll() not in (None, 0) for p in procs)
                timed_out = time.monotonic() - start > timeout
                if failed or timed_out:
                    stopped = {task for task, p in enumerate(procs) if p.poll() is None}
                    _stop_process_groups(procs)
                    break
                time.sleep(0.2)
            outputs, codes = [], []
            for task, (proc, log) in enumerate(zip(procs, logs)):
                log.seek(0)
                state = "stopped while still running" if task in stopped else f"exited with {proc.returncode}"
                wrote = (Path(result_dir) / f"rank{task}.json").exists()
                outputs.append(f"----- task {task} ({state}; result {'written' if wrote else 'not written'}) -----\n{log.read()}")
                log.close()
                codes.append(proc.returncode)
        _log_launch(["slurm", str(entry)], ntasks, time.monotonic() - start)
        return TorchrunResult(
            returncode=next((c for c in codes if c != 0), 0),
            output="\n".join(outputs),
            seconds=time.monotonic() - start,
            rank_results=read_rank_results(result_dir, ntasks),
            timed_out=timed_out,
        )


def two_at_a_time(jobs: dict[str, Callable[[], Any]]) -> dict[str, Any]:
    """Call the launches of `jobs` two at a time, in their order (put the longest first): name -> what
    each returned. A launch spends much of its time where one process works and the other core idles
    (imports, one rank computing while the others wait), so a second launch beside it fills that
    core; on this suite's 2-core machine more at once only adds contention. An exception of a job
    is raised when its result is read, after every job has finished."""
    with ThreadPoolExecutor(max_workers=2) as pool:
        started = {name: pool.submit(job) for name, job in jobs.items()}
    return {name: future.result() for name, future in started.items()}
