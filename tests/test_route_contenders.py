"""The contenders of bench/route/route_slo.py (medha/benchmark/routers.py): names, the command lines
that start them, and the Missing error a bench turns into a skipped line. Starting real
routers is the bench's job (it needs the peers' wheels and two model replicas)."""

import os
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from medha.benchmark import routers
from medha.benchmark.routers import CONTENDERS, Missing, contender, router_command

REPLICAS = ["http://127.0.0.1:9001", "http://127.0.0.1:9002"]


def _fake_venv(tmp_path, *names):
    (tmp_path / "bin").mkdir(parents=True)
    for name in names:
        exe = tmp_path / "bin" / name
        exe.write_text("#!/bin/sh\n")
        exe.chmod(exe.stat().st_mode | stat.S_IXUSR)
    return tmp_path


def test_every_contender_parses_and_unknown_ones_are_refused():
    kinds = {contender(n).router for n in CONTENDERS}
    assert kinds == {"sglang", "vllm-router", "medha"}
    assert contender("medha-slack").policy == "slack"
    assert contender("vllm-router-consistent_hash").policy == "consistent_hash"
    for bad in ("medha-fcfs", "sglang-round_robin", "nginx"):
        with pytest.raises(ValueError, match="unknown contender"):
            contender(bad)


def test_peer_commands_from_the_venv(tmp_path, monkeypatch):
    venv = _fake_venv(tmp_path, "sglang-router", "vllm-router")
    monkeypatch.setenv("MEDHA_ROUTERS_VENV", str(venv))
    sg = router_command(contender("sglang-cache_aware"), REPLICAS, 7000, 7001)
    assert sg[:2] == [str(venv / "bin" / "sglang-router"), "launch"]
    assert sg[sg.index("--worker-urls") + 1 : sg.index("--worker-urls") + 3] == REPLICAS
    # a Prometheus port of its own: the default 29000 would collide between routers
    assert sg[sg.index("--prometheus-port") + 1] == "7001"
    vr = router_command(contender("vllm-router-consistent_hash"), REPLICAS, 7000, 7001)
    assert vr[0] == str(venv / "bin" / "vllm-router")
    assert vr[vr.index("--policy") + 1] == "consistent_hash"
    assert vr[vr.index("--port") + 1] == "7000"


def test_medha_route_command():
    cmd = router_command(contender("medha-least_work"), REPLICAS, 7000, 7001)
    assert cmd[1:4] == ["-m", "medha", "route"]
    assert [cmd[i + 1] for i, a in enumerate(cmd) if a == "--replica"] == REPLICAS
    assert cmd[cmd.index("--dispatcher") + 1] == "least_work"
    assert "--prometheus-port" not in cmd


def test_a_missing_peer_raises_missing(tmp_path, monkeypatch):
    monkeypatch.setenv("MEDHA_ROUTERS_VENV", str(_fake_venv(tmp_path)))
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(Missing, match="vllm-router is not installed"):
        routers.check_installed("vllm-router-cache_aware")
    # found on PATH when the venv lacks it
    path_dir = tmp_path / "elsewhere"
    _fake_venv(path_dir, "vllm-router")
    monkeypatch.setenv("PATH", str(path_dir / "bin") + os.pathsep + str(tmp_path))
    routers.check_installed("vllm-router-cache_aware")


def test_a_routers_cpu_time_counts_its_children():
    # a shell (the router's launcher) whose child spins for 0.3 s of CPU: the parent's own
    # time is near 0, the tree's is the child's
    spin = "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.3: pass\n"
    shell = subprocess.Popen(["sh", "-c", f'{sys.executable} -c "{spin}"; sleep 5'])
    try:
        deadline = time.monotonic() + 30
        while (spent := routers.cpu_seconds(shell.pid)) < 0.3:
            assert time.monotonic() < deadline, spent
            time.sleep(0.05)
        assert spent < 3.0  # the child's 0.3 s and the interpreters' start-up, not the wall
    finally:
        shell.kill()
        shell.wait()


