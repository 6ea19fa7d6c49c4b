"""Hostile requests against one `medha serve` (default flags, no API key), with an innocent
streaming request in flight during each.

    python bench/server/server_hostile.py [--sizes-mb 50,500] [--json out.json]

For each hostile body the table gives its status code, the time to the answer, `/health` after
it, and whether the innocent request (a greedy 48-token completion, streamed) finished with the
same text chunks as in a quiet run. Large bodies are sent on a raw socket, generated as they
go (the client never holds them), three ways: a string prompt with Content-Length, a token-id
list with Content-Length, and a string prompt in chunked transfer encoding (no length up
front). For those the table also gives the server's peak RSS growth while it answered (VmHWM,
reset before each through /proc/PID/clear_refs) and its RSS once it had answered. Last, 50
bodies of about 1 MB each (under the size limit, over the context) twice, a string prompt and
a token-id list: refused with 400 after parsing, the slowest refusal and the RSS before and
after all 50 (does memory return to its baseline?).
"""

from __future__ import annotations

import argparse
import json
import socket
import sys
import threading
import time
from pathlib import Path

import httpx

from medha.benchmark.local_server import local_server

INNOCENT = {
    "prompt": "The history of the printing press begins",
    "max_tokens": 48,
    "temperature": 0,
    "ignore_eos": True,
    "stream": True,
}

HI = {"prompt": "Hi", "max_tokens": 2}
# (name, body: a dict sent as JSON, or raw bytes/text): the four killers first, then
# other schema-valid oddities
KILLERS = [
    ("top_p 1e-300", HI | {"temperature": 1, "top_p": 1e-300}),
    ("top_p 1e-46", HI | {"temperature": 1, "top_p": 1e-46}),
    ("temperature 1e-40", HI | {"temperature": 1e-40}),
    ("seed 2**64", HI | {"temperature": 1, "seed": 2**64}),
    ("lone surrogate", '{"prompt": "\\ud800", "max_tokens": 2}'),
    ("invalid UTF-8", b'{"prompt": "\xff\xfe", "max_tokens": 2}'),
    ("surrogate in model", '{"prompt": "Hi", "max_tokens": 2, "model": "\\udfff"}'),
    ("chat surrogate", '{"messages": [{"role": "user", "content": "a\\ud800"}], "max_tokens": 2}'),
    ("seed -2**63-1", HI | {"temperature": 1, "seed": -(2**63) - 1}),
    ("top_k 2**70", HI | {"temperature": 1, "top_k": 2**70}),
    ("max_tokens 2**70", HI | {"max_tokens": 2**70}),
    ("token id 2**64", {"prompt": [1, 2**64], "max_tokens": 2}),
    ("stop 100k chars", HI | {"stop": "x" * 100_000}),
    ("nested 100k deep", '{"prompt": ' + "[" * 100_000 + "]" * 100_000 + "}"),
    ("stream_options only", HI | {"stream_options": {"include_usage": True}}),
    ("best_of 0", HI | {"best_of": 0}),
]


class Innocent(threading.Thread):
    """The innocent request: streams its text chunks into `chunks`; `started` is set at the
    first one."""

    def __init__(self, url: str) -> None:
        super().__init__(daemon=True)
        self.url, self.chunks, self.error = url, [], None
        self.started = threading.Event()

    def run(self) -> None:
        try:
            with httpx.stream(
                "POST", self.url + "/v1/completions", json=INNOCENT, timeout=120
            ) as r:
                for line in r.iter_lines():
                    if line.startswith("data: ") and line != "data: [DONE]":
                        event = json.loads(line[6:])
                        if "error" in event:
                            self.error = event["error"]["message"]
                            break
                        self.chunks.append(event["choices"][0]["text"])
                        self.started.set()
        except Exception as e:  # noqa: BLE001 - reported in the table
            self.error = f"{type(e).__name__}: {e}"
        self.started.set()


def health(url: str) -> int:
    try:
        return httpx.get(url + "/health", timeout=10).status_code
    except httpx.HTTPError:
        return 0


