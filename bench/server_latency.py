"""One short chat request end to end through the API: medha serve beside transformers serve.

    python bench/server_latency.py [--repeats 10]

Both serve the same converted SmolLM2-135M-Instruct checkpoint on CPU, one at a time on a free
loopback port. After two warm-up requests, the same chat request (about 40 prompt tokens with
the chat template, max_tokens 8, greedy) is sent --repeats times with the official openai
client, non-streaming; the table gives the client-side latency.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import openai

sys.path.insert(0, str(Path(__file__).resolve().parent))

from local_server import local_server  # noqa: E402

from medha.engine.checkpoint import resolve_model  # noqa: E402

MESSAGES = [{"role": "user", "content": "In one sentence, why is the sky blue?"}]


def measure(name: str, command, model: str, repeats: int) -> dict:
    with local_server(command, quiet=True) as url:
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=10)
    args = ap.parse_args()
    path = str(resolve_model("smollm2"))
    runs = [
        measure("medha serve", lambda port: [sys.executable, "-m", "medha", "serve", "--port",
                                             str(port), "--log-level", "warning"],
                "smollm2", args.repeats),
        measure("transformers serve", lambda port: ["transformers", "serve", path, "--port",
                                                    str(port), "--device", "cpu"],
                path, args.repeats)]
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
