"""A throw-away, one-node SLURM cluster on localhost, started by hand (no systemd) for tests.

    cluster = SlurmCluster(tmp_dir)
    cluster.start()                                   # munged, slurmctld, slurmd; waits for `idle`
    job = cluster.submit("slurm/demo_cpu.sbatch", args=["trainer.total_steps=2"], cwd=repo_root)
    job.assert_completed()                            # state COMPLETED, exit 0, else logs in the message
    cluster.stop()                                    # by pid file, always (also on failure)

Everything the daemons write (config, munge key and socket, state, spool, logs, pid files) lives
under the given directory, and every client call gets `SLURM_CONF` pointing at the throw-away
slurm.conf, so a system SLURM or munge on the same machine is neither used nor disturbed. Daemon
and client ports are picked free, so two sessions can run side by side.

Facts this relies on (Debian 12, SLURM 22.05, munge 0.5.15):
- no cgroups: `ProctrackType=proctrack/linuxproc`, `TaskPlugin=task/none`;
- munged refuses a socket directory writable by group/other: it is created 0755;
- `sacct` needs a database daemon, so job state comes from `scontrol show job` (kept MinJobAge
  seconds after the end) and the exit status from `sbatch --wait`;
- with the default scheduler intervals the first job waits ~3 s for the first scheduling pass and
  a requeued job up to a minute (see `write_config` for the settings that shorten both).

If the daemons are missing, `ensure_installed` installs Debian's packages with apt-get (root only).
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import signal
import subprocess
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping, Optional, Sequence

from megatron_dapo.distributed.launch import find_free_port

__all__ = ["SlurmCluster", "SlurmJob", "SlurmSubmission", "SlurmUnavailable", "ensure_installed", "find_binary"]

PACKAGES = ("slurmctld", "slurmd", "slurm-client", "munge")
BINARIES = ("munged", "slurmctld", "slurmd", "sbatch", "srun", "scontrol", "sinfo", "squeue", "scancel")
# Root's PATH has the sbin directories, a user's often does not: the daemons live there.
_SEARCH_PATH = os.pathsep.join([os.environ.get("PATH", ""), "/usr/sbin", "/sbin", "/usr/bin", "/bin"])


class SlurmUnavailable(RuntimeError):
    """SLURM cannot be installed or started here (not root, no package registry, ...)."""


UNSETTLED_STATES = ("PENDING", "CONFIGURING", "RUNNING", "COMPLETING")
"""Job states that change on their own (scontrol's JobState)."""


def find_binary(name: str) -> Optional[str]:
    """Absolute path of a SLURM/munge program, looking in sbin directories too."""
    return shutil.which(name, path=_SEARCH_PATH)


def _missing_binaries() -> list[str]:
    return [name for name in BINARIES if find_binary(name) is None]


def ensure_installed(timeout_s: float = 600.0) -> None:
    """Install Debian's slurmctld, slurmd, slurm-client and munge unless every program is present.

    Non-interactive and quiet; runs `apt-get update` only when the first install attempt fails
    (stale or missing package lists). Raises `SlurmUnavailable` saying why it cannot.
    """
    if not _missing_binaries():
        return
    if os.geteuid() != 0:
        missing = ", ".join(_missing_binaries())
        raise SlurmUnavailable(f"SLURM is not installed ({missing} missing) and this is not root")
    apt = shutil.which("apt-get", path=_SEARCH_PATH)
    if apt is None:
        raise SlurmUnavailable("SLURM is not installed and there is no apt-get to install it")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    install = [apt, "install", "-y", "-qq", "--no-install-recommends", *PACKAGES]
    first = subprocess.run(install, env=env, capture_output=True, text=True, timeout=timeout_s)
    if first.returncode != 0:
        update = subprocess.run([apt, "update", "-qq"], env=env, capture_output=True, text=True, timeout=timeout_s)
        second = subprocess.run(install, env=env, capture_output=True, text=True, timeout=timeout_s)
        if second.returncode != 0:
            raise SlurmUnavailable(
                "apt-get could not install SLURM:\n"
                + (update.stdout + update.stderr + second.stdout + second.stderr)[-3000:]
            )
    if _missing_binaries():
        raise SlurmUnavailable(f"installed {' '.join(PACKAGES)} but {', '.join(_missing_binaries())} still missing")


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A zombie child of ours counts as gone.
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def parse_scontrol_record(text: str) -> dict[str, str]:
    """`scontrol show job -o` output (Key=Value pairs on one line) as a dict.

    Values cannot contain spaces except the last ones on the line (e.g. `Command=`), which is
    enough for the keys the tests read (JobState, ExitCode, Reason, NodeList, NumTasks, ...).
    """
    record: dict[str, str] = {}
    for token in text.split():
        if "=" in token:
            key, value = token.split("=", 1)
            record.setdefault(key, value)
    return record


@dataclass
class SlurmJob:
    """A finished (or timed out) batch job."""

    job_id: int
    name: str
    sbatch_returncode: int
    """`sbatch --wait` exits with the job's exit code (non-zero if it failed or was cancelled)."""
    record: dict[str, str]
    """`scontrol show job` fields at the end (JobState, ExitCode, Reason, ...)."""
    output_file: Path
    seconds: float
    cluster: "SlurmCluster" = field(repr=False)
    timed_out: bool = False

    @property
    def state(self) -> str:
        return self.record.get("JobState", "UNKNOWN")

    @property
    def exit_code(self) -> str:
        return self.record.get("ExitCode", "?")

    def output(self) -> str:
        """The job's stdout/stderr (`--output` file)."""
        return self.output_file.read_text(errors="replace") if self.output_file.exists() else "(no job output file)"

    def describe(self, tail_chars: int = 8000) -> str:
        """State, job output tail and the daemons' log tails, for failure messages."""
        return (
            f"job {self.job_id} ({self.name}): state={self.state} exit={self.exit_code} "
            f"sbatch rc={self.sbatch_returncode} timed_out={self.timed_out} after {self.seconds:.1f}s\n"
            f"scontrol: {self.record}\n"
            f"--- job output ({self.output_file}) ---\n{self.output()[-tail_chars:]}\n"
            f"{self.cluster.logs()}"
        )

    def assert_completed(self) -> "SlurmJob":
        """Raise AssertionError with everything useful unless the job COMPLETED with exit 0."""
        if self.timed_out or self.state != "COMPLETED" or self.exit_code != "0:0" or self.sbatch_returncode != 0:
            raise AssertionError(self.describe())
        return self


class SlurmSubmission:
    """A running `sbatch --wait`: find its job id while it runs, then wait for the end."""

    def __init__(self, cluster: "SlurmCluster", name: str, proc: subprocess.Popen, jobs_dir: Path, started: float):
        self.cluster, self.name, self.proc, self.jobs_dir, self.started = cluster, name, proc, jobs_dir, started

    def job_id(self, timeout_s: float = 30.0) -> int:
        """The job's id, looked up by its unique name (sbatch's own stdout arrives only at its exit)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            proc = self.cluster.run(find_binary("squeue"), "-h", "-t", "all", "-n", self.name, "-o", "%i", check=False)
            if proc.returncode == 0 and proc.stdout.split():
                return int(proc.stdout.split()[0])
            if self.proc.poll() is not None and self.proc.returncode != 0:
                raise RuntimeError(f"sbatch failed ({self.proc.returncode}): {self.proc.communicate()}")
            time.sleep(0.2)
        raise RuntimeError(f"job {self.name} not found in squeue after {timeout_s:.0f}s\n{self.cluster.logs()}")

    def wait_until_running(self, timeout_s: float = 60.0) -> int:
        """Wait until the job's state is RUNNING; returns its id."""
        job_id = self.job_id()
        deadline = time.monotonic() + timeout_s
        state = ""
        while time.monotonic() < deadline:
            state = self.cluster.job_record(job_id).get("JobState", "")
            if state == "RUNNING":
                return job_id
            if state and state not in ("PENDING", "CONFIGURING"):
                break
            time.sleep(0.2)
        raise RuntimeError(f"job {job_id} is {state or 'unknown'}, not RUNNING\n{self.cluster.logs()}")

    def wait(self, timeout_s: float = 300.0) -> SlurmJob:
        """Wait for sbatch to return (the job ended); on timeout cancel the job."""
        timed_out = False
        try:
            out, err = self.proc.communicate(timeout=max(0.0, timeout_s - (time.monotonic() - self.started)))
            match = re.match(r"\s*(\d+)", out or "")
            if match is None:
                raise RuntimeError(
                    f"sbatch gave no job id (rc {self.proc.returncode}): {out}{err}\n{self.cluster.logs()}"
                )
            job_id = int(match.group(1))
        except subprocess.TimeoutExpired:
            timed_out = True
            job_id = self.job_id(timeout_s=5.0)
            self.cluster.run(find_binary("scancel"), str(job_id), check=False)
            self.proc.kill()
            self.proc.communicate()
            time.sleep(1.0)  # let the controller record the cancellation before we read the state
        seconds = time.monotonic() - self.started
        return SlurmJob(
            job_id=job_id,
            name=self.name,
            sbatch_returncode=self.proc.returncode,
            record=self.cluster.settled_job_record(job_id),
            output_file=self.jobs_dir / f"{self.name}-{job_id}.out",
            seconds=seconds,
            cluster=self.cluster,
            timed_out=timed_out,
        )


class SlurmCluster:
    """One controller and one compute node (`localhost`) under `root`, with their own munged."""

    def __init__(self, root: os.PathLike | str, partition: str = "debug", min_cpus: int = 2):
        self.root = Path(root).resolve()
        self.partition = partition
        self.min_cpus = min_cpus
        self.conf = self.root / "slurm.conf"
        self.munge_dir = self.root / "munge"
        self.munge_socket = self.munge_dir / "munge.socket"
        self.munge_key = self.root / "munge.key"
        self.pid_files = {
            "slurmd": self.root / "slurmd.pid",
            "slurmctld": self.root / "slurmctld.pid",
            "munged": self.root / "munged.pid",
        }
        self.log_files = {
            "munged": self.root / "munged.log",
            "slurmctld": self.root / "slurmctld.log",
            "slurmd": self.root / "slurmd.log",
        }
        self.started = False

    # --- environment -------------------------------------------------------------------------

    @property
    def env(self) -> dict[str, str]:
        """The caller's environment with this cluster's slurm.conf (inherited by jobs via sbatch)."""
        env = dict(os.environ)
        env["SLURM_CONF"] = str(self.conf)
        env["PATH"] = _SEARCH_PATH
        # A test run under torchrun or inside another SLURM job must not leak its rank variables.
        for key in list(env):
            if key.startswith(("SLURM_", "SBATCH_", "SRUN_")) and key != "SLURM_CONF":
                del env[key]
        for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
            env.pop(key, None)
        return env

    def run(self, *cmd: str, timeout: float = 30.0, check: bool = True) -> subprocess.CompletedProcess:
        """Run a client command (sinfo, scontrol, ...) against this cluster."""
        proc = subprocess.run(list(cmd), env=self.env, capture_output=True, text=True, timeout=timeout)
        if check and proc.returncode != 0:
            raise RuntimeError(
                f"{shlex.join(cmd)} failed ({proc.returncode}): {proc.stdout}{proc.stderr}\n{self.logs()}"
            )
        return proc

    # --- set-up ------------------------------------------------------------------------------

    def _node_hardware(self) -> str:
        """The node line's hardware fields, from `slurmd -C` (what slurmd will register with)."""
        cmd = [find_binary("slurmd"), "-C"]
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=30, check=True).stdout
        fields = dict(re.findall(r"(\w+)=(\S+)", out.splitlines()[0]))
        memory = fields.get("RealMemory", "1000")
        if int(fields.get("CPUs", "1")) >= self.min_cpus:
            keys = ("CPUs", "Boards", "SocketsPerBoard", "CoresPerSocket", "ThreadsPerCore")
            return " ".join(f"{k}={fields[k]}" for k in keys if k in fields) + f" RealMemory={memory}"
        # Fewer CPUs than the tests' tasks: declare more and let the config win (see write_config).
        return f"CPUs={self.min_cpus} RealMemory={memory}"

    def write_config(self) -> None:
        """slurm.conf with every path under `root`, free ports, and no cgroup or accounting plugins.

        MinJobAge=5: `sbatch --wait` polls after 2 s, then 8 s, then every 32 s, but never lets the
        interval reach MinJobAge/2 (so it cannot miss a purged job); with 5 it keeps polling every
        2 s. A finished job stays visible to `scontrol show job` for 5 to ~65 s (the purge runs
        once a minute), long enough to read its state right after sbatch returns.
        sched_interval=1,bf_interval=1: jobs start within a second, not at the next 60 s / 30 s
        scheduling pass. cred_expire=10: a requeued job may start again cred_expire + 1 s after
        the requeue (default 120 s), which makes a real requeue testable.
        """
        hardware = self._node_hardware()
        overrides = "SlurmdParameters=config_overrides\n" if hardware.startswith(f"CPUs={self.min_cpus} ") else ""
        r = self.root
        self.conf.write_text(
            f"""# Throw-away single-node test cluster (tests/support/slurm_cluster.py).
ClusterName=mdapotest
SlurmctldHost=localhost
SlurmUser=root
SlurmdUser=root
SlurmctldPort={find_free_port()}
SlurmdPort={find_free_port()}
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={self.munge_socket},cred_expire=10
StateSaveLocation={r}/state
SlurmdSpoolDir={r}/spool
SlurmctldPidFile={self.pid_files['slurmctld']}
SlurmdPidFile={self.pid_files['slurmd']}
SlurmctldLogFile={self.log_files['slurmctld']}
SlurmdLogFile={self.log_files['slurmd']}
SlurmctldDebug=info
SlurmdDebug=info
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/backfill
SchedulerParameters=sched_interval=1,bf_interval=1
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
ReturnToService=2
MailProg=/bin/true
MinJobAge=5
KillWait=10
{overrides}NodeName=localhost NodeAddr=127.0.0.1 {hardware} State=UNKNOWN
PartitionName={self.partition} Nodes=localhost Default=YES MaxTime=INFINITE State=UP
"""
        )

    def _write_munge_key(self) -> None:
        # munged wants a key of >= 32 bytes, owned by its user and readable by nobody else.
        fd = os.open(self.munge_key, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(os.urandom(1024))

    def _start_daemon(self, name: str, cmd: Sequence[str]) -> None:
        proc = subprocess.run(list(cmd), env=self.env, capture_output=True, text=True, timeout=60)
        if proc.returncode != 0:
            raise RuntimeError(f"{name} did not start ({proc.returncode}): {proc.stdout}{proc.stderr}\n{self.logs()}")
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:  # the daemons fork, then write their pid file
            pid = self._read_pid(name)
            if pid and _pid_alive(pid):
                return
            time.sleep(0.1)
        raise RuntimeError(f"{name} wrote no live pid to {self.pid_files[name]}\n{self.logs()}")

    def start(self, timeout_s: float = 60.0) -> "SlurmCluster":
        """Write the configuration and key, start munged, slurmctld and slurmd, wait for an idle node."""
        for sub in ("state", "spool"):
            (self.root / sub).mkdir(parents=True, exist_ok=True)
        self.munge_dir.mkdir(parents=True, exist_ok=True)
        os.chmod(self.root, 0o755)
        os.chmod(self.munge_dir, 0o755)  # munged rejects a socket directory writable by others
        self.write_config()
        self._write_munge_key()
        self.started = True  # from here on, stop() has something to clean up
        self._start_daemon(
            "munged",
            [
                find_binary("munged"),
                f"--socket={self.munge_socket}",
                f"--key-file={self.munge_key}",
                f"--pid-file={self.pid_files['munged']}",
                f"--log-file={self.log_files['munged']}",
                f"--seed-file={self.root / 'munge.seed'}",
            ],
        )
        self._start_daemon("slurmctld", [find_binary("slurmctld"), "-f", str(self.conf)])
        self._start_daemon("slurmd", [find_binary("slurmd"), "-f", str(self.conf), "-N", "localhost"])
        self.wait_for_idle(timeout_s)
        return self

    def wait_for_idle(self, timeout_s: float = 60.0) -> None:
        """Wait until `sinfo` reports the node idle (slurmd registered with the controller)."""
        deadline = time.monotonic() + timeout_s
        state = ""
        while time.monotonic() < deadline:
            proc = self.run(find_binary("sinfo"), "-h", "-N", "-o", "%t", check=False)
            state = proc.stdout.strip()
            if proc.returncode == 0 and state == "idle":
                return
            time.sleep(0.25)
        raise RuntimeError(f"node not idle after {timeout_s:.0f}s (sinfo state {state!r})\n{self.logs()}")

    # --- jobs --------------------------------------------------------------------------------

    def submit(
        self,
        script: os.PathLike | str,
        args: Sequence[str] = (),
        sbatch_args: Sequence[str] = (),
        cwd: os.PathLike | str | None = None,
        env: Optional[Mapping[str, str]] = None,
        timeout_s: float = 300.0,
    ) -> SlurmJob:
        """`sbatch --wait --parsable` a script and wait for the job's end (see `submit_async`).

        On `timeout_s` the job is cancelled and the returned `SlurmJob` has `timed_out=True`.
        """
        return self.submit_async(script, args, sbatch_args, cwd, env).wait(timeout_s)

    def submit_async(
        self,
        script: os.PathLike | str,
        args: Sequence[str] = (),
        sbatch_args: Sequence[str] = (),
        cwd: os.PathLike | str | None = None,
        env: Optional[Mapping[str, str]] = None,
    ) -> "SlurmSubmission":
        """Start `sbatch --wait --parsable` in the background; its `#SBATCH` lines apply, `sbatch_args` win.

        Each submission gets a unique job name (how the job is found before sbatch returns) and
        its output goes to `root/jobs/<name>-<id>.out`.
        """
        name = f"t{uuid.uuid4().hex[:10]}"
        jobs_dir = self.root / "jobs"
        jobs_dir.mkdir(exist_ok=True)
        cmd = [
            find_binary("sbatch"), "--wait", "--parsable", f"--job-name={name}",
            f"--output={jobs_dir}/{name}-%j.out", *sbatch_args, str(script), *args,
        ]  # fmt: skip
        proc = subprocess.Popen(
            cmd, cwd=cwd, env={**self.env, **(env or {})}, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            text=True, start_new_session=True,
        )  # fmt: skip
        return SlurmSubmission(self, name, proc, jobs_dir, time.monotonic())

    def settled_job_record(self, job_id: int, timeout_s: float = 15.0) -> dict[str, str]:
        """The job's record once its state is final: `sbatch --wait` can return while the controller
        still shows the job COMPLETING (its end being cleaned up on the node), exit code already set."""
        deadline = time.monotonic() + timeout_s
        record = self.job_record(job_id)
        while record.get("JobState") in UNSETTLED_STATES and time.monotonic() < deadline:
            time.sleep(0.2)
            record = self.job_record(job_id)
        return record

    def job_record(self, job_id: int) -> dict[str, str]:
        """`scontrol show job` fields (empty dict if the controller forgot the job)."""
        proc = self.run(find_binary("scontrol"), "show", "job", "-o", str(job_id), check=False)
        return parse_scontrol_record(proc.stdout) if proc.returncode == 0 else {}

    # --- tear-down ---------------------------------------------------------------------------

    def _read_pid(self, name: str) -> Optional[int]:
        try:
            text = self.pid_files[name].read_text().strip()
        except OSError:
            return None
        return int(text) if text.isdigit() else None

    def _cancel_all_jobs(self, timeout_s: float = 30.0) -> None:
        """Cancel whatever is still queued or running and wait until slurmd has cleaned it up."""
        squeue, scancel = find_binary("squeue"), find_binary("scancel")
        proc = self.run(squeue, "-h", "-o", "%i", check=False)
        job_ids = proc.stdout.split() if proc.returncode == 0 else []
        if not job_ids:
            return
        self.run(scancel, *job_ids, check=False)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            proc = self.run(squeue, "-h", "-o", "%i", check=False)
            if proc.returncode != 0 or not proc.stdout.strip():
                return
            time.sleep(0.5)

    def stop(self, timeout_s: float = 15.0) -> None:
        """Cancel jobs, then stop slurmd, slurmctld and munged by their pid files (TERM, then KILL)."""
        if not self.started:
            return
        if self._read_pid("slurmctld") and self._read_pid("slurmd"):
            try:
                self._cancel_all_jobs()
            except Exception:  # cleaning up must go on even if the controller is broken
                pass
        stopped = []
        for name in ("slurmd", "slurmctld", "munged"):  # munged last: the others talk through it
            pid = self._read_pid(name)
            if pid is None or not _pid_alive(pid):
                continue
            os.kill(pid, signal.SIGTERM)
            deadline = time.monotonic() + timeout_s
            while _pid_alive(pid) and time.monotonic() < deadline:
                time.sleep(0.05)
            if _pid_alive(pid):
                os.kill(pid, signal.SIGKILL)
            stopped.append(pid)
        # The daemons detached from us, so init reaps them (here every ~2 s): wait briefly until
        # they are gone from the process table too, so that `pgrep` after the tests shows nothing.
        deadline = time.monotonic() + 5
        while any(os.path.exists(f"/proc/{pid}") for pid in stopped) and time.monotonic() < deadline:
            time.sleep(0.1)
        self.started = False

    def running_daemons(self) -> dict[str, int]:
        """Daemons of this cluster still alive, by name (empty after a clean `stop`)."""
        alive = {}
        for name in self.pid_files:
            pid = self._read_pid(name)
            if pid is not None and _pid_alive(pid):
                alive[name] = pid
        return alive

    def logs(self, tail_chars: int = 4000) -> str:
        """The last part of each daemon's log file."""
        parts = []
        for name, path in self.log_files.items():
            text = path.read_text(errors="replace") if path.exists() else "(no log file)"
            parts.append(f"--- {name} log ({path}) ---\n{text[-tail_chars:]}")
        return "\n".join(parts)

    def __enter__(self) -> "SlurmCluster":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