def _route_slo():
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench" / "route"))
    import route_slo

    return route_slo


def _req(index, sent_s, ttft_s, tokens, e2e_s=0.5, status="ok", turn=0):
    return {"index": index, "turn": turn, "sent_s": sent_s, "ttft_s": ttft_s, "e2e_s": e2e_s,
            "status": status, "prompt_tokens": tokens, "est_prompt_tokens": tokens,
            "cached_tokens": 0, "target_s": 1.0, "completion_tokens": 4}  # fmt: skip


def test_the_short_p99_floor_is_each_cells_first_request_alone_and_the_slowest_are_named():
    route_slo = _route_slo()
    fit = [0.0, 1e-3, 0.0]  # 1 ms a token alone
    # a later turn that was never sent (its sent_s left at 0) is not the cell's first request
    unsent = _req(9, 0.0, None, 10, e2e_s=None, status="not sent", turn=1)
    cells = [
        {"round": rnd, "wall_s": 10.0, "slo_field_forwarded": True, "replicas": [], "requests": [
            _req(0, 0.1, 0.9, 800), _req(1, 0.2, 0.4, 600), _req(2, 0.4, 0.3, 100),
            _req(3, 5.0, 0.2, 200), _req(4, 6.0, 2.0, 2000), unsent,
        ]}
        for rnd in (0, 1)
    ]  # fmt: skip
    # 8 shorts, two of them (the firsts) at least 0.8 s alone: no router's p99 is below 0.8 s
    assert route_slo.short_p99_floor(cells, fit) == pytest.approx(0.8)
    # the long prompt (2.0 s) is not a short one; #2 was sent while #0 and #1 ran
    slowest = route_slo.slowest_short(cells, k=4)
    assert [(r["round"], r["index"], r["in_flight"], r["ttft_s"]) for r in slowest] == [
        (0, 0, 0, 0.9), (1, 0, 0, 0.9), (0, 1, 1, 0.4), (1, 1, 1, 0.4)
    ]  # fmt: skip
    assert {r["in_flight"] for r in route_slo.slowest_short(cells, k=8) if r["index"] == 2} == {2}
    table = route_slo.summarize(cells, fit)
    assert table["short"] == 8 and table["short_ttft_p99_floor_s"] == pytest.approx(0.8)
    # a cell whose first request is long puts no floor on the shorts
    cells[0]["requests"][0]["prompt_tokens"] = 1500
    cells[1]["requests"][0]["prompt_tokens"] = 1500
    assert route_slo.short_p99_floor(cells, fit) == 0.0
    assert route_slo.summarize(cells)["short_ttft_p99_floor_s"] is None


_ECHO_SERVER = """
import json, os, sys
from http.server import BaseHTTPRequestHandler, HTTPServer

class H(BaseHTTPRequestHandler):
    def do_GET(self):
        body = json.dumps({"cores": sorted(os.sched_getaffinity(0)),
                           "bind": os.environ.get("VLLM_CPU_OMP_THREADS_BIND")}).encode()
        self.send_response(200)
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *a):
        pass

HTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
"""


def test_replicas_of_another_server_each_on_a_core_of_its_own(tmp_path):
    """bench/vllm/vllm_goodput.py --replicas 2 starts vLLM replicas the way route_slo starts
    `medha serve` ones: replica i on the i-th core, its environment its own (the OpenMP
    binding of that core)."""
    import httpx

    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        pytest.skip("needs two cores")
    script = tmp_path / "echo.py"
    script.write_text(_ECHO_SERVER)

    def command(port, core):
        return routers.pinned([sys.executable, str(script), str(port)], core)

    def env(core):
        return dict(os.environ, VLLM_CPU_OMP_THREADS_BIND=str(core))

    with routers.serving_replicas(2, [], startup_s=60, command=command, env=env) as urls:
        seen = [httpx.get(u + "/health").json() for u in urls]
    assert seen == [{"cores": [c], "bind": str(c)} for c in cores[:2]]
