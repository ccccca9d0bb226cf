"""Where this process sits in its launch (torchrun, SLURM `srun`, or a plain single process).

Pure Python, no torch: the pre-flight checks ask for the world size before anything heavy loads
(`trainer.startup.preflight`, `megatron-dapo doctor`); `setup.init_distributed` then uses the same
answer to create the process groups.
"""

from __future__ import annotations

import os
import random
import re
import socket
from dataclasses import dataclass
from typing import Callable, Mapping, Optional


def _split_top_level(text: str) -> list[str]:
    """Split on commas that are not inside [...]."""
    parts, depth, current = [], 0, []
    for ch in text:
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise ValueError(f"unbalanced ']' in SLURM hostlist {text!r}")
        if ch == "," and depth == 0:
            parts.append("".join(current))
            current = []
        else:
            current.append(ch)
    if depth != 0:
        raise ValueError(f"unbalanced '[' in SLURM hostlist {text!r}")
    parts.append("".join(current))
    return [p.strip() for p in parts if p.strip()]


def _expand_range_list(body: str, text: str) -> list[str]:
    """'01-03,07' -> ['01', '02', '03', '07'] (zero padding kept as written)."""
    values = []
    for item in body.split(","):
        item = item.strip()
        if not item:
            raise ValueError(f"empty range in SLURM hostlist {text!r}")
        match = re.fullmatch(r"(\d+)(?:-(\d+))?", item)
        if match is None:
            raise ValueError(f"bad range {item!r} in SLURM hostlist {text!r}")
        lo, hi = match.group(1), match.group(2)
        if hi is None:
            values.append(lo)
            continue
        if int(hi) < int(lo):
            raise ValueError(f"descending range {item!r} in SLURM hostlist {text!r}")
        width = len(lo)
        values.extend(str(n).zfill(width) for n in range(int(lo), int(hi) + 1))
    return values


def _expand_host(pattern: str, text: str) -> list[str]:
    """Expand every [...] of one host pattern (several brackets give their product)."""
    match = re.search(r"\[([^\[\]]*)\]", pattern)
    if match is None:
        if "[" in pattern or "]" in pattern:
            raise ValueError(f"bad host pattern {pattern!r} in SLURM hostlist {text!r}")
        return [pattern]
    prefix, suffix = pattern[: match.start()], pattern[match.end():]
    hosts = []
    for value in _expand_range_list(match.group(1), text):
        hosts.extend(_expand_host(prefix + value + suffix, text))
    return hosts


def parse_slurm_hostlist(hostlist: str) -> list[str]:
    """Expand SLURM's compressed hostlist syntax, in order.

    >>> parse_slurm_hostlist("gpu[01-03,07],cpu5")
    ['gpu01', 'gpu02', 'gpu03', 'gpu07', 'cpu5']
    """
    if not hostlist or not hostlist.strip():
        raise ValueError("empty SLURM hostlist")
    hosts: list[str] = []
    for pattern in _split_top_level(hostlist.strip()):
        hosts.extend(_expand_host(pattern, hostlist))
    return hosts


# Rendezvous ports are drawn from LISTEN_PORT_FLOOR up to the start of the ephemeral range. The
# floor sits above the SGLang engines' own ports (`sglang.engine.engine_ports`: 20000 + 2 * 64 * 8).
LISTEN_PORT_FLOOR = 22000
EPHEMERAL_RANGE_FILE = "/proc/sys/net/ipv4/ip_local_port_range"
LINUX_DEFAULT_EPHEMERAL_RANGE = (32768, 60999)
PORT_DRAWS = 64


def ephemeral_port_range(path: str = EPHEMERAL_RANGE_FILE) -> tuple[int, int]:
    """The ports the kernel hands out to outgoing connections and to binds of port 0 (Linux's
    `ip_local_port_range`; its default where the file cannot be read, as on macOS)."""
    try:
        low, high = (int(part) for part in open(path).read().split())
    except (OSError, ValueError):
        return LINUX_DEFAULT_EPHEMERAL_RANGE
    return low, high