def rss_kb(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def post_raw(
    url: str,
    path: str,
    head: bytes,
    fill: bytes,
    tail: bytes,
    size: int,
    chunked: bool,
    timeout: float = 120.0,
) -> tuple[int, float]:
    """POST a body of about `size` bytes (head + fill repeated + tail), generated as it is
    sent, on a raw socket; returns (status, seconds from the first byte to the status line).
    The server may answer and close before the body is all sent: sending stops there."""
    host, port = url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)), timeout=timeout)
    n_fill = max(0, (size - len(head) - len(tail)) // len(fill))
    length = len(head) + n_fill * len(fill) + len(tail)
    headers = (
        f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
        + ("Transfer-Encoding: chunked\r\n" if chunked else f"Content-Length: {length}\r\n")
        + "Connection: close\r\n\r\n"
    ).encode()
    done = threading.Event()

    def send() -> None:
        def pieces():
            yield head
            block = fill * max(1, (1 << 20) // len(fill))
            left = n_fill
            while left > 0:
                k = min(left, len(block) // len(fill))
                yield block[: k * len(fill)]
                left -= k
            yield tail

        try:
            for piece in pieces():
                if done.is_set():
                    return
                sock.sendall(b"%x\r\n%s\r\n" % (len(piece), piece) if chunked else piece)
            if chunked:
                sock.sendall(b"0\r\n\r\n")
        except OSError:
            pass  # the server answered and closed: the rest is never read

    t0 = time.perf_counter()
    sock.sendall(headers)
    sender = threading.Thread(target=send, daemon=True)
    sender.start()
    data = b""
    while b"\r\n" not in data:
        got = sock.recv(65536)
        if not got:
            break
        data += got
    elapsed = time.perf_counter() - t0
    done.set()
    sock.close()
    sender.join(timeout=30)
    status = int(data.split(b" ", 2)[1]) if data.startswith(b"HTTP/") else 0
    return status, elapsed


def run_killer(url: str, quiet: list[str], name: str, body: dict | str | bytes) -> dict:
    innocent = Innocent(url)
    innocent.start()
    innocent.started.wait(60)
    raw = (
        body
        if isinstance(body, bytes)
        else (body if isinstance(body, str) else json.dumps(body)).encode()
    )
    path = "/v1/chat/completions" if raw.startswith(b'{"messages"') else "/v1/completions"
    t0 = time.perf_counter()
    try:
        r = httpx.post(
            url + path, content=raw, headers={"Content-Type": "application/json"}, timeout=120
        )
        status, answer = r.status_code, r.text[:160]
    except httpx.HTTPError as e:
        status, answer = 0, f"{type(e).__name__}: {e}"
    seconds = time.perf_counter() - t0
    after = health(url)
    innocent.join(120)
    return {
        "case": name,
        "status": status,
        "seconds": round(seconds, 3),
        "health": after,
        "innocent_identical": innocent.chunks == quiet and innocent.error is None,
        "innocent_error": innocent.error,
        "answer": answer,
    }


def run_big(url: str, pid: int, kind: str, mb: int) -> dict:
    size = mb * 10**6
    if kind == "token ids":
        head, fill, tail, chunked = b'{"prompt": [1', b", 1234", b'], "max_tokens": 2}', False
    else:
        head, fill, tail = b'{"prompt": "', b"hello world ", b'", "max_tokens": 2}'
        chunked = kind == "string, chunked"
    Path(f"/proc/{pid}/clear_refs").write_text("5")  # reset VmHWM to the current RSS
    before = rss_kb(pid, "VmRSS")
    status, seconds = post_raw(url, "/v1/completions", head, fill, tail, size, chunked)
    time.sleep(0.5)
    return {
        "case": f"{mb} MB {kind}",
        "status": status,
        "seconds": round(seconds, 3),
        "health": health(url),
        "peak_rss_growth_mb": round((rss_kb(pid, "VmHWM") - before) / 1024, 1),
        "rss_after_mb": round(rss_kb(pid, "VmRSS") / 1024, 1),
        "rss_before_mb": round(before / 1024, 1),
    }


def run_refused(url: str, pid: int, kind: str, count: int = 50) -> dict:
    """`count` bodies of about 1 MB (under the default size limit for SmolLM2, over its
    context), refused with 400 after parsing: the slowest refusal, and RSS before, at its peak
    and after."""
    prompt = "hello world " * 87_000 if kind == "string" else [1234] * 170_000
    body = json.dumps({"prompt": prompt, "max_tokens": 2}).encode()
    Path(f"/proc/{pid}/clear_refs").write_text("5")
    before, slowest, statuses = rss_kb(pid, "VmRSS"), 0.0, set()
    for _ in range(count):
        t0 = time.perf_counter()
        r = httpx.post(
            url + "/v1/completions",
            content=body,
            headers={"Content-Type": "application/json"},
            timeout=120,
        )
        slowest = max(slowest, time.perf_counter() - t0)
        statuses.add(r.status_code)
    time.sleep(0.5)
    return {
        "case": f"{count} x {len(body) / 1e6:.1f} MB {kind}",
        "status": min(statuses),
        "statuses": sorted(statuses),
        "seconds": round(slowest, 3),
        "health": health(url),
        "peak_rss_growth_mb": round((rss_kb(pid, "VmHWM") - before) / 1024, 1),
        "rss_after_mb": round(rss_kb(pid, "VmRSS") / 1024, 1),
        "rss_before_mb": round(before / 1024, 1),
    }


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--sizes-mb", default="50,500", help="large body sizes (default: 50,500)")
    ap.add_argument("--json", help="also write the rows to this file")
    ap.add_argument("serve_flags", nargs="*", help="extra flags for medha serve (after --)")
    args = ap.parse_args()
    sizes = [int(s) for s in args.sizes_mb.split(",") if s]
    with local_server(
        lambda port: [
            sys.executable,
            "-m",
            "medha",
            "serve",
            "--port",
            str(port),
            "--log-level",
            "error",
            *args.serve_flags,
        ],
        quiet=True,
        with_process=True,
    ) as (url, proc):
        quiet_run = Innocent(url)
        quiet_run.run()
        if quiet_run.error or not quiet_run.chunks:
            sys.exit(f"the innocent request failed on a quiet server: {quiet_run.error}")
        rows = [run_killer(url, quiet_run.chunks, name, body) for name, body in KILLERS]
        rows += [
            run_big(url, proc.pid, kind, mb)
            for mb in sizes
            for kind in ("string", "token ids", "string, chunked")
        ]
        rows += [run_refused(url, proc.pid, kind) for kind in ("string", "token ids")]
        final = Innocent(url)
        final.run()
        alive = proc.poll() is None
    print(f"{'case':24s} {'status':>6s} {'seconds':>8s} {'health':>6s}  innocent / memory")
    for r in rows:
        tail = (
            f"identical={r['innocent_identical']}"
            + (f" ({r['innocent_error']})" if r["innocent_error"] else "")
            if "innocent_identical" in r
            else f"peak RSS +{r['peak_rss_growth_mb']} MB, RSS {r['rss_before_mb']} -> "
            f"{r['rss_after_mb']} MB"
        )
        print(f"{r['case']:24s} {r['status']:6d} {r['seconds']:8.3f} {r['health']:6d}  {tail}")
    print(
        f"server alive at the end: {alive}; a last innocent request identical: "
        f"{final.chunks == quiet_run.chunks}"
    )
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
