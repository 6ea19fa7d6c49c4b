"""The servers the vLLM benchmarks compare (medha/benchmark/vllm_servers.py) share one set of
flags: each contender's command carries every one of them."""

import argparse

from medha.benchmark.vllm_servers import (
    add_server_args,
    engine_command,
    server_command,
    server_flags,
)

# The end of a test server's script: answer every GET (its /health) with 200 on 127.0.0.1, at
# the port in sys.argv[1], for good (the script imports http.server and sys first).
SERVE_HEALTH = (
    "class H(http.server.BaseHTTPRequestHandler):\n"
    "    def do_GET(self):\n"
    "        self.send_response(200); self.end_headers()\n"
    "    def log_message(self, *a):\n"
    "        pass\n"
    "http.server.HTTPServer(('127.0.0.1', int(sys.argv[1])), H).serve_forever()\n"
)


def _flags(*argv):
    ap = argparse.ArgumentParser()
    add_server_args(ap)
    return server_flags(ap.parse_args(["--model", "/models/long", *argv]))


def _value(cmd, flag):
    return cmd[cmd.index(flag) + 1]


def test_every_server_gets_the_context_asked_for():
    """--max-model-len reaches plain vLLM, vLLM with medha's scheduler (behind either front end)
    and medha's own engine: a longer context than SmolLM2's (a copy of it whose config.json
    allows one) runs on every contender, or the comparison would not be of one prompt."""
    flags = _flags("--max-model-len", "16384")
    commands = [
        server_command(flags, None)(8000),
        server_command(flags, {"policy": "lars"})(8000),
        server_command(flags, {"policy": "lars"}, front="medha")(8000),
        engine_command(flags, {})(8000),
    ]
    for cmd in commands:
        assert _value(cmd, "--max-model-len") == "16384"
        assert _value(cmd, "--model") == "/models/long"
    assert _value(server_command(_flags(), None)(8000), "--max-model-len") == "8192"


def test_every_server_runs_float32_where_the_cpu_has_no_bf16(monkeypatch):
    """--dtype auto is resolved once, by medha's engine's rule, and every contender gets the
    result: on a CPU without bf16 instructions, float32 (vLLM's own auto would run the
    checkpoint's bf16 emulated: 1.75x slower on a 6,000-token prompt on an Ice Lake Xeon, a
    peer no user would keep); elsewhere vLLM's choice; an explicit dtype as given."""
    from medha.perf import hardware_specs

    for has_bf16, auto in ((False, "float32"), (True, "auto")):
        monkeypatch.setattr(hardware_specs, "cpu_has_bf16", lambda has=has_bf16: has)
        for argv, want in (((), auto), (("--dtype", "bfloat16"), "bfloat16")):
            flags = _flags(*argv)
            commands = [
                server_command(flags, None, vllm_args="--long-prefill-token-threshold 256")(8000),
                server_command(flags, {"policy": "lars"})(8000),
                server_command(flags, {"policy": "lars"}, front="medha")(8000),
                engine_command(flags, {})(8000),
            ]
            assert {_value(cmd, "--dtype") for cmd in commands} == {want}


def test_a_benchmark_stopped_by_sigterm_stops_its_server(tmp_path):
    """A benchmark's server outlives no SIGTERM of the benchmark (`pkill -f bench/...`, a CI's
    timeout): `local_server` stops it on the way out, where Python's default SIGTERM would end
    the benchmark at once and leave a server holding both cores (it did, behind a vLLM convoy
    run). The server here is a few lines that answer /health and record their pid."""
    import os
    import signal
    import subprocess
    import sys
    import time

    pid_file = tmp_path / "server.pid"
    server = (
        "import http.server, os, sys\n"
        f"open({str(pid_file)!r}, 'w').write(str(os.getpid()))\n" + SERVE_HEALTH
    )
    bench = (
        "import sys, time\n"
        "from medha.benchmark.local_server import local_server\n"
        f"with local_server(lambda port: [sys.executable, '-c', {server!r}, str(port)]):\n"
        "    print('up', flush=True)\n"
        "    time.sleep(600)\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", bench], stdout=subprocess.PIPE, text=True)
    server_pid = None
    try:
        assert proc.stdout.readline().strip() == "up"
        server_pid = int(pid_file.read_text())
        os.kill(server_pid, 0)  # (alive)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 128 + signal.SIGTERM
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                os.kill(server_pid, 0)
            except ProcessLookupError:
                break
            time.sleep(0.1)
        else:
            raise AssertionError("the server outlived the benchmark's SIGTERM")
    finally:
        proc.kill()
        if server_pid is not None:
            try:
                os.kill(server_pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def test_a_server_that_lost_its_port_for_a_moment_is_started_again(tmp_path):
    """A port found free may be taken before the server binds it, by a client connection's
    ephemeral port that is gone again by the time anyone looks (a vLLM server in CI exited
    with "[Errno 98] ... address already in use"). Its log says so: `local_server` starts it
    again on another port. A server that fails for another reason is not started again."""
    import sys

    import pytest

    from medha.benchmark.local_server import local_server

    starts = tmp_path / "starts"
    server = (
        "import http.server, pathlib, sys\n"
        f"starts = pathlib.Path({str(starts)!r})\n"
        "n = len(starts.read_text()) if starts.exists() else 0\n"
        "starts.write_text('x' * (n + 1))\n"
        "if n == 0 or sys.argv[2] == 'broken':\n"
        "    print('ERROR: [Errno 98] address already in use' if n == 0 else 'no model')\n"
        "    sys.exit(1)\n" + SERVE_HEALTH
    )
    with open(tmp_path / "server.log", "w") as log:
        with local_server(lambda port: [sys.executable, "-c", server, str(port), "ok"], log=log,
                          startup_s=60) as url:  # fmt: skip
            assert url.startswith("http://127.0.0.1:")
    assert starts.read_text() == "xx"  # (the port it lost was free: only the log told)

    starts.write_text("x")  # the next start is its second: it fails, saying nothing of ports
    with open(tmp_path / "broken.log", "w") as log:
        with pytest.raises(RuntimeError):
            with local_server(lambda port: [sys.executable, "-c", server, str(port), "broken"],
                              log=log, startup_s=60):  # fmt: skip
                raise AssertionError("a broken server came up")
    assert starts.read_text() == "xx"  # started once, not again
