"""One short chat request end to end through the API: medha serve beside transformers serve.

    python bench/server/server_latency.py [--repeats 10]

Both serve the same converted SmolLM2-135M-Instruct checkpoint on CPU, each on a free loopback
port, both up at once. After two warm-up requests each, the same chat request (about 40 prompt
tokens with the chat template, max_tokens 8, greedy) goes to one server then the other,
--repeats times, never two in flight: this CPU's speed drifts by 20-30% over minutes, and
alternating puts both servers under the same drift. The official openai client, non-streaming;
the table gives the client-side latency.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from contextlib import ExitStack

import openai

from medha.benchmark.local_server import local_server
from medha.engine.checkpoint import resolve_model

MESSAGES = [{"role": "user", "content": "In one sentence, why is the sky blue?"}]


def measure(servers: list[tuple[str, object, str]], repeats: int) -> list[dict]:
    """servers: (name, command, model name). Requests alternate between them."""
    with ExitStack() as stack:
        runs = []
        for name, command, model in servers:
            url = stack.enter_context(local_server(command, quiet=True))
            client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
            runs.append({"name": name, "client": client, "model": model, "times": []})
        for i in range(repeats + 2):
            for r in runs:
                t0 = time.perf_counter()
                out = r["client"].chat.completions.create(
                    model=r["model"], messages=MESSAGES, max_tokens=8, temperature=0
                )
                if i >= 2:
                    r["times"].append(time.perf_counter() - t0)
                r["prompt"] = out.usage.prompt_tokens
                r["completion"] = out.usage.completion_tokens
    return runs


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--repeats", type=int, default=30)
    args = ap.parse_args()
    path = str(resolve_model("smollm2"))
    runs = measure(
        [
            (
                "medha serve",
                lambda port: [
                    sys.executable,
                    "-m",
                    "medha",
                    "serve",
                    "--port",
                    str(port),
                    "--log-level",
                    "warning",
                ],
                "smollm2",
            ),
            (
                "transformers serve",
                lambda port: [
                    "transformers",
                    "serve",
                    path,
                    "--port",
                    str(port),
                    "--device",
                    "cpu",
                ],
                path,
            ),
        ],
        args.repeats,
    )
    print(
        f"chat request: {runs[0]['prompt']} prompt tokens, max_tokens 8, greedy, "
        f"{args.repeats} alternating repeats after 2 warm-ups\n"
    )
    print("| server | completion tokens | median | min | max |")
    print("|---|---|---|---|---|")
    for r in runs:
        t = r["times"]
        print(
            f"| {r['name']} | {r['completion']} | {statistics.median(t):.3f} s | "
            f"{min(t):.3f} s | {max(t):.3f} s |"
        )
    ratio = statistics.median(runs[1]["times"]) / statistics.median(runs[0]["times"])
    print(f"\ntransformers / medha median latency: {ratio:.2f}x (goal >= 1: medha no slower)")


if __name__ == "__main__":
    main()
