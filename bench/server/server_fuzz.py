"""schemathesis against one `medha serve`, with /health polled throughout.

    python bench/server/server_fuzz.py [--max-examples 500] [--seeds 0,1] [--model smollm2]
        [--dtype float32]

Starts one server (by default the tiny random Llama of the tests with a 64-token context, so
that every valid request finishes in well under a second; `--model smollm2` for the real
weights), then runs schemathesis (`st run`) once per seed against its /openapi.json, with
every check except positive_data_acceptance (valid-looking requests whose prompt and
max_tokens overflow the context are refused, which a schema cannot say), and an API key so
that ignored_auth is checked too. The server computes in float32 by default (`--dtype auto` is
bfloat16 on CPUs with bf16 instructions, and would take other engine paths there). A thread
polls /health every 0.2 s. Prints the cases
schemathesis generated, its failures, the health answers that were not 200, and whether the
server still serves a normal request at the end; `--json` writes the same.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

from medha.benchmark.local_server import local_server
from medha.benchmark.tiny_llama import build_tiny_llama

KEY = "fuzz-key"
POLL_S = 0.2  # between a health answer and the next poll
CHECKS = ["--checks", "all", "--exclude-checks", "positive_data_acceptance"]


class HealthPoll(threading.Thread):
    def __init__(self, url: str) -> None:
        super().__init__(daemon=True)
        self.url, self.answers, self.bad = url, 0, []
        self.done = threading.Event()

    def run(self) -> None:
        while not self.done.wait(POLL_S):
            try:
                code = httpx.get(self.url + "/health", timeout=30).status_code
            except httpx.HTTPError as e:
                code = f"{type(e).__name__}"
            self.answers += 1
            if code != 200:
                self.bad.append(code)


def run_schemathesis(url: str, max_examples: int, seed: int, report: Path) -> dict:
    command = [
        sys.executable,
        "-c",
        "from schemathesis.cli import schemathesis; schemathesis()",
        "run",
        url + "/openapi.json",
        *CHECKS,
        "--max-examples",
        str(max_examples),
        "--seed",
        str(seed),
        "--workers",
        "1",
        "--generation-database",
        "none",
        "--request-timeout",
        "120",
        "--no-color",
        "-H",
        f"Authorization: Bearer {KEY}",
        "--report",
        "json",
        "--report-json-path",
        str(report),
    ]
    # in the report's folder: schemathesis keeps a cache in its working directory
    done = subprocess.run(command, capture_output=True, text=True, cwd=report.parent)
    if not report.exists():
        raise RuntimeError(f"schemathesis wrote no report:\n{done.stdout}\n{done.stderr}")
    result = json.loads(report.read_text())
    return {
        "seed": seed,
        "exit_code": done.returncode,
        "seconds": result["running_time"],
        "cases": result["test_cases"]["generated"],
        "failures": result["failures"],
        "errors": result["errors"],
        "output_tail": done.stdout[-3000:],
    }


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--model", default=None, help="model to serve (default: the tiny random Llama of the tests)"
    )
    ap.add_argument("--max-model-len", type=int, default=64)
    ap.add_argument(
        "--dtype",
        default="float32",
        help="the server's --dtype (default: float32, the same engine paths on every CPU)",
    )
    ap.add_argument("--max-examples", type=int, default=500, help="per operation and phase")
    ap.add_argument("--seeds", default="0", help="comma-separated: one run per seed")
    ap.add_argument("--json", help="write the summary here")
    args = ap.parse_args(argv)
    model = args.model or build_tiny_llama(Path(tempfile.mkdtemp(prefix="tiny-llama-")))
    runs = []
    with local_server(
        lambda port: [
            sys.executable,
            "-m",
            "medha",
            "serve",
            "--model",
            model,
            "--port",
            str(port),
            "--max-model-len",
            str(args.max_model_len),
            "--kv-memory-gb",
            "0.05",
            "--dtype",
            args.dtype,
            "--api-key",
            KEY,
            "--log-level",
            "error",
        ],
        quiet=True,
        with_process=True,
    ) as (url, proc):
        poll = HealthPoll(url)
        poll.start()
        t0 = time.perf_counter()
        with tempfile.TemporaryDirectory() as tmp:
            for seed in (int(s) for s in args.seeds.split(",")):
                runs.append(
                    run_schemathesis(
                        url, args.max_examples, seed, Path(tmp) / f"report-{seed}.json"
                    )
                )
        wall = time.perf_counter() - t0
        poll.done.set()
        poll.join()
        after = httpx.post(
            url + "/v1/completions",
            json={"prompt": "Hello", "max_tokens": 4},
            headers={"Authorization": f"Bearer {KEY}"},
            timeout=60,
        )
        summary = {
            "cases": sum(r["cases"] for r in runs),
            "seconds": round(wall, 1),
            "failures": [f for r in runs for f in r["failures"]],
            "errors": [e for r in runs for e in r["errors"]],
            "health_polls": poll.answers,
            "poll_s": POLL_S,
            "health_not_200": poll.bad,
            "server_alive": proc.poll() is None,
            "serves_after": after.status_code,
            "runs": runs,
        }
    for r in runs:
        print(
            f"seed {r['seed']}: {r['cases']} cases in {r['seconds']:.0f} s, exit code "
            f"{r['exit_code']}, {len(r['failures'])} failures, {len(r['errors'])} errors"
        )
    print(
        f"total: {summary['cases']} cases in {summary['seconds']} s against one server; "
        f"/health polled {poll.answers} times, not 200: {len(poll.bad)}; server alive: "
        f"{summary['server_alive']}; a normal request afterwards: {after.status_code}"
    )
    if summary["failures"] or summary["errors"]:
        print(runs[-1]["output_tail"])
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=1))
    return summary


if __name__ == "__main__":
    main()
