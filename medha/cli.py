"""The `medha` command."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from medha import __version__
from medha.core.config import SchedulerConfig
from medha.perf import PREDICTOR_HELP, ParallelConfig, make_predictor
from medha.perf.hardware_specs import HARDWARE_NAMES
from medha.perf.model_specs import MODELS
from medha.utils.dataclass_cli import add_dataclass_args, dataclass_from_args


class CliError(Exception):
    """A user error: printed without a traceback, exit code 2."""


def _add_platform_args(p: argparse.ArgumentParser, model: str, hardware: str,
                       tp: int = 1) -> None:
    g = p.add_argument_group("model and hardware")
    g.add_argument("--model", default=model,
                   help=f"model spec: {', '.join(sorted(MODELS))} (default: {model})")
    g.add_argument("--hardware", default=hardware,
                   help=f"device: {', '.join(HARDWARE_NAMES)}; cpu is this machine, measured "
                        f"once and cached (default: {hardware})")
    g.add_argument("--predictor", default="roofline", help=PREDICTOR_HELP + " (default: roofline)")
    add_dataclass_args(p, ParallelConfig, title="parallelism")
    p.set_defaults(tp=tp)


def _predictor(args: argparse.Namespace):
    try:
        parallel = dataclass_from_args(ParallelConfig, args)
        return make_predictor(args.predictor, args.model, args.hardware, parallel)
    except ValueError as e:
        raise CliError(str(e)) from None


def _cmd_demo(args: argparse.Namespace) -> None:
    from medha.demo import DemoWorkload, demo_table
    from medha.scheduler.block_manager import BlockManager

    predictor = _predictor(args)
    base = _scheduler_config(args)
    workload = DemoWorkload(num_short=args.num_short, short_qps=args.short_qps,
                            long_prompt=args.long_prompt, seed=args.seed)
    blocks = BlockManager.from_memory(args.kv_memory_gb * 2**30, predictor.model,
                                      predictor.parallel, predictor.hardware.dtype_bytes)
    print(f"medha {__version__} scheduling demo: {predictor.describe()}")
    print(f"one {workload.long_prompt}-token prompt at t={workload.long_at_s:.0f}s among "
          f"{workload.num_short} short chat requests ({workload.short_qps}/s); iteration "
          f"budget {base.budget_s(predictor.parallel.spp) * 1e3:.0f} ms; batch times "
          "predicted, not measured\n")
    print(demo_table(predictor, workload, base, blocks.num_blocks))


def _scheduler_config(args: argparse.Namespace) -> SchedulerConfig:
    try:
        return dataclass_from_args(SchedulerConfig, args)
    except ValueError as e:
        raise CliError(str(e)) from None


def _cmd_chunks(args: argparse.Namespace) -> None:
    from medha.scheduler.packers import make_packer

    predictor = _predictor(args)
    if args.prompt_len < 1:
        raise CliError(f"--prompt-len must be positive, got {args.prompt_len}")
    config = SchedulerConfig(chunking=args.chunking, target_batch_time_s=args.budget_ms / 1e3)
    packer = make_packer(config, predictor)
    chunks, k, total = [], 0, 0.0
    while k < args.prompt_len:
        n = packer.plan_isolated(k, args.prompt_len - k)
        t = predictor.shape_time([(n, k)])
        chunks.append((k, n, t))
        total += t
        k += n
    print(f"{predictor.describe()}; chunking {args.chunking}, budget {args.budget_ms:g} ms")
    print(f"{'kv offset':>10s} {'chunk':>7s} {'predicted ms':>13s}")
    step = 1 if args.all else max(1, len(chunks) // 20)
    shown = list(range(0, len(chunks), step))
    if shown[-1] != len(chunks) - 1:
        shown.append(len(chunks) - 1)
    for i in shown:
        kv, n, t = chunks[i]
        print(f"{kv:10d} {n:7d} {t * 1e3:13.2f}")
    print(f"{len(chunks)} chunks, {args.prompt_len} tokens, predicted prefill time "
          f"{total:.2f} s (chunks run back to back)")


def _cmd_predict(args: argparse.Namespace) -> None:
    predictor = _predictor(args)

    def pairs(specs: list[str], flag: str) -> list[tuple[int, int]]:
        out = []
        for s in specs:
            n, _, k = s.partition("@")
            if not (n.isdigit() and (k.isdigit() or not k)) or int(n) < 1:
                raise CliError(f"{flag} {s!r}: expected TOKENS@KV_OFFSET, e.g. 512@100000")
            out.append((int(n), int(k or 0)))
        return out

    prefills = pairs(args.prefill, "--prefill")
    decodes = [k for count, k in pairs(args.decode, "--decode") for _ in range(count)]
    if not prefills and not decodes:
        raise CliError("nothing to predict: give --prefill and/or --decode")
    total = predictor.shape_time(prefills, decodes)
    tokens = sum(n for n, _ in prefills) + len(decodes)
    result = {
        "predictor": predictor.describe(),
        "batch_time_ms": total * 1e3,
        "linear_ms": predictor.linear_time(tokens, len(prefills) + len(decodes)) * 1e3,
        "prefill_attention_ms": [predictor.prefill_attention_time(n, k) * 1e3
                                 for n, k in prefills],
        "decode_attention_ms": sum(predictor.decode_attention_time(k) for k in decodes) * 1e3,
    }
    print(json.dumps(result, indent=1))


def _cmd_simulate(args: argparse.Namespace) -> None:
    from medha.perf.profile_data import ProfileError
    from medha.sim.cli_simulate import ConfigError, build_specs
    from medha.sim.runner import OutputDirError, output_dir, simulate, write_compare, write_run
    from medha.sim.workload.traces import TraceError

    try:
        specs, workload = build_specs(args, getattr(args, "yaml_compare", None))
        compare = len(specs) > 1 or bool(args.compare) or bool(getattr(args, "yaml_compare",
                                                                           None))
        outcomes = []
        with output_dir(args.out, args.overwrite) as tmp:
            for spec in specs:
                if not args.quiet:
                    print(f"[{spec.name}] {spec.cluster.replicas} x {spec.cluster.model} on "
                          f"{spec.parallel.world_size} {spec.cluster.hardware} (tp "
                          f"{spec.parallel.tp}, spp {spec.parallel.spp}, kvp "
                          f"{spec.parallel.kvp}); {spec.scheduler.policy or 'default'} policy, "
                          f"{spec.scheduler.chunking} chunking", file=sys.stderr)
                outcome = simulate(spec, workload, progress=not args.quiet)
                write_run(tmp / spec.name if compare else tmp, outcome,
                          plots=not args.no_plots, token_times=args.save_token_times)
                outcomes.append(outcome)
            table = write_compare(tmp, outcomes, plots=not args.no_plots) if compare else None
    except (ConfigError, TraceError, ProfileError, OutputDirError) as e:
        raise CliError(str(e)) from None
    except ValueError as e:  # a request or config the scheduler refuses
        raise CliError(str(e)) from None
    if table:
        print(table)
    else:
        s = outcomes[0].summary
        short, long_ = s["by_class"]["short"], s["by_class"]["long"]
        print(json.dumps({"requests": s["requests"], "ttft_s": s["ttft_s"],
                          "short_ttft_s": short["ttft_s"], "long_ttft_s": long_["ttft_s"],
                          "tpot_s": s["tpot_s"], "slo_attainment": s["slo_attainment"],
                          "throughput": s["throughput"], "sim": s["sim"]}, indent=1))
    print(f"results in {args.out}/", file=sys.stderr)


def _cmd_analyze_deferred(args: argparse.Namespace) -> None:
    from medha.analysis.cli_analyze import DeferredPrefillArgs, analyze
    from medha.sim.simulator import ClusterConfig

    predictor = _predictor(args)
    try:
        options = dataclass_from_args(DeferredPrefillArgs, args)
        cluster = ClusterConfig(model=args.model, hardware=args.hardware,
                                predictor=args.predictor)
        print(analyze(options, predictor, cluster, predictor.parallel))
    except ValueError as e:
        raise CliError(str(e)) from None


def _engine(args: argparse.Namespace):
    from medha.engine.errors import EngineError
    from medha.engine.llm import LLM
    from medha.engine.llm_engine import EngineConfig

    try:
        return LLM(scheduler=_scheduler_config(args),
                   **vars(dataclass_from_args(EngineConfig, args)))
    except EngineError as e:
        raise CliError(str(e)) from None


def _cmd_generate(args: argparse.Namespace) -> None:
    from medha.engine.errors import EngineError
    from medha.engine.sampling_params import SamplingParams

    try:
        params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                                top_p=args.top_p, top_k=args.top_k, seed=args.seed,
                                stop=args.stop or [], ignore_eos=args.ignore_eos)
    except ValueError as e:
        raise CliError(str(e)) from None
    llm = _engine(args)
    try:
        if args.chat:
            out = llm.chat([{"role": "user", "content": args.prompt}], params)
        else:
            out = llm.generate(args.prompt, params)[0]
    except (ValueError, EngineError) as e:
        raise CliError(str(e)) from None
    if out.finish_reason == "error":
        raise CliError(f"generation failed: {out.error}")
    print(out.text)
    m = out.metrics
    print(f"[{m['prompt_tokens']} prompt + {m['completion_tokens']} completion tokens, "
          f"finish: {out.finish_reason}, TTFT {m['ttft_s'] * 1e3:.0f} ms"
          + (f", {1 / m['tpot_s']:.1f} tokens/s" if m["tpot_s"] else "") + "]",
          file=sys.stderr)


def _cmd_profile(args: argparse.Namespace) -> None:
    from medha.engine.llm_engine import _default_profile_path
    from medha.engine.profiler import Profiler, grid

    llm = _engine(args)
    engine = llm.engine
    out = args.out or _default_profile_path(engine.model_path, engine.device.type,
                                            engine.config)
    shapes = grid(engine.scheduler.max_model_len, engine.scheduler.blocks.capacity_tokens,
                  args.mixed, args.seed, quick=args.quick)
    print(f"profiling {engine.spec.name} on {engine.device.type}: {len(shapes)} batch shapes",
          file=sys.stderr)
    profile = Profiler(engine, seed=args.seed).run(shapes, progress=not args.quiet)
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    profile.save(out)
    print(f"wrote {out}; the engine uses it by default from now on "
          f"(or pass --predictor profiled:{out})")


def _cmd_serve(args: argparse.Namespace) -> None:
    import logging
    import os
    import signal
    import threading

    import uvicorn

    from medha.server.api_server import ServerConfig, build_app

    config = dataclass_from_args(ServerConfig, args)
    if config.api_key is None:
        config.api_key = os.environ.get("MEDHA_API_KEY") or None
    if config.max_waiting < 1:
        raise CliError(f"--max-waiting must be at least 1, got {config.max_waiting}")
    engine = _engine(args).engine
    app = build_app(engine, config, engine_thread=False)
    logging.basicConfig(level=config.log_level.upper(), format="%(levelname)s %(message)s")
    print(f"medha {__version__} serving {config.served_model_name or args.model} "
          f"({engine.spec.name}, {engine.device.type}, policy "
          f"{engine.scheduler.config.policy or engine.scheduler.packer.default_policy}, chunking "
          f"{engine.scheduler.config.chunking}) on http://{config.host}:{config.port}/v1",
          file=sys.stderr, flush=True)
    # The engine loop runs here, on the thread that loaded the model (see AsyncEngine), and
    # uvicorn on its own thread. SIGTERM/SIGINT ask uvicorn to drain (a second one forces it);
    # its lifespan shutdown then stops the engine loop.
    server = uvicorn.Server(uvicorn.Config(app, host=config.host, port=config.port,
                                           log_level=config.log_level,
                                           timeout_graceful_shutdown=config.drain_timeout_s))
    http = threading.Thread(target=server.run, name="medha-http")
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, server.handle_exit)
    http.start()
    app.state.engine.run(while_=http.is_alive)
    http.join()
    if not server.started:
        raise CliError(f"could not serve on {config.host}:{config.port} (see the log above)")


def _cmd_bench(args: argparse.Namespace) -> None:
    from medha.benchmark.load_generator import BenchConfig, BenchError, run_bench
    from medha.sim.workload.traces import TraceError

    try:
        cfg = dataclass_from_args(BenchConfig, args)
        summary = run_bench(cfg, progress=not args.quiet)
    except (ValueError, TraceError, BenchError) as e:
        raise CliError(str(e)) from None
    short, long = summary["by_class"]["short"], summary["by_class"]["long"]

    def row(name: str, c: dict) -> str:
        t = c["ttft_s"]
        return (f"{name:6s} {c['count']:5d}  TTFT p50 {t['p50']:.3f} s  p99 {t['p99']:.3f} s"
                if c["count"] and t["p50"] is not None else f"{name:6s} {c['count']:5d}")
    print(f"{summary['requests']['completed']}/{summary['requests']['total']} completed, "
          f"{summary['client']['errors']} errors, "
          f"{summary['throughput']['output_tokens_per_s']:.1f} output tokens/s")
    print(row("short", short))
    print(row("long", long))
    print(f"results in {cfg.out}/", file=sys.stderr)
    if summary["client"]["errors"]:
        raise CliError(f"{summary['client']['errors']} requests failed; see "
                       f"{cfg.out}/requests.csv")


def _cmd_hardware(args: argparse.Namespace) -> None:
    from medha.perf.hardware_specs import GPUS, this_cpu

    specs = {**GPUS, "cpu": this_cpu(refresh=args.refresh)}
    print(json.dumps({name: spec.to_json() for name, spec in specs.items()}, indent=1))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="medha", description="LLM serving for mixed short and very long requests "
        "(preemptive chunked prefills, LARS scheduling, adaptive chunking).")
    parser.add_argument("--version", action="version", version=f"medha {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    p = sub.add_parser("demo", help="compare schedulers on a long prompt among short ones",
                       description=__import__("medha.demo").demo.__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    _add_platform_args(p, "smollm2", "cpu")
    g = p.add_argument_group("workload")
    g.add_argument("--num-short", type=int, default=40, help="short requests (default: 40)")
    g.add_argument("--short-qps", type=float, default=1.0,
                   help="arrival rate of short requests per second (default: 1.0)")
    g.add_argument("--long-prompt", type=int, default=6000,
                   help="tokens of the long prompt (default: 6000)")
    g.add_argument("--seed", type=int, default=0, help="workload seed (default: 0)")
    g.add_argument("--kv-memory-gb", type=float, default=2.0,
                   help="KV cache memory per device in GiB (default: 2)")
    add_dataclass_args(p, SchedulerConfig, skip=("policy", "chunking"), title="scheduler")
    p.set_defaults(func=_cmd_demo, tpot_target_s=0.125)

    p = sub.add_parser("chunks", help="chunk sizes adaptive chunking picks for one long prompt")
    _add_platform_args(p, "llama-3-8b", "h100", tp=8)
    p.add_argument("--prompt-len", type=int, default=1_000_000,
                   help="prompt tokens (default: 1000000)")
    p.add_argument("--budget-ms", type=float, default=50.0,
                   help="iteration time budget in ms (default: 50)")
    p.add_argument("--chunking", default="adaptive", help="adaptive | static:N | none")
    p.add_argument("--all", action="store_true", help="print every chunk, not a sample")
    p.set_defaults(func=_cmd_chunks)

    p = sub.add_parser("predict", help="predicted time of one batch")
    _add_platform_args(p, "llama-3-8b", "h100")
    p.add_argument("--prefill", action="append", default=[], metavar="TOKENS@KV",
                   help="a prefill chunk of TOKENS after KV cached tokens (repeatable)")
    p.add_argument("--decode", action="append", default=[], metavar="COUNT@KV",
                   help="COUNT decodes over KV cached tokens each (repeatable)")
    p.set_defaults(func=_cmd_predict)

    from medha.engine.llm_engine import EngineConfig

    p = sub.add_parser("generate", help="complete one prompt with a real model",
                       description="Generate a completion with the engine (by default the "
                       "embedded SmolLM2-135M-Instruct, its chat template applied).")
    p.add_argument("--prompt", required=True, help="the prompt (a user message with --chat)")
    p.add_argument("--chat", action=argparse.BooleanOptionalAction, default=True,
                   help="apply the model's chat template (default: on)")
    g = p.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=128, help="most new tokens (default 128)")
    g.add_argument("--temperature", type=float, default=0.0,
                   help="0 is greedy (default: 0)")
    g.add_argument("--top-p", type=float, default=1.0, help="nucleus mass in (0, 1]")
    g.add_argument("--top-k", type=int, default=0, help="keep the k likeliest tokens (0: all)")
    g.add_argument("--seed", type=int, default=None, help="sampling seed")
    g.add_argument("--stop", action="append", help="stop string (repeatable)")
    g.add_argument("--ignore-eos", action="store_true", help="do not stop at end-of-sequence")
    add_dataclass_args(p, EngineConfig, title="engine")
    add_dataclass_args(p, SchedulerConfig, title="scheduler")
    p.set_defaults(func=_cmd_generate)

    p = sub.add_parser("profile", help="measure this machine's iteration times for the "
                       "fitted predictor",
                       description="Time real forward passes over a grid of prefill chunks, KV "
                       "offsets, decode batch sizes and KV lengths, and random mixed batches; "
                       "write a profile that --predictor profiled:PATH (and the engine, by "
                       "default) fits.")
    p.add_argument("--out", default=None, help="profile path (default: the engine's cache, "
                   "~/.cache/medha/profiles/<model>-<device>.json)")
    p.add_argument("--mixed", type=int, default=40, help="random mixed batches (default 40)")
    p.add_argument("--seed", type=int, default=0, help="seed of the mixed batches")
    p.add_argument("--quick", action="store_true", help="a coarser grid (for tests)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    add_dataclass_args(p, EngineConfig, title="engine")
    p.set_defaults(func=_cmd_profile)

    from medha.server.api_server import ServerConfig

    p = sub.add_parser("serve", help="OpenAI-compatible HTTP server",
                       description="Serve a model over the OpenAI API (/v1/completions, "
                       "/v1/chat/completions, /v1/models) with /health and Prometheus "
                       "/metrics. Per-request targets go in a `medha` object of the request "
                       "body: priority, ttft_slo_s, tpot_slo_s; the scheduler flags below set "
                       "the server-wide defaults. SIGTERM drains in-flight requests.")
    add_dataclass_args(p, ServerConfig, title="server")
    add_dataclass_args(p, EngineConfig, title="engine")
    add_dataclass_args(p, SchedulerConfig, title="scheduler")
    p.set_defaults(func=_cmd_serve)

    from medha.benchmark.load_generator import BenchConfig

    p = sub.add_parser("bench", help="load-test an OpenAI-compatible server",
                       description=__import__("medha.benchmark.load_generator").benchmark
                       .load_generator.__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    add_dataclass_args(p, BenchConfig, title="benchmark")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=_cmd_bench)

    from medha.sim.cli_simulate import DESCRIPTION, add_simulate_args

    p = sub.add_parser("simulate", help="simulate a cluster serving a workload",
                       description=DESCRIPTION,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    add_simulate_args(p)
    p.set_defaults(func=_cmd_simulate)
    parser.simulate_parser = p

    from medha.analysis.cli_analyze import DESCRIPTION as DEFERRED
    from medha.analysis.cli_analyze import DeferredPrefillArgs

    p = sub.add_parser("analyze", help="analytic models of scheduling policies",
                       description="Analytic models of scheduling policies, beside the "
                       "simulator's numbers.")
    models = p.add_subparsers(dest="model_name", metavar="MODEL", required=True)
    q = models.add_parser("deferred-prefill", help="throughput over the departure threshold K",
                          description=DEFERRED,
                          formatter_class=argparse.RawDescriptionHelpFormatter)
    _add_platform_args(q, "llama-3-8b", "h100")
    add_dataclass_args(q, DeferredPrefillArgs, title="system and curve")
    q.set_defaults(func=_cmd_analyze_deferred)

    p = sub.add_parser("hardware", help="print the hardware specs (measures this CPU once)")
    p.add_argument("--refresh", action="store_true", help="measure this CPU again")
    p.set_defaults(func=_cmd_hardware)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        if args.command == "simulate" and args.config:
            from medha.sim.cli_simulate import ConfigError, load_yaml

            # flags override the YAML file, which overrides the defaults
            try:
                values, compare = load_yaml(args.config, parser.simulate_parser)
            except ConfigError as e:
                raise CliError(str(e)) from None
            parser.simulate_parser.set_defaults(**values)
            args = parser.parse_args(argv)
            args.yaml_compare = compare
        args.func(args)
    except CliError as e:
        print(f"medha {args.command}: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
