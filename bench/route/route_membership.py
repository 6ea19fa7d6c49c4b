"""Replicas added, removed and killed under load, through `medha route`.

    python bench/route/route_membership.py [--rate 100] [--seconds 16] [--rounds 2]
        [--add-at 4] [--remove-at 8] [--kill-at 12]

Three stub replicas (medha/benchmark/stub_backend.py, streaming 16 tokens at `--token-delay-s`
each); the router starts over the first two (with `--api-key`, which its admin endpoints need)
under an open-loop stream of streamed /v1/completions at `--rate` a second. At `--add-at` the
third joins (`POST /replicas`), at `--remove-at` the second leaves (`DELETE /replicas/1`), at
`--kill-at` the first gets SIGKILL, so the last seconds run on the replica that was added.
Per request the client records its send, first token, end and outcome (bench/route/route_faults.py's
client). Reported, per round:

- **not started**: requests with no token at the kill, and the share that succeeded (target:
  none lost, i.e. 100% when the added replica can take the load alone);
- **in serve at the removal**: streams on the removed replica when it was removed, and how
  they ended (target: all complete: removal drains), the drain's time (the DELETE to the
  replica's leaving the listing), and requests sent to it after the DELETE (target: 0);
- **the added replica**: from the POST to its being up (the POST answers after its first
  check) and to its first request served (target: within one health interval, 0.5 s).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import sys
import time
from contextlib import ExitStack
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1]))
sys.path.insert(0, str(HERE))

import aiohttp  # noqa: E402
from route_faults import one, replicas, summarize  # noqa: E402

from medha.benchmark.harness import add_common_args  # noqa: E402
from medha.benchmark.local_server import local_server  # noqa: E402

KEY = "bench-key"
HEADERS = {"authorization": f"Bearer {KEY}"}


def router(urls: list[str]):
    def command(port):
        replicas = [a for u in urls for a in ("--replica", u)]
        return [sys.executable, "-m", "medha", "route", "--port", str(port), *replicas,
                "--api-key", KEY, "--log-level", "warning"]  # fmt: skip

    return local_server(command, startup_s=120)


async def stub_served(session, url: str) -> int:
    async with session.get(url + "/stub/stats") as r:
        return (await r.json())["requests"]


async def dispatched(session, router_url: str, replica: int) -> float:
    async with session.get(router_url + "/metrics") as r:
        text = await r.text()
    line = f'medha_router_dispatched_total{{replica="{replica}"}} '
    return next((float(x.split()[-1]) for x in text.splitlines() if x.startswith(line)), 0.0)


async def drive(url: str, stubs: list[tuple[str, object]], args) -> dict:
    records: list[dict] = []
    tasks: list[asyncio.Task] = []
    found: dict = {}
    timeout = aiohttp.ClientTimeout(total=None)
    async with aiohttp.ClientSession(timeout=timeout, headers=HEADERS) as session:

        async def add() -> None:
            t0 = time.monotonic()
            before = await stub_served(session, stubs[2][0])
            async with session.post(url + "/replicas", json={"url": stubs[2][0]}) as r:
                body = await r.json()
            found["add_status"], found["add_up"] = r.status, body.get("up")
            found["add_answered_s"] = time.monotonic() - t0
            while await stub_served(session, stubs[2][0]) == before:
                await asyncio.sleep(0.01)
            found["add_first_served_s"] = time.monotonic() - t0

        async def remove() -> None:
            t0 = time.monotonic()
            found["removed_at"] = t0
            async with session.delete(url + "/replicas/1") as r:
                found["remove_status"] = r.status
                found["removal_held"] = (await r.json())["requests"]
            found["dispatched_at_removal"] = await dispatched(session, url, 1)
            while True:
                async with session.get(url + "/replicas") as r:
                    listing = (await r.json())["replicas"]
                if all(x["id"] != 1 for x in listing):
                    break
                await asyncio.sleep(0.01)
            found["drain_s"] = time.monotonic() - t0

        start = time.monotonic()
        events = sorted(
            [(args.add_at, add), (args.remove_at, remove), (args.kill_at, None)],
            key=lambda e: e[0],
        )
        due = start
        for _ in range(int(args.rate * args.seconds)):
            delay = due - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            while events and time.monotonic() - start >= events[0][0]:
                _, action = events.pop(0)
                if action is None:
                    found["killed_at"] = time.monotonic()
                    stubs[0][1].send_signal(signal.SIGKILL)
                else:
                    tasks.append(asyncio.create_task(action()))
            record: dict = {}
            records.append(record)
            tasks.append(asyncio.create_task(one(session, url, "stub", record)))
            due += 1.0 / args.rate
        _, hung = await asyncio.wait(tasks, timeout=30)
        for t in hung:
            t.cancel()
        found["dispatched_after"] = await dispatched(session, url, 1)
    return {"records": records, **found}


def summarize_run(run: dict) -> dict:
    records, killed_at, removed_at = run["records"], run["killed_at"], run["removed_at"]
    # the streams open at the removal that ended before the kill: none of them may fail
    # (those on the removed replica drained; a failure would be a stream cut by the removal)
    open_at_removal = [
        r for r in records
        if "first" in r and r["first"] < removed_at <= r.get("end", float("inf")) < killed_at
    ]  # fmt: skip
    return {
        **summarize(records, killed_at),  # (not started at the kill, outcomes: route_faults')
        "open_at_removal": len(open_at_removal),
        "open_at_removal_ok": sum(r.get("outcome") == "ok" for r in open_at_removal),
        "removal_held": run["removal_held"],
        "drain_s": run["drain_s"],
        "sent_to_removed_after_delete": run["dispatched_after"] - run["dispatched_at_removal"],
        "add_status": run["add_status"],
        "add_up": run["add_up"],
        "add_answered_s": run["add_answered_s"],
        "add_first_served_s": run["add_first_served_s"],
    }


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--rate", type=float, default=100.0)
    ap.add_argument("--seconds", type=float, default=16.0)
    ap.add_argument("--add-at", type=float, default=4.0)
    ap.add_argument("--remove-at", type=float, default=8.0)
    ap.add_argument("--kill-at", type=float, default=12.0)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--token-delay-s", type=float, default=0.02)
    add_common_args(ap, out=None)
    args = ap.parse_args()
    results = []
    for rnd in range(args.rounds):
        with ExitStack() as stack:
            stubs = replicas(stack, "stub", args.token_delay_s, count=3)
            url = stack.enter_context(router([u for u, _ in stubs[:2]]))
            s = summarize_run(asyncio.run(drive(url, stubs, args)))
            results.append(s)
            print(
                f"round {rnd}: not started {s['not_started_ok']}/{s['not_started']} ok; open at "
                f"the removal {s['open_at_removal_ok']}/{s['open_at_removal']} ok (the removed "
                f"replica held {s['removal_held']}, drained in {s['drain_s']:.2f} s, "
                f"{s['sent_to_removed_after_delete']:.0f} sent to it after the DELETE); added: "
                f"POST {s['add_status']} up={s['add_up']} in {s['add_answered_s']:.3f} s, first "
                f"request served {s['add_first_served_s']:.3f} s after the POST; outcomes "
                f"{s['outcomes']}",
                flush=True,
            )
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
