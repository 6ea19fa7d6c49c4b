"""A lone request on vLLM's engine: does medha's scheduler add latency?

    python bench/vllm/vllm_latency.py [--rounds 2] [--repeats 20]

SmolLM2-135M, every server with the same flags (medha/benchmark/vllm_servers.py), one at a
time, alternated for --rounds rounds. With nothing else running, each server answers, one request at
a time: a short chat (8 output tokens, the latency a user feels; median of --repeats) and a
2,000-token prompt (its TTFT, 1 output token; median of --repeats / 4). Contenders: vLLM's
OpenAI server with its own scheduler; the same server with medha's scheduler running vLLM's
schedule (fcfs, static 2,048-token chunks: the adapter's own cost), and running lars with
adaptive chunking, lars and edf (a lone long prompt runs in steps of the arrival wait: the
price of bounding every step);
`medha serve --engine vllm` (medha's front end, lars). Goal: medha within 10% of vLLM.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time

from medha.benchmark.local_server import alternated, local_server
from medha.benchmark.vllm_servers import add_server_args, server_command, server_flags

MEDHA = {"policy": "lars", "chunking": "adaptive"}
# vLLM's own schedule (whole 2,048-token chunks, first come first served) decided by medha: what
# is left between this and plain vLLM is the adapter's cost, not a scheduling choice
AS_VLLM = {"policy": "fcfs", "chunking": "static:2048"}
CONTENDERS = {  # name -> (medha settings, front end)
    "vLLM": (None, "vllm"),
    "vLLM + medha (fcfs static:2048)": (AS_VLLM, "vllm"),
    "vLLM + medha (lars adaptive)": (MEDHA, "vllm"),
    "vLLM + medha (edf adaptive)": ({**MEDHA, "policy": "edf"}, "vllm"),
    "medha serve --engine vllm (lars adaptive)": (MEDHA, "medha"),
}


def measure(url: str, repeats: int) -> dict:
    import openai

    client = openai.OpenAI(base_url=url + "/v1", api_key="none", timeout=600)
    rng = random.Random(0)

    # every prompt new, so that vLLM's prefix cache has nothing to give
    def chat() -> float:
        text = f"Write a haiku about queue number {rng.randrange(10**6)}."
        t0 = time.perf_counter()
        client.chat.completions.create(
            model="m", messages=[{"role": "user", "content": text}],
            max_tokens=8, temperature=0, extra_body={"ignore_eos": True},
        )  # fmt: skip
        return time.perf_counter() - t0

    def long() -> float:
        prompt = [rng.randrange(100, 40000) for _ in range(2000)]
        t0 = time.perf_counter()
        client.completions.create(model="m", prompt=prompt, max_tokens=1, temperature=0)
        return time.perf_counter() - t0

    chat(), long()  # warm-up: the first passes of each shape are slow
    out = {
        "chat": statistics.median(chat() for _ in range(repeats)),
        "long": statistics.median(long() for _ in range(max(1, repeats // 4))),
    }
    client.close()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--contenders", default=",".join(CONTENDERS), help="comma-separated")
    ap.add_argument("--verbose", action="store_true", help="the servers' logs")
    add_server_args(ap)
    args = ap.parse_args()
    flags = server_flags(args)
    names = args.contenders.split(",")
    rows = []
    for rnd, name in alternated(names, args.rounds):
        medha, front = CONTENDERS[name]
        command = server_command(flags, medha, front)
        with local_server(command, quiet=not args.verbose) as url:
            m = measure(url, args.repeats)
        rows.append((rnd, name, m))
        print(
            f"round {rnd} {name}: chat {m['chat']:.3f} s, 2,000-token TTFT {m['long']:.3f} s",
            file=sys.stderr,
            flush=True,
        )
    print(f"\n{flags}\n")
    print("| round | server | short chat, 8 tokens (median) | 2,000-token prompt, TTFT |")
    print("|---|---|---|---|")
    for rnd, name, m in rows:
        print(f"| {rnd} | {name} | {m['chat']:.3f} s | {m['long']:.3f} s |")
    if "vLLM" in names:
        print()
        for rnd in range(args.rounds):
            base = next(m for r, n, m in rows if r == rnd and n == "vLLM")
            for r, name, m in rows:
                if r == rnd and name != "vLLM":
                    print(
                        f"round {rnd} {name} / vLLM: chat {m['chat'] / base['chat']:.2f}x, "
                        f"2,000-token TTFT {m['long'] / base['long']:.2f}x (goal <= 1.05x)"
                    )


if __name__ == "__main__":
    main()
