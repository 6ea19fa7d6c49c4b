"""One short chat request end to end through the API: medha serve beside transformers serve.

    python bench/server_latency.py [--repeats 10]

Both serve the same converted SmolLM2-135M-Instruct checkpoint on CPU, one at a time on a free
loopback port. After two warm-up requests, the same chat request (about 40 prompt tokens with
the chat template, max_tokens 8, greedy) is sent --repeats times with the official openai
client, non-streaming; the table gives the client-side latency.
"""

from __future__ import annotations

import argparse
import signal
import socket
import statistics
import subprocess
import sys
import time

import httpx
import openai

from medha.engine.checkpoint import resolve_model

MESSAGES = [{"role": "user", "content": "In one sentence, why is the sky blue?"}]


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def measure(name: str, command: list[str], port: int, model: str, repeats: int) -> dict:
    proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.5)
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
        times, usage = [], None
        for i in range(repeats + 2):
            t0 = time.perf_counter()
            out = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=8,
                                                 temperature=0)
            if i >= 2:
                times.append(time.perf_counter() - t0)
            usage = out.usage
        return {"name": name, "times": times, "prompt": usage.prompt_tokens,
                "completion": usage.completion_tokens, "text": out.choices[0].message.content}
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=10)
    args = ap.parse_args()
    path = str(resolve_model("smollm2"))
    runs = []
    port = _port()
    runs.append(measure("medha serve", [sys.executable, "-m", "medha", "serve", "--port",
                                        str(port), "--log-level", "warning"], port, "smollm2",
                        args.repeats))
    port = _port()
    runs.append(measure("transformers serve", ["transformers", "serve", path, "--port",
                                               str(port), "--device", "cpu"], port, path,
                        args.repeats))
    print(f"chat request: {runs[0]['prompt']} prompt tokens, max_tokens 8, greedy, "
          f"{args.repeats} repeats after 2 warm-ups\n")
    print("| server | completion tokens | median | min | max |")
    print("|---|---|---|---|---|")
    for r in runs:
        t = r["times"]
        print(f"| {r['name']} | {r['completion']} | {statistics.median(t):.3f} s | "
              f"{min(t):.3f} s | {max(t):.3f} s |")
    ratio = statistics.median(runs[1]["times"]) / statistics.median(runs[0]["times"])
    print(f"\ntransformers / medha median latency: {ratio:.2f}x (goal >= 1: medha no slower)")


if __name__ == "__main__":
    main()
