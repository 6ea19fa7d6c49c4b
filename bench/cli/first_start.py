"""What a newcomer waits for: the first answers of `medha generate` and `medha serve` on a new
machine, each start from an empty cache.

    python bench/cli/first_start.py [--rounds 3] \
        [--serve-flags '' --serve-flags '--self-profile-s 60']

`medha generate` is the README's first command's: the embedded model converted into the empty
cache first, then the answer (128 tokens); timed from the start to the process's end, after the
answer is printed (goal: 30 s). `medha serve` finds the model converted (linked into its empty
cache) and no profile, CPU measurement or anything else: timed from the start to /health
answering 200 (goal: 20 s) and to a first chat answer of 8 tokens. Each --serve-flags is a
contender (default: medha serve's defaults), alternated round by round.
"""

from __future__ import annotations

import argparse
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx

from medha.benchmark.local_server import alternated, local_server
from medha.perf.hardware_specs import cache_dir

MEDHA = [sys.executable, "-c", "import sys; from medha.cli import main; sys.exit(main())"]
PROMPT = "Why do long prompts slow down short chats?"


@contextmanager
def empty_cache(with_model: bool) -> Iterator[dict]:
    """The environment of a start from an empty MEDHA_CACHE_DIR (the converted model linked in
    with `with_model`), removed afterwards."""
    with tempfile.TemporaryDirectory(prefix="medha-first-start-") as folder:
        if with_model:
            (Path(folder) / "models").symlink_to(cache_dir() / "models")
        yield {**os.environ, "MEDHA_CACHE_DIR": folder}


def first_generate() -> float:
    with empty_cache(with_model=False) as env:
        start = time.perf_counter()
        subprocess.run([*MEDHA, "generate", "--prompt", PROMPT], env=env, check=True,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
        return time.perf_counter() - start


def first_serve(flags: str) -> tuple[float, float]:
    command = lambda port: [*MEDHA, "serve", "--port", str(port), *shlex.split(flags)]  # noqa: E731
    with empty_cache(with_model=True) as env:
        start = time.perf_counter()
        with local_server(command, quiet=True, env=env) as url:
            health = time.perf_counter() - start
            body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 8}
            httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60).raise_for_status()
            return health, time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--serve-flags", action="append", help="a medha serve contender's flags")
    args = ap.parse_args()
    contenders = ["generate"] + [f"serve {f}".strip() for f in args.serve_flags or [""]]
    got: dict[str, list] = {name: [] for name in contenders}
    print("| round | start | answer | /health |")
    print("|---|---|---|---|")
    for rnd, name in alternated(contenders, args.rounds):
        if name == "generate":
            answer, health = first_generate(), None
        else:
            health, answer = first_serve(name.removeprefix("serve"))
        got[name].append((answer, health))
        shown = "" if health is None else f"{health:.1f} s"
        print(f"| {rnd} | `medha {name}` | {answer:.1f} s | {shown} |", flush=True)
    for name, runs in got.items():
        answers = [a for a, _ in runs]
        line = f"`medha {name}`: first answer median {statistics.median(answers):.1f} s"
        if name == "generate":
            line += " (goal 30 s)"
        else:
            health = statistics.median(h for _, h in runs)
            line += f", /health median {health:.1f} s (goal 20 s)"
        print(line)


if __name__ == "__main__":
    main()
