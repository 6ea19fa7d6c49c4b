"""`medha serve`: the OpenAI-compatible HTTP server."""

from __future__ import annotations

import argparse
import sys

from medha import __version__
from medha.cli.common import (
    CliError,
    add_engine_choice,
    llm_from_args,
    scheduler_config_from_args,
)
from medha.engine.config import EngineConfig, resolve_start_probe
from medha.scheduler.config import SchedulerConfig
from medha.server.config import ServerConfig
from medha.utils.dataclass_cli import add_dataclass_args, dataclass_from_args

EXTRA = "serve"  # what it needs beyond `pip install medha` (medha/extras.py)


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
    import os

    config = dataclass_from_args(ServerConfig, args)
    if config.api_key is None:
        config.api_key = os.environ.get("MEDHA_API_KEY") or None
    if config.max_waiting < 1:
        raise CliError(f"--max-waiting must be at least 1, got {config.max_waiting}")
    for name in ("max_request_bytes", "max_buffered_bytes"):
        value = getattr(config, name)
        if value is not None and value < 1:
            flag = "--" + name.replace("_", "-")
            raise CliError(f"{flag} must be a positive integer, got {value}")
    if args.engine == "vllm":
        _serve_vllm(args, config)
        return
    if args.vllm_arg:
        raise CliError("--vllm-arg needs --engine vllm")
    _serve_medha(args, config)


def _serve_medha(args: argparse.Namespace, config: ServerConfig) -> None:
    import signal
    import threading

    import uvicorn

    from medha.server.app import build_app

    # a server plans the arrivals to come: its engine times the start-up probe unless told not
    # to (LLM, for what it is given at once, does not)
    engine = llm_from_args(args, start_probe=resolve_start_probe(args.start_probe)).engine
    try:
        app = build_app(engine, config, engine_thread=False)
    except ValueError as e:  # a body limit that does not fit the model's context
        raise CliError(str(e)) from None
    _announce(
        config,
        args.model,
        f"{engine.spec.name}, {engine.device.type}, policy {engine.policy}, "
        f"chunking {engine.chunking}",
    )
    # The engine loop runs here, on the thread that loaded the model (see AsyncEngine), and
    # uvicorn on its own thread. SIGTERM/SIGINT ask uvicorn to drain (a second one forces it);
    # its lifespan shutdown then stops the engine loop.
    server = uvicorn.Server(_uvicorn_config(app, config))
    http = threading.Thread(target=server.run, name="medha-http")
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, server.handle_exit)
    http.start()
    app.state.engine.run(while_=http.is_alive)
    http.join()
    if not server.started:
        raise CliError(f"could not serve on {config.host}:{config.port} (see the log above)")


def _serve_vllm(args: argparse.Namespace, config: ServerConfig) -> None:
    """vLLM's AsyncLLM and uvicorn share this thread's event loop, as in vLLM's own server:
    the engine core runs in a process of its own, the output handler is a task of the loop."""
    import asyncio
    import contextlib
    import signal

    import uvicorn

    try:
        from medha.vllm_executor.engine_args import parse_vllm_args
        from medha.vllm_executor.serving import VllmAsyncEngine, VllmEngine
    except ImportError as e:
        raise CliError(str(e)) from None
    from medha.engine.errors import EngineError
    from medha.server.app import build_app

    try:
        engine_config = dataclass_from_args(EngineConfig, args)
    except EngineError as e:
        raise CliError(str(e)) from None
    # given (and not 0 or off): say they do nothing here rather than ignore them
    for flag in [f for f in ("self_profile_s", "start_probe") if getattr(args, f, None)]:
        print(
            f"medha serve: --{flag.replace('_', '-')} is medha's engine's and does nothing "
            "with --engine vllm: there medha's scheduler corrects its model from the steps "
            "vLLM runs (--calibrate online), and `medha profile --engine vllm` times a grid",
            file=sys.stderr,
        )
    scheduler = scheduler_config_from_args(args)
    try:
        vllm_args = parse_vllm_args(args.vllm_arg)
    except ValueError as e:
        raise CliError(str(e)) from None

    class Server(uvicorn.Server):
        """On the main thread uvicorn handles SIGTERM and SIGINT itself (drain; a second one
        forces), then raises the signal again once stopped, which would end the process by
        that signal: here the process exits 0 after the drain, as with medha's engine."""

        @contextlib.contextmanager
        def capture_signals(self):
            signals = (signal.SIGTERM, signal.SIGINT)
            before = {sig: signal.signal(sig, self.handle_exit) for sig in signals}
            try:
                yield
            finally:
                for sig, handler in before.items():
                    signal.signal(sig, handler)

    async def serve() -> bool:
        try:  # (blocks the loop while vLLM starts: nothing else runs on it yet)
            engine = VllmEngine(engine_config, scheduler, vllm_args)
        except (EngineError, ValueError) as e:
            raise CliError(str(e)) from None
        try:
            try:
                app = build_app(engine, config, async_engine_cls=VllmAsyncEngine)
            except ValueError as e:  # a body limit that does not fit the model's context
                raise CliError(str(e)) from None
            _announce(
                config,
                args.model,
                f"engine vllm, {engine.device}, {engine.dtype}, policy {engine.policy}, "
                f"chunking {engine.chunking}",
            )
            server = Server(_uvicorn_config(app, config))
            try:  # SIGTERM/SIGINT drain; its lifespan shuts the engine down
                await server.serve()
            except SystemExit:  # uvicorn's answer to a port it cannot bind (logged)
                pass
            return server.started
        finally:
            engine.shutdown()

    if not asyncio.run(serve()):
        raise CliError(f"could not serve on {config.host}:{config.port} (see the log above)")


def _announce(config: ServerConfig, model: str, what: str) -> None:
    """Log at the server's level from now on, and say what is served where."""
    import logging

    logging.basicConfig(level=config.log_level.upper(), format="%(levelname)s %(message)s")
    print(
        f"medha {__version__} serving {config.served_model_name or model} ({what}) "
        f"on http://{config.host}:{config.port}/v1",
        file=sys.stderr,
        flush=True,
    )


def _uvicorn_config(app, config: ServerConfig):
    import uvicorn

    return uvicorn.Config(
        app,
        host=config.host,
        port=config.port,
        log_level=config.log_level,
        timeout_graceful_shutdown=config.drain_timeout_s,
    )
