"""The routers `bench/route/route_slo.py` puts in front of `medha serve` replicas, started as
subprocesses and stopped cleanly: medha's own (`medha route`, one contender per dispatcher) and
two peers, SGLang's router and vLLM's router, with their prefix-aware policies.

The peers are Rust binaries in PyPI wheels (sglang-router, vllm-router). They live in a virtual
environment of their own, never medha's: they are benchmark contenders, not dependencies, and
their wheels bring packages medha does not pin. Found in `$MEDHA_ROUTERS_VENV`, else
~/.cache/medha/routers-venv, else on PATH; `install_peers` creates that environment
(`--install-peers`).

What the peers do with medha's replicas, checked at sglang-router 0.3.2 and vllm-router 0.1.17
(both route /v1/completions and /v1/chat/completions, streamed or not):

- sglang's /health answers 200 at once, before its workers are registered (that runs in the
  background): ready means its GET /workers lists every replica healthy (about 1 s).
- sglang asks each worker for /server_info and /model_info, which medha does not serve, and
  registers the model as "unknown": its /v1/models lists "unknown", and a request naming
  "unknown" reaches a replica that answers 404. Clients must send the replica's model name
  (a replica's own /v1/models), which sglang forwards unchanged.
- sglang rebuilds a chat request from its own typed struct and drops the fields it does not
  know: the `medha` object (per-request TTFT target) is lost on /v1/chat/completions, kept on
  /v1/completions; the replica then sets its default deadline. vllm-router forwards both.
- both export Prometheus metrics on port 29000 by default (sglang on 0.0.0.0, and it panics at
  start-up if the port is taken): every router here gets a free loopback port of its own.
- vllm-router waits until its workers answer /health before it serves (about 1.5 s to ready).
  Its consistent_hash keys on the X-Session-ID header (then X-User-ID, X-Tenant-ID,
  X-Request-ID, ..., the body's `user`), else on a hash of the whole body: without a session
  header it spreads requests at random.
- both retry a failed request (--retry-max-retries, 5 by default) and stop within ~3 s of
  SIGTERM when idle (sglang waits up to its --shutdown-grace-period-secs, 180 s, for
  in-flight requests).
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx

from medha.utils.net import free_port, stop_processes, wait_healthy

PEER_PACKAGES = ("sglang-router==0.3.2", "vllm-router==0.1.17")
MEDHA_DISPATCHERS = ("slack", "round_robin", "least_work", "prefix", "pla")
# contender name -> (router, policy or dispatcher)
PEERS = {
    "sglang-cache_aware": ("sglang", "cache_aware"),
    # (the load balancing a user picks where prompts share little: the less loaded of two
    # replicas drawn at random)
    "sglang-power_of_two": ("sglang", "power_of_two"),
    "vllm-router-cache_aware": ("vllm-router", "cache_aware"),
    "vllm-router-consistent_hash": ("vllm-router", "consistent_hash"),
}
CONTENDERS = [*PEERS, *(f"medha-{d}" for d in MEDHA_DISPATCHERS)]


class Missing(Exception):
    """A contender that cannot run on this machine (its router is not installed); the bench
    reports it as skipped and goes on."""


@dataclass(frozen=True)
class Contender:
    name: str
    router: str  # "sglang", "vllm-router" or "medha"
    policy: str  # the peer's --policy, or medha's --dispatcher


def contender(name: str) -> Contender:
    if name in PEERS:
        return Contender(name, *PEERS[name])
    dispatcher = name.removeprefix("medha-")
    if name.startswith("medha-") and dispatcher in MEDHA_DISPATCHERS:
        return Contender(name, "medha", dispatcher)
    raise ValueError(f"unknown contender {name!r}; known: {', '.join(CONTENDERS)}")


def routers_venv() -> Path:
    from medha.perf.hardware_specs import cache_dir

    return Path(os.environ.get("MEDHA_ROUTERS_VENV") or cache_dir() / "routers-venv")


def install_peers(venv: Path | None = None) -> Path:
    """Create the peers' virtual environment (if needed) and pip-install them into it."""
    venv = venv or routers_venv()
    if not (venv / "bin" / "python").exists():
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    subprocess.run([str(venv / "bin" / "pip"), "install", "-q", *PEER_PACKAGES], check=True)
    return venv