def _nothing_listens(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind((host, port))  # no SO_REUSEADDR: a port still in TIME_WAIT counts as taken
        except OSError:
            return False
    return True


def find_free_port(
    host: str = "127.0.0.1",
    rng: Optional[random.Random] = None,
    is_free: Optional[Callable[[str, int], bool]] = None,
    ephemeral: Optional[tuple[int, int]] = None,
) -> int:
    """A TCP port for a rendezvous server that a launcher will bind in a moment: free now and drawn
    at random below the ephemeral range.

    Why not the OS's pick (bind to port 0): that port is an ephemeral one, and between this check and
    the launcher's bind the kernel may give it to any outgoing connection on the machine (gloo's
    pairs, vLLM's and SGLang's sockets, another test's ranks): CI saw torchrun fail with EADDRINUSE
    that way. Below the range only an explicit listener can take the port, and a random draw from
    some ten thousand makes two launchers that start together unlikely to meet. Where the ephemeral
    range leaves no room below it, the OS's pick is the fallback.
    """
    rng = rng or random.SystemRandom()
    is_free = is_free or _nothing_listens
    low = (ephemeral or ephemeral_port_range())[0]
    if low - LISTEN_PORT_FLOOR >= PORT_DRAWS:
        for _ in range(PORT_DRAWS):
            port = rng.randrange(LISTEN_PORT_FLOOR, low)
            if is_free(host, port):
                return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


@dataclass(frozen=True)
class LaunchEnv:
    """Where this process sits in the launch: rank, world, local rank and the rendezvous address."""

    rank: int
    world_size: int
    local_rank: int
    master_addr: str
    master_port: int
    source: str
    """"torchrun", "slurm" or "single"."""


SLURM_PORT_SPAN = 10000
"""A SLURM job's derived port is LISTEN_PORT_FLOOR + job id % SLURM_PORT_SPAN: 22000-31999, below
Linux's default ephemeral range like `find_free_port`'s (an ephemeral port can be handed to an
outgoing connection on the master node before rank 0 binds it) and above the SGLang engines' ports.
A fixed span, not the node's own `ip_local_port_range`: every task must derive the same port."""


def slurm_master_port(env: Mapping[str, str]) -> int:
    """MASTER_PORT if set, else a port derived from SLURM_JOB_ID (same on every task of the job;
    slurm/common.sh exports the same formula)."""
    if env.get("MASTER_PORT"):
        return int(env["MASTER_PORT"])
    job_id = env.get("SLURM_JOB_ID") or env.get("SLURM_JOBID")
    if not job_id or not job_id.strip().isdigit():
        raise ValueError("SLURM launch without MASTER_PORT or a numeric SLURM_JOB_ID: export MASTER_PORT in the sbatch script")
    return LISTEN_PORT_FLOOR + int(job_id) % SLURM_PORT_SPAN


def resolve_launch_env(env: Optional[Mapping[str, str]] = None, free_port: Optional[int] = None) -> LaunchEnv:
    """Read the launch environment (torchrun, then SLURM, else single process) from `env`.

    `free_port` is the port used for a single-process launch (found with `find_free_port` if None).
    """
    env = os.environ if env is None else env
    if "RANK" in env and "WORLD_SIZE" in env:
        missing = [k for k in ("MASTER_ADDR", "MASTER_PORT") if not env.get(k)]
        if missing:
            raise ValueError(f"RANK/WORLD_SIZE are set but {', '.join(missing)} is not: launch with torchrun")
        return LaunchEnv(
            rank=int(env["RANK"]),
            world_size=int(env["WORLD_SIZE"]),
            local_rank=int(env.get("LOCAL_RANK", "0")),
            master_addr=env["MASTER_ADDR"],
            master_port=int(env["MASTER_PORT"]),
            source="torchrun",
        )
    if "SLURM_PROCID" in env and "SLURM_NTASKS" in env:
        nodelist = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
        if env.get("MASTER_ADDR"):
            master = env["MASTER_ADDR"]
        elif nodelist:
            master = parse_slurm_hostlist(nodelist)[0]
        else:
            raise ValueError("SLURM launch without SLURM_JOB_NODELIST or MASTER_ADDR")
        return LaunchEnv(
            rank=int(env["SLURM_PROCID"]),
            world_size=int(env["SLURM_NTASKS"]),
            local_rank=int(env.get("SLURM_LOCALID", "0")),
            master_addr=master,
            master_port=slurm_master_port(env),
            source="slurm",
        )
    return LaunchEnv(0, 1, 0, "127.0.0.1", free_port or find_free_port(), "single")
