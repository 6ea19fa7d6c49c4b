"""Start an OpenAI-compatible server on a free loopback port for a benchmark (or a test that
drives one, tests/test_vllm_executor.py), and stop it."""

from __future__ import annotations

import signal
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

from medha.utils.net import free_port, wait_healthy

START_TRIES = 3  # starts on a fresh free port, when another process took the one picked


def alternated(names: list[str], rounds: int) -> Iterator[tuple[int, str]]:
    """(round, contender) in the order a side-by-side benchmark runs them: the order flips
    every round, since a 2-core machine's speed drifts over minutes."""
    for rnd in range(rounds):
        for name in names if rnd % 2 == 0 else names[::-1]:
            yield rnd, name


@contextmanager
def local_server(
    command: Callable[[int], list[str]],
    quiet: bool = False,
    startup_s: float = 300.0,
    with_process: bool = False,
    log=None,
    port: int | None = None,
    env: dict | None = None,
) -> Iterator:
    """Run `command(port)`, wait until its /health answers 200, yield its base URL (with
    `with_process`, the pair (URL, Popen)); SIGTERM (then kill) on the way out. `log`: an
    open file that gets the server's stdout and stderr. `port`: this one rather than a free one.
    `env`: the server's environment (default: this process's).

    A port found free is free only then: a server that exits at start-up while another
    process holds its port, or whose `log` says its port was in use, is started again on
    another (START_TRIES in all). A SIGTERM to this process (`pkill -f bench/...`, a CI's
    timeout) stops the server too (`_terminate_as_exit`): Python's own handling of it ends the
    process without leaving the `with`, which left a vLLM server holding both cores behind a
    benchmark that was gone."""
    with _terminate_as_exit():
        out = log if log is not None else subprocess.DEVNULL if quiet else None
        deadline = time.monotonic() + startup_s
        for attempt in range(1, START_TRIES + 1):
            chosen = port or free_port()
            mark = _log_end(log)
            proc = subprocess.Popen(
                command(chosen), stdout=out, stderr=subprocess.STDOUT if log else out, env=env
            )
            url = f"http://127.0.0.1:{chosen}"
            try:
                wait_healthy(proc, url, deadline, str(command(chosen)[:3]))
                break
            except RuntimeError:
                lost = (
                    port is None
                    and proc.poll() is not None
                    and lost_port(chosen, _log_since(log, mark))
                )
                if not lost or attempt == START_TRIES:
                    _stop(proc)
                    raise
        try:
            yield (url, proc) if with_process else url
        finally:
            _stop(proc)


@contextmanager
def _terminate_as_exit() -> Iterator[None]:
    """Within it, SIGTERM raises SystemExit (143), so that the `finally`s around it run, where
    SIGTERM is left to Python's default (which ends the process at once) and this is the main
    thread (the only one that may set a handler); elsewhere, nothing changes."""
    main = threading.current_thread() is threading.main_thread()
    if not main or signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
        yield
        return

    def exit_(signum, frame):
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, exit_)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(120)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def _log_end(log) -> int | None:
    """Where the server's log (an open file, or None) ends now: what a start writes comes
    after it."""
    name = getattr(log, "name", None)
    if not isinstance(name, str) or not Path(name).is_file():
        return None
    log.flush()
    return Path(name).stat().st_size


def _log_since(log, mark: int | None) -> str:
    """What the server wrote to its log after `mark` (`_log_end` before it started); "" where
    it has no log file."""
    if mark is None:
        return ""
    log.flush()
    with open(log.name, "rb") as f:
        f.seek(mark)
        return f.read().decode(errors="replace")


def lost_port(port: int, output: str) -> bool:
    """Whether a server that exited at start-up lost `port` to another process: some process
    holds it now, or the server's `output` says it was in use. The holder may be gone by the
    time `port_taken` looks: a client's connection whose ephemeral port was the one picked (a
    vLLM server in CI exited with "[Errno 98] ... address already in use" on a port free again
    a moment later)."""
    return port_taken(port) or "address already in use" in output


def port_taken(port: int) -> bool:
    """Whether some process holds `port` on 127.0.0.1 now (binding it fails)."""
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return True
    return False


@contextmanager
def owned_local_server(
    command: Callable[[int], list[str]],
    served_name: str,
    log_path: str | Path,
    startup_s: float = 300.0,
    attempts: int = 3,
    env: dict | None = None,
) -> Iterator[tuple[str, subprocess.Popen]]:
    """`local_server` (yielding the URL and the Popen) on a port that is the server's own.

    `local_server` starts again a server that exited because another process held its port;
    but while a server starts, another process that took its port may answer /health in its
    place. So the server is started with a name of its own (`served_name`, its
    --served-model-name), is ours only once /v1/models lists that name, and is started again on
    another port (up to `attempts` times) otherwise. Its log goes to `log_path`."""
    for _ in range(attempts):
        with ExitStack() as stack:
            out = stack.enter_context(open(log_path, "w"))
            try:
                url, proc = stack.enter_context(
                    local_server(command, log=out, startup_s=startup_s, with_process=True, env=env)
                )
            except RuntimeError as e:
                log = Path(log_path).read_text()
                raise RuntimeError(f"{e}; the end of its log:\n{log[-3000:]}") from None
            if served_name in _served_models(url):
                yield url, proc
                return
        # another server answered on the port: ours is stopped (leaving the stack), try again
    raise RuntimeError(f"{attempts} ports in a row were taken by other servers")


def _served_models(url: str) -> list[str]:
    import httpx

    try:
        return [m["id"] for m in httpx.get(url + "/v1/models", timeout=10).json()["data"]]
    except (httpx.HTTPError, ValueError, KeyError, TypeError):
        return []