def _peer_program(router: str) -> list[str]:
    """The command that starts a peer, before its flags: the venv's executable first (each
    wheel installs one), then one on PATH."""
    exe = {"sglang": "sglang-router", "vllm-router": "vllm-router"}[router]
    venv_exe = routers_venv() / "bin" / exe
    path = str(venv_exe) if venv_exe.exists() else shutil.which(exe)
    if path is None:
        raise Missing(
            f"{exe} is not installed (looked in {routers_venv()}/bin and on PATH; "
            f"--install-peers or `pip install {' '.join(PEER_PACKAGES)}` in $MEDHA_ROUTERS_VENV)"
        )
    # sglang-router's own CLI takes the launcher's flags after `launch`
    return [path, "launch"] if router == "sglang" else [path]


def check_installed(name: str) -> None:
    """Raise Missing when contender `name` cannot start here: a peer not installed, or a
    checkout without `medha route`."""
    c = contender(name)
    if c.router != "medha":
        _peer_program(c.router)
    elif importlib.util.find_spec("medha.route") is None:
        raise Missing("`medha route` (the medha.route package) is not in this checkout")


def router_command(
    c: Contender, replicas: list[str], port: int, metrics_port: int, medha_flags=()
) -> list[str]:
    """The command line that puts contender `c` on 127.0.0.1:`port` in front of `replicas`
    (`medha_flags`: more `medha route` flags, for medha's contenders)."""
    if c.router == "medha":
        cmd = [sys.executable, "-m", "medha", "route"]
        for url in replicas:
            cmd += ["--replica", url]
        cmd += ["--host", "127.0.0.1", "--port", str(port), "--dispatcher", c.policy]
        return cmd + list(medha_flags)
    cmd = _peer_program(c.router)
    cmd += ["--worker-urls", *replicas, "--policy", c.policy]
    cmd += ["--host", "127.0.0.1", "--port", str(port)]
    cmd += ["--prometheus-host", "127.0.0.1", "--prometheus-port", str(metrics_port)]
    return cmd + ["--log-level", "warn" if c.router == "sglang" else "warning"]


def _ready(c: Contender, url: str, replicas: int) -> bool:
    try:
        if httpx.get(url + "/health", timeout=2).status_code != 200:
            return False
        if c.router == "medha":
            # /health is 200 once one replica is in: every replica's up gauge says all are
            metrics = httpx.get(url + "/metrics", timeout=2).text.splitlines()
            up = [m for m in metrics if m.startswith("medha_router_replica_up{")]
            return sum(float(m.split()[-1]) == 1 for m in up) == replicas
        # the peers' /health is the router's own; their worker list says who is registered
        workers = httpx.get(url + "/workers", timeout=2).json().get("workers", [])
    except (httpx.HTTPError, ValueError):
        return False
    return len(workers) == replicas and all(w.get("is_healthy") for w in workers)


