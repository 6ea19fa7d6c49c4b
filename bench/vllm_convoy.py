"""The convoy effect on vLLM's engine: plain vLLM's scheduler against medha's, through vLLM's
OpenAI server, side by side in one run.

    python bench/vllm_convoy.py [--rounds 2] [--medha '{"policy": "lars", ...}'] [--dtype float32]

SmolLM2-135M on this machine. A 6,000-token prompt, then 8 short prompts (64 tokens, 16 output
tokens each) 0.5 s later; and the same 8 short prompts alone. For each server, the short
requests' TTFT p50 alone and behind the long prompt, their ratio, and the long prompt's TTFT.
Contenders: `python -m vllm.entrypoints.openai.api_server` with its default scheduler, and the
same with `--scheduler-cls medha.vllm_executor.MedhaScheduler --additional-config
'{"medha": ...}'`; one server at a time, alternated for --rounds rounds.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from local_server import local_server  # noqa: E402

DEFAULT_MEDHA = {"policy": "lars", "chunking": "adaptive"}


def server_command(model: str, dtype: str, medha: dict | None):
    def command(port: int) -> list[str]:
        cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model]
        cmd += ["--served-model-name", "m", "--port", str(port), "--dtype", dtype]
        cmd += ["--max-model-len", "8192", "--max-num-batched-tokens", "8192"]
        cmd += ["--enforce-eager", "--disable-log-stats"]
        if medha is not None:
            cmd += ["--scheduler-cls", "medha.vllm_executor.MedhaScheduler"]
            cmd += ["--additional-config", json.dumps({"medha": medha})]
        return cmd

    return command


async def ttft(client, prompt: list[int], delay: float, t0: float) -> float:
    """Time from the request's arrival (t0 + delay) to its first streamed token."""
    await asyncio.sleep(max(0.0, t0 + delay - time.monotonic()))
    sent = time.monotonic()
    stream = await client.completions.create(
        model="m", prompt=prompt, max_tokens=16, temperature=0, stream=True,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    first = None
    async for chunk in stream:
        if first is None and chunk.choices and chunk.choices[0].text:
            first = time.monotonic() - sent
    return first if first is not None else float("nan")


async def scenario(url: str, with_long: bool, seed: int) -> dict:
    import openai

    rng = random.Random(seed)
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", timeout=3600)
    shorts = [[rng.randrange(100, 40000) for _ in range(64)] for _ in range(8)]
    long = [rng.randrange(100, 40000) for _ in range(6000)]
    t0 = time.monotonic()
    tasks = [ttft(client, p, 0.5, t0) for p in shorts]
    if with_long:
        tasks.append(ttft(client, long, 0.0, t0))
    times = await asyncio.gather(*tasks)
    await client.close()
    out = {"short_p50": statistics.median(times[:8]), "short_max": max(times[:8])}
    if with_long:
        out["long"] = times[8]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--medha", default=json.dumps(DEFAULT_MEDHA), help="medha's settings (JSON)")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--model", default=None, help="model directory (default: SmolLM2)")
    args = ap.parse_args()
    from medha.engine.checkpoint import resolve_model

    model = args.model or str(resolve_model("smollm2"))
    # vLLM's CPU backend otherwise reserves a fraction of all memory for the KV cache
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")  # GiB
    contenders = {"vLLM": None, "vLLM + medha": json.loads(args.medha)}
    rows = []
    for rnd in range(args.rounds):
        for name, medha in contenders.items():
            with local_server(server_command(model, args.dtype, medha), quiet=True) as url:
                asyncio.run(scenario(url, False, 99))  # warm-up
                alone = asyncio.run(scenario(url, False, rnd))
                behind = asyncio.run(scenario(url, True, rnd))
            row = (name, rnd, alone["short_p50"], behind["short_p50"], behind["short_max"])
            rows.append((*row, behind["long"]))
            print(
                f"round {rnd} {name}: shorts alone {alone['short_p50']:.3f} s, behind "
                f"{behind['short_p50']:.3f} s ({behind['short_p50'] / alone['short_p50']:.1f}x), "
                f"long TTFT {behind['long']:.2f} s",
                file=sys.stderr,
                flush=True,
            )
    print(f"\nmedha settings: {args.medha}; dtype {args.dtype}\n")
    print("| round | scheduler | short TTFT p50 alone | behind the long one | ratio | max behind "
          "| long TTFT |")  # fmt: skip
    print("|---|---|---|---|---|---|---|")
    for name, rnd, alone, behind, worst, long in rows:
        print(
            f"| {rnd} | {name} | {alone:.3f} s | {behind:.3f} s | {behind / alone:.2f}x | "
            f"{worst:.3f} s | {long:.2f} s |"
        )
    for rnd in range(args.rounds):
        plain, ours = (r for r in rows if r[1] == rnd)
        print(
            f"\nround {rnd}: long TTFT medha / plain {ours[5] / plain[5]:.2f}x; "
            f"shorts behind the long one, plain / medha {plain[3] / ours[3]:.1f}x"
        )


if __name__ == "__main__":
    main()
