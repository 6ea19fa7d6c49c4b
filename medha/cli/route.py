"""`medha route`: one OpenAI-compatible front over many replicas, dispatched by the simulator's
dispatchers."""

from __future__ import annotations

import argparse
import os
import sys

from medha import __version__
from medha.cli.common import CliError
from medha.route.config import RouteConfig
from medha.utils.dataclass_cli import add_dataclass_args, dataclass_from_args

EXTRA = "route"  # what it needs beyond `pip install medha` (medha/extras.py)


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "route",
        help="OpenAI-compatible router over many replicas",
        description="Route /v1/completions and /v1/chat/completions (streamed as they come) "
        "over OpenAI-compatible replicas (medha serve, medha serve --engine vllm, plain vLLM), "
        "with /v1/models, /health and Prometheus /metrics. The dispatcher is the class "
        "`medha simulate --dispatcher` runs, over the router's model of each replica: the "
        "requests it holds, their predicted work from the replicas' profile, the prefix "
        "blocks it was sent. Replicas are health-checked; a request that has streamed nothing "
        "is retried on another replica; a stream whose replica dies ends with an error event. "
        "Per-request targets: medha's `medha: {ttft_slo_s, tpot_slo_s, priority}` body fields "
        "(which the replicas read too), or a TTFT target in the header x-slo-ttft-ms (the "
        "router's alone). The router imports no torch.",
    )
    p.add_argument(
        "--replica",
        action="append",
        default=[],
        metavar="URL",
        help="a replica's base URL, e.g. http://10.0.0.2:8000 (repeat for each)",
    )
    p.add_argument(
        "--replica-api-key",
        action="append",
        default=[],
        metavar="KEY",
        help="the key the router sends a replica (once: every replica's; else one per "
        "--replica, in order; default $MEDHA_REPLICA_API_KEY)",
    )
    p.add_argument(
        "--spawn",
        type=int,
        default=0,
        metavar="N",
        help="start N local `medha serve` replicas on free ports, the cores split between them, "
        "and route over them (with or without --replica)",
    )
    p.add_argument(
        "--spawn-arg",
        action="append",
        default=[],
        metavar="ARG",
        help="a flag for each spawned `medha serve` (repeat; e.g. --spawn-arg=--prefix-cache "
        "--spawn-arg=device)",
    )
    add_dataclass_args(p, RouteConfig, title="router")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> None:
    try:
        config = dataclass_from_args(RouteConfig, args)
    except ValueError as e:
        raise CliError(str(e)) from None
    if config.api_key is None:
        config.api_key = os.environ.get("MEDHA_API_KEY") or None
    keys = args.replica_api_key or (
        [os.environ["MEDHA_REPLICA_API_KEY"]] if os.environ.get("MEDHA_REPLICA_API_KEY") else []
    )
    if args.spawn < 0:
        raise CliError(f"--spawn must be >= 0, got {args.spawn}")
    if not args.replica and not args.spawn and not config.api_key:
        raise CliError(
            "no replicas: give --replica URL (repeat for each) or --spawn N, or --api-key to "
            "add them at run time (POST /replicas)"
        )
    from medha.route.spawn import spawned_replicas

    with spawned_replicas(args.spawn, args.spawn_arg) as local:
        _serve(config, [*args.replica, *local], keys)


def _serve(config: RouteConfig, urls: list[str], keys: list[str]) -> None:
    import asyncio
    import logging

    import uvicorn

    from medha.route.app import Router

    logging.basicConfig(level=config.log_level.upper(), format="%(levelname)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # a line per health check otherwise
    try:
        router = Router(config, urls, keys)
    except ValueError as e:
        raise CliError(str(e)) from None
    print(
        f"medha {__version__} routing over {len(urls)} replicas ({config.dispatcher}) on "
        f"http://{config.host}:{config.port}/v1",
        file=sys.stderr,
        flush=True,
    )
    server = uvicorn.Server(
        uvicorn.Config(
            router.asgi(),
            host=config.host,
            port=config.port,
            log_level=config.log_level,
            access_log=False,
            lifespan="on",
            # the router reads no client address: uvicorn's X-Forwarded-For middleware would
            # be a cost on every request for nothing
            proxy_headers=False,
        )
    )

    async def serve() -> bool:
        try:
            await server.serve()
        except SystemExit:  # uvicorn's answer to a port it cannot bind (logged)
            pass
        return server.started

    # uvicorn picks uvloop only in its own run(); serve() runs on the loop it is given
    try:
        from uvloop import run as run_loop
    except ImportError:
        run_loop = asyncio.run
    if not run_loop(serve()):
        raise CliError(f"could not serve on {config.host}:{config.port} (see the log above)")
