"""`medha serve`: the OpenAI-compatible HTTP server."""

from __future__ import annotations

import argparse
import sys

from medha import __version__
from medha.cli.common import CliError, add_engine_choice, llm_from_args
from medha.core.config import SchedulerConfig
from medha.engine.config import EngineConfig
from medha.server.config import ServerConfig
from medha.utils.dataclass_cli import add_dataclass_args, dataclass_from_args


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "serve",
        help="OpenAI-compatible HTTP server",
        description="Serve a model over the OpenAI API (/v1/completions, "
        "/v1/chat/completions, /v1/models) with /health and Prometheus "
        "/metrics. Per-request targets go in a `medha` object of the request "
        "body: priority, ttft_slo_s (the request's TTFT deadline), tpot_slo_s "
        "(its TPOT target: a batch that carries its decode gets at most that "
        "iteration budget, scaled by spp/(spp+1) with pipeline stages, as "
        "--iteration-budget-s is from --tpot-target-s); the scheduler flags "
        "below set the server-wide defaults. SIGTERM drains in-flight requests.",
    )
    add_dataclass_args(p, ServerConfig, title="server")
    add_engine_choice(p)
    add_dataclass_args(p, EngineConfig, title="engine")
    add_dataclass_args(p, SchedulerConfig, title="scheduler")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> None:
    import logging
    import os
    import signal
    import threading

    import uvicorn

    from medha.server.app import build_app

    config = dataclass_from_args(ServerConfig, args)
    if config.api_key is None:
        config.api_key = os.environ.get("MEDHA_API_KEY") or None
    if config.max_waiting < 1:
        raise CliError(f"--max-waiting must be at least 1, got {config.max_waiting}")
    engine = llm_from_args(args).engine
    app = build_app(engine, config, engine_thread=False)
    logging.basicConfig(level=config.log_level.upper(), format="%(levelname)s %(message)s")
    print(
        f"medha {__version__} serving {config.served_model_name or args.model} "
        f"({engine.spec.name}, {engine.device.type}, policy "
        f"{engine.policy}, chunking {engine.chunking}) on http://{config.host}:{config.port}/v1",
        file=sys.stderr,
        flush=True,
    )
    # The engine loop runs here, on the thread that loaded the model (see AsyncEngine), and
    # uvicorn on its own thread. SIGTERM/SIGINT ask uvicorn to drain (a second one forces it);
    # its lifespan shutdown then stops the engine loop.
    server = uvicorn.Server(
        uvicorn.Config(
            app,
            host=config.host,
            port=config.port,
            log_level=config.log_level,
            timeout_graceful_shutdown=config.drain_timeout_s,
        )
    )
    http = threading.Thread(target=server.run, name="medha-http")
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, server.handle_exit)
    http.start()
    app.state.engine.run(while_=http.is_alive)
    http.join()
    if not server.started:
        raise CliError(f"could not serve on {config.host}:{config.port} (see the log above)")