def cpu_seconds(pid: int) -> float:
    """CPU time (user + system) spent so far by process `pid` and its descendants, from /proc:
    on a machine where the router shares the replicas' cores, what it took from them. A live
    process's own time, plus that of its children that ended and were waited for (cutime,
    cstime: an ended child's time leaves the tree otherwise, which made a spinning child's
    0.3 s visible only in the instants before it exited)."""
    tick = os.sysconf("SC_CLK_TCK")
    parent, spent = {}, {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:  # exited while we looked
            continue
        # after the command's ")": state ppid ... utime (12th) stime cutime cstime (15th)
        parent[int(stat.parent.name)] = int(fields[1])
        spent[int(stat.parent.name)] = sum(int(f) for f in fields[11:15]) / tick
    # down the tree from `pid` (by parent, not by pid order: pids wrap around at pid_max, 32,768
    # by default, and a long-lived machine hands a child a smaller pid than its parent's)
    children: dict[int, list[int]] = {}
    for p, pp in parent.items():
        children.setdefault(pp, []).append(p)
    todo, total = [pid], 0.0
    while todo:
        p = todo.pop()
        total += spent.get(p, 0.0)
        todo.extend(children.get(p, ()))
    return total


@contextmanager
def running_router(
    name: str, replicas: list[str], log=None, startup_s: float = 60.0, medha_flags=()
) -> Iterator[tuple[str, list[str], int]]:
    """Start contender `name` in front of `replicas` (base URLs), wait until it routes to all
    of them, yield (its base URL, its command line, its pid); SIGTERM (then kill) on the way
    out. Raises Missing when its router is not installed. `log`: an open file for its output."""
    c = contender(name)
    port = free_port()
    cmd = router_command(c, replicas, port, free_port(), medha_flags)
    out = log if log is not None else subprocess.DEVNULL
    proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + startup_s
        while not _ready(c, url, len(replicas)):
            if proc.poll() is not None:
                raise RuntimeError(f"{name}: {' '.join(cmd[:4])} ... exited with {proc.returncode}")
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"{name}: not routing to {len(replicas)} replicas after {startup_s:.0f} s"
                )
            time.sleep(0.2)
        yield url, cmd, proc.pid
    finally:
        stop_processes([proc], 15.0)


def replica_command(port: int, flags: list[str], core: int | None) -> list[str]:
    """`medha serve` on `port`, bound to one core with taskset when `core` is given (each
    replica then has a core of its own, as each would have its own GPU)."""
    cmd = [sys.executable, "-m", "medha", "serve", "--port", str(port), "--log-level", "warning"]
    return pinned(cmd + flags, core)


def pinned(cmd: list[str], core: int | None) -> list[str]:
    """`cmd` bound to `core` with taskset (its threads and children too); unbound for None."""
    return (["taskset", "-c", str(core)] if core is not None else []) + cmd


@contextmanager
def serving_replicas(
    n: int,
    flags: list[str],
    pin: bool = True,
    log=None,
    startup_s: float = 300.0,
    command: Callable[[int, int | None], list[str]] | None = None,
    env: Callable[[int | None], dict] | None = None,
) -> Iterator[list[str]]:
    """Start `n` `medha serve` replicas with `flags` at once (one core each with `pin`: replica
    i on the i-th core this process may use), wait until every /health answers 200, yield their
    base URLs; stop them all on the way out. Fresh replicas start with empty prefix caches and
    zeroed counters. `command(port, core)`: another server instead (a vLLM one), bound to
    `core` by the caller; `env(core)`: each replica's environment (default: this process's)."""
    cores = sorted(os.sched_getaffinity(0))
    if pin and (shutil.which("taskset") is None or len(cores) < n):
        raise RuntimeError(f"pinning {n} replicas needs taskset and {n} cores (or pin=False)")
    procs: list[subprocess.Popen] = []
    urls = []
    try:
        for i in range(n):
            port = free_port()
            core = cores[i] if pin else None
            cmd = command(port, core) if command else replica_command(port, flags, core)
            proc = subprocess.Popen(
                cmd,
                stdout=log or subprocess.DEVNULL,
                stderr=subprocess.STDOUT,
                env=env(core) if env else None,
            )
            procs.append(proc)
            urls.append(f"http://127.0.0.1:{port}")
        deadline = time.monotonic() + startup_s
        for proc, url in zip(procs, urls):
            wait_healthy(proc, url, deadline, f"replica {url}")
        yield urls
    finally:
        stop_processes(procs, 120.0)  # a replica drains in-flight requests for up to 30 s
