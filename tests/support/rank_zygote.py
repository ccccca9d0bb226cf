"""Start test ranks from a process that has already imported torch, Megatron-Core and transformers.

Every multi-process test used to start each rank as a fresh `python` under torchrun, and each rank
spent ~10 s of CPU importing the same libraries before doing a second of work: on the suite's
2-core machine that was a large share of the whole run. A *zygote* imports them once per pytest
process and forks the ranks of each launch from that state (copy-on-write, no threads running).
A rank then gets exactly what torchrun gives it (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE,
GROUP_RANK, MASTER_ADDR, MASTER_PORT in its environment, `python entry.py`'s sys.argv / sys.path /
`__main__`), runs the same entry file, and exits as the interpreter would (threads joined, exit
handlers run) less the teardown of the preloaded modules. As under torchrun, one failing rank
stops the others (SIGTERM, then SIGKILL) and the launch exits 1.

The default (`TORCHRUN_TEST_LAUNCHER=torchrun` turns it off): `torchrun_utils.run_torchrun_function`,
the scripts launched with `preloaded=True` and the trainer tests' CLI runs (`run_module_forked`)
fork their ranks from it; the SLURM-style launches and every other command use the real launchers.
In its first full-suite run (docs/TEST_DURATIONS.md) one worker's zygote died part-way, for a
reason not found, and every later launch of that worker failed. Now a dead zygote costs no
launch: the ranks it forked before run on (their supervisor does not need it), a launch it can no
longer take starts with torchrun (`ZygoteGone`), the next launch gets a new zygote, and the end of
the dead one's output (a file) is quoted. The zygote refuses to serve (launches then fall back to
torchrun) if its imports started a thread, since forking a multi-threaded process is unsafe.

Protocol, one JSON line each way over the zygote's stdin/stdout:
    request  {"entry": path or "module": name, "args": [...], "cwd": dir, "envs": [env of rank 0, ...],
              "log_dir": dir, "split_streams": bool}
    reply    {"supervisor": pid}   # its process group holds every rank of the launch
The supervisor writes `log_dir/exit.json` ({"codes": [...]}) when every rank has exited.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Optional, Sequence

PRELOAD = (
    "torch",
    "torch.distributed",
    "megatron.core",
    "megatron.core.parallel_state",
    "megatron.core.models.gpt.gpt_model",
    "megatron.core.optimizer",
    "megatron.core.distributed",
    "transformers",
    "megatron_dapo.config",
    "megatron_dapo.distributed",
)
LAUNCHER_ENV = "TORCHRUN_TEST_LAUNCHER"
STACKS_GRACE_S = 5.0
"""After a timeout, how long the ranks get to print their stacks (SIGABRT) before SIGKILL."""
STOP_GRACE_S = 10.0
"""After one rank fails, how long the others get to exit on SIGTERM before SIGKILL (torchrun: 30 s)."""


# ---- the zygote process -----------------------------------------------------------------------


def _run_rank(request: dict, env: dict, rank: int) -> None:
    """In a forked rank: become `python entry` (or `python -m module args`) with `env`, run it, and
    exit as that would. stdout and stderr go to the launch's per-rank files."""
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    log_dir = Path(request["log_dir"])
    for fd, stream in ((1, "stdout"), (2, "stderr" if request.get("split_streams") else "stdout")):
        log = os.open(log_dir / f"rank{rank}.{stream}", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(log, fd)
        os.close(log)
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    os.environ.clear()
    os.environ.update(env)
    if "torch" in sys.modules and env.get("OMP_NUM_THREADS", "").isdigit():
        # The OpenMP runtime read OMP_NUM_THREADS when the zygote imported torch; a fresh `python` reads this one.
        sys.modules["torch"].set_num_threads(int(env["OMP_NUM_THREADS"]))
    os.chdir(request.get("cwd") or os.getcwd())
    import runpy
    import traceback

    code = 0
    try:
        if request.get("module"):
            sys.argv = [request["module"], *request.get("args", [])]
            sys.path[0] = os.getcwd()  # `python -m` puts the working directory first
            runpy.run_module(request["module"], run_name="__main__", alter_sys=True)
        else:
            sys.argv = [request["entry"], *request.get("args", [])]
            sys.path[0] = os.path.dirname(request["entry"])
            runpy.run_path(request["entry"], run_name="__main__")
    except SystemExit as stop:
        code = stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
        if stop.code is not None and not isinstance(stop.code, int):
            print(stop.code, file=sys.stderr)
    except BaseException:
        traceback.print_exc()
        code = 1
    # As the `megatron-dapo` command ends: exit handlers run, no teardown of the preloaded modules.
    from megatron_dapo.cli.main import exit_without_teardown

    exit_without_teardown(code)


def _supervise(ranks: Sequence[int], log_dir: Path) -> None:
    """In the supervisor: wait for every rank; when one fails, stop the rest as torchrun does."""
    codes: dict[int, int] = {}
    stopping = False
    while len(codes) < len(ranks):
        pid, status = os.waitpid(-1, 0)
        if pid not in ranks:
            continue
        codes[pid] = os.waitstatus_to_exitcode(status)
        if codes[pid] != 0 and not stopping:
            stopping = True
            for other in ranks:
                if other not in codes:
                    _signal(other, signal.SIGTERM)
            threading.Timer(STOP_GRACE_S, lambda: [_signal(p, signal.SIGKILL) for p in ranks if p not in codes]).start()
    temporary = log_dir / "exit.json.tmp"
    temporary.write_text(json.dumps({"codes": [codes[p] for p in ranks]}))
    temporary.rename(log_dir / "exit.json")


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def _launch(request: dict) -> int:
    """Fork the supervisor of one launch (its own session) and, from it, the ranks."""
    sys.stdout.flush()
    sys.stderr.flush()
    supervisor = os.fork()
    if supervisor:
        return supervisor
    # The supervisor: leads a new process group that the test can stop as a whole. It never returns
    # into the zygote's loop; a rank does, by raising SystemExit up to the interpreter's own exit
    # (hence `except Exception`, which lets that through).
    ranks = []
    try:
        os.setsid()
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        log_dir = Path(request["log_dir"])
        log = os.open(log_dir / "supervisor.log", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(log, 2)  # not the zygote's stderr (the test run's output)
        os.close(log)
        for rank, env in enumerate(request["envs"]):
            pid = os.fork()
            if pid == 0:
                _run_rank(request, env, rank)
            ranks.append(pid)
        _supervise(ranks, log_dir)
    except Exception:
        import traceback

        traceback.print_exc()
        os._exit(1)
    os._exit(0)


def serve() -> None:
    """The zygote's main loop: import, check that no thread runs, then serve launches until EOF."""
    for name in PRELOAD:
        __import__(name)
    threads = len(os.listdir("/proc/self/task")) if os.path.isdir("/proc/self/task") else threading.active_count()
    reply = sys.stdout
    if threads != 1:
        reply.write(json.dumps({"refused": f"{threads} threads after the imports; forking them is unsafe"}) + "\n")
        reply.flush()
        return
    reply.write(json.dumps({"ready": os.getpid()}) + "\n")
    reply.flush()
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # supervisors are reaped by the kernel
    for line in sys.stdin:
        request = json.loads(line)
        reply.write(json.dumps({"supervisor": _launch(request)}) + "\n")
        reply.flush()


# ---- the test side ----------------------------------------------------------------------------


class ZygoteGone(RuntimeError):
    """The zygote died before it took a launch (the launches it forked before run on): the caller
    starts that launch with torchrun instead, and the next `shared_zygote` starts a new zygote."""


class Zygote:
    """One zygote per pytest process, started on first use; `launch` is thread-safe."""

    def __init__(self, env: dict[str, str]):
        self._lock = threading.Lock()
        import tempfile

        # Its own output (import warnings, a traceback if it dies) goes to a file, not to the test that started it.
        self.log_path = Path(tempfile.mkstemp(prefix="rank-zygote-", suffix=".log")[1])
        self._log = open(self.log_path, "w")
        self._proc = subprocess.Popen(
            [sys.executable, "-c", f"import sys; sys.path.insert(0, {str(Path(__file__).resolve().parents[2])!r}); "
             "from tests.support import rank_zygote; rank_zygote.serve()"],
            env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log, text=True, start_new_session=True,
        )  # fmt: skip
        hello = json.loads(self._proc.stdout.readline() or '{"refused": "the zygote exited while importing"}')
        self.refused: Optional[str] = hello.get("refused")

    def launch(self, envs: Sequence[dict[str, str]], log_dir: Path, entry: Optional[str] = None, module: Optional[str] = None,
               args: Sequence[str] = (), cwd: Optional[str] = None, split_streams: bool = False) -> int:
        """Start `python entry args` or `python -m module args` on len(envs) ranks, output in
        `log_dir`/rank{i}.stdout (and .stderr with `split_streams`); returns the supervisor's pid
        (also its process group id)."""
        request = {"entry": entry, "module": module, "args": list(args), "cwd": cwd, "split_streams": split_streams,
                   "envs": list(envs), "log_dir": str(log_dir)}  # fmt: skip
        with self._lock:
            try:
                self._proc.stdin.write(json.dumps(request) + "\n")
                self._proc.stdin.flush()
                return int(json.loads(self._proc.stdout.readline())["supervisor"])
            except (BrokenPipeError, ValueError) as error:
                raise ZygoteGone(f"the rank zygote is gone (exit status {self._proc.poll()}); {self.last_words()}") from error

    def last_words(self) -> str:
        """The end of the zygote's own output, to name why it died."""
        self._log.flush()
        return f"the end of its output ({self.log_path}):\n" + self.log_path.read_text(errors="replace")[-3000:]

    def close(self) -> None:
        if self._proc.poll() is None:
            self._proc.stdin.close()
            try:
                self._proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._proc.kill()
        self._log.close()
        self.log_path.unlink(missing_ok=True)

    def run(self, envs: Sequence[dict[str, str]], log_dir: Path, timeout: float, **command) -> Optional[list[int]]:
        """`launch` and wait: the ranks' exit codes, or None if `timeout` passed (the ranks were
        then stopped with their stacks printed, see `stop_group`)."""
        supervisor = self.launch(envs, log_dir, **command)
        codes = wait_for_exit(log_dir, supervisor, timeout)
        if codes is None:
            stop_group(supervisor, STACKS_GRACE_S)
            wait_for_exit(log_dir, supervisor, 5.0)
        return codes


_zygote: Optional[Zygote] = None
_zygote_lock = threading.Lock()


def shared_zygote(env: dict[str, str]) -> Optional[Zygote]:
    """This process's zygote (None when turned off or refused: launch with torchrun then)."""
    global _zygote
    if os.environ.get(LAUNCHER_ENV, "zygote") != "zygote":
        return None
    with _zygote_lock:
        if _zygote is not None and _zygote._proc.poll() is not None:
            # It died (see docs/TEST_DURATIONS.md: once in a full run, cause unknown): say so, start another.
            print(f"rank_zygote: the zygote exited with {_zygote._proc.returncode}; starting a new one; {_zygote.last_words()}",
                  file=sys.stderr)  # fmt: skip
            _zygote = None
        if _zygote is None:
            import atexit

            _zygote = Zygote(env)
            atexit.register(_zygote.close)
        return None if _zygote.refused else _zygote


def torchrun_environments(base: dict[str, str], nproc: int, master_port: int) -> list[dict[str, str]]:
    """The per-rank environment torchrun (`--nnodes 1 --nproc_per_node nproc`) would set."""
    return [
        dict(base, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(nproc), LOCAL_WORLD_SIZE=str(nproc),
             GROUP_RANK="0", ROLE_RANK=str(rank), ROLE_WORLD_SIZE=str(nproc), GROUP_WORLD_SIZE="1",
             MASTER_ADDR="127.0.0.1", MASTER_PORT=str(master_port), TORCHELASTIC_RESTART_COUNT="0",
             TORCHELASTIC_MAX_RESTARTS="0", TORCHELASTIC_RUN_ID="none")
        for rank in range(nproc)
    ]  # fmt: skip


def wait_for_exit(log_dir: Path, supervisor: int, timeout: float) -> Optional[list[int]]:
    """The ranks' exit codes, or None if `timeout` passed first (the caller stops the group)."""
    deadline = time.monotonic() + timeout
    status = log_dir / "exit.json"
    while time.monotonic() < deadline:
        if status.exists():
            return json.loads(status.read_text())["codes"]
        try:
            os.kill(supervisor, 0)
        except ProcessLookupError:  # the supervisor died without writing (killed from outside)
            return json.loads(status.read_text())["codes"] if status.exists() else [-signal.SIGKILL]
        time.sleep(0.1)
    return None


def stop_group(pgid: int, grace_s: float) -> None:
    """SIGABRT (faulthandler prints each rank's stacks), then SIGKILL after `grace_s`."""
    for sig, wait in ((signal.SIGABRT, grace_s), (signal.SIGKILL, 0.0)):
        try:
            os.killpg(pgid, sig)
        except ProcessLookupError:
            return
        time.sleep(wait)
