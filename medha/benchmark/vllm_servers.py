"""The servers the vLLM benchmarks compare, built from one set of flags so that they differ only
in the scheduler (and, with --front medha, the front end):

- `vLLM`: vLLM's OpenAI server with its own scheduler;
- `vLLM + medha`: the same server with `--scheduler-cls medha.vllm_executor.MedhaScheduler`
  and medha's settings in `--additional-config`;
- with front "medha", the medha contenders run `medha serve --engine vllm` instead (medha's
  HTTP server over vLLM's engine, the same scheduler).

Every server gets the same dtype, context, KV cache size and batch limits, set explicitly
(vLLM's OpenAI-server defaults on a CPU: 2,048 tokens and 128 sequences per step).
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field

from medha.perf.hardware_specs import cpu_serving_dtype


@dataclass
class ServerFlags:
    model: str
    dtype: str = "auto"  # as server_flags resolves it: float32 on a CPU without bf16
    max_model_len: int = 8192
    kv_gib: float = 2.0
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 128
    enforce_eager: bool = False
    medha_extra: dict = field(default_factory=dict)  # merged into every medha contender's settings


# vLLM's own flags against the convoy, as a user tunes them (vLLM 0.32 and 0.33): a prefill's
# chunk capped at N tokens while other requests are present (the whole step when it is alone),
# the cap floored at a fair share of the step's tokens (-adaptive), a smaller step
TUNED_VLLM = [
    *(f"--long-prefill-token-threshold {n}" for n in (64, 128, 256, 512, 1024)),
    *(
        f"--long-prefill-token-threshold {n} --long-prefill-token-threshold-adaptive"
        for n in (64, 128, 256, 512, 1024)
    ),
    "--max-num-batched-tokens 512",
    "--max-num-batched-tokens 1024",
]


def server_command(
    flags: ServerFlags, medha: dict | None, front: str = "vllm", vllm_args: str = ""
):
    """`command(port)` for local_server: plain vLLM when `medha` is None (with `vllm_args`,
    vLLM's own flags, after the shared ones: a tuned peer), else vLLM with medha's scheduler
    behind vLLM's server (front "vllm") or medha's (front "medha")."""

    if medha is not None:
        medha = medha | flags.medha_extra

    def command(port: int) -> list[str]:
        if medha is not None and front == "medha":
            engine = ["--engine", "vllm", "--max-batch-tokens", str(flags.max_num_batched_tokens)]
            cmd = _medha_serve(flags, medha, port, engine)
            if flags.enforce_eager:
                cmd += ["--vllm-arg", "enforce_eager=true"]
            return cmd
        cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", flags.model]
        cmd += ["--served-model-name", "m", "--port", str(port), "--dtype", flags.dtype]
        cmd += ["--max-model-len", str(flags.max_model_len)]
        cmd += ["--kv-cache-memory-bytes", str(int(flags.kv_gib * (1 << 30)))]
        cmd += ["--max-num-batched-tokens", str(flags.max_num_batched_tokens)]
        cmd += ["--max-num-seqs", str(flags.max_num_seqs), "--disable-log-stats"]
        cmd += ["--uvicorn-log-level", "warning"]
        if flags.enforce_eager:
            cmd += ["--enforce-eager"]
        if medha is not None:
            cmd += ["--scheduler-cls", "medha.vllm_executor.MedhaScheduler"]
            cmd += ["--additional-config", json.dumps({"medha": medha})]
        else:
            cmd += vllm_args.split()
        return cmd

    return command


def engine_command(flags: ServerFlags, medha: dict):
    """`command(port)` for local_server: `medha serve` on medha's own engine, with the same
    model, dtype, context, KV cache size and sequences per step as the vLLM servers (not vLLM's
    cap on a step's tokens, which medha's engine does not have), and `medha`'s settings as
    its flags."""

    def command(port: int) -> list[str]:
        return _medha_serve(flags, medha, port, [])

    return command


def _medha_serve(flags: ServerFlags, medha: dict, port: int, engine: list[str]) -> list[str]:
    """`medha serve` with the flags every server shares, then `engine`'s (none: medha's own
    engine), then `medha`'s settings as flags (last, so that they win)."""
    cmd = [sys.executable, "-m", "medha", "serve", *engine, "--model", flags.model]
    cmd += ["--served-model-name", "m", "--port", str(port), "--dtype", flags.dtype]
    cmd += ["--kv-memory-gb", str(flags.kv_gib), "--max-model-len", str(flags.max_model_len)]
    cmd += ["--max-num-seqs", str(flags.max_num_seqs), "--log-level", "warning"]
    for key, value in medha.items():
        cmd += ["--" + key.replace("_", "-"), str(value)]
    return cmd


def add_server_args(ap) -> None:
    ap.add_argument("--model", default=None, help="model directory (default: SmolLM2)")
    ap.add_argument(
        "--dtype",
        default="auto",
        help="every server's --dtype (default auto: medha's rule, float32 on a CPU without bf16 "
        "instructions, where vLLM's own auto would emulate the checkpoint's bf16; else vLLM's "
        "choice)",
    )
    ap.add_argument("--kv-gib", type=float, default=2.0, help="KV cache of each server (GiB)")
    ap.add_argument(
        "--max-model-len",
        type=int,
        default=ServerFlags.max_model_len,
        help="every server's context (default 8,192, SmolLM2's; longer with a model directory "
        "whose config.json allows it)",
    )
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--max-num-seqs", type=int, default=128)
    ap.add_argument("--enforce-eager", action="store_true", help="no torch.compile (faster start)")
    ap.add_argument(
        "--medha-extra",
        type=json.loads,
        default={},
        metavar="JSON",
        help="settings added to every medha contender's, e.g. '{\"tpot_target_s\": 0.15}'",
    )
    ap.add_argument(
        "--front",
        choices=("vllm", "medha"),
        default="vllm",
        help="front end of the medha contenders: vLLM's OpenAI server with --scheduler-cls "
        "(the same front end as plain vLLM: only the scheduler differs), or `medha serve "
        "--engine vllm` (default: vllm)",
    )


def server_flags(args) -> ServerFlags:
    model = args.model
    if model is None:  # (the engine's checkpoint code, and torch, only for the default model)
        from medha.engine.checkpoint import resolve_model

        model = str(resolve_model("smollm2"))
    return ServerFlags(
        model=model,
        dtype=cpu_serving_dtype(args.dtype),  # the same for every server, tuned peers included
        kv_gib=args.kv_gib,
        max_model_len=args.max_model_len,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_num_seqs=args.max_num_seqs,
        enforce_eager=args.enforce_eager,
        medha_extra=args.medha_extra,
    )


DEFAULT_MEDHA = {"policy": "lars", "chunking": "adaptive"}


@dataclass(frozen=True)
class Contender:
    """One server of a side-by-side benchmark: `command(port)` for local_server, and medha's
    settings where it runs medha's scheduler (None: one of vLLM's own)."""

    command: Callable[[int], list[str]]
    medha: dict | None = None
    engine: bool = False  # medha's own engine (`medha serve`), not vLLM's
    peer: bool = False  # plain vLLM with its own convoy flags (a tuned peer)
    # vLLM scheduling by the `priority` its requests carry (--scheduling-policy priority):
    # vllm_goodput.py sends each request its prompt's length (`BenchConfig.send_priority`);
    # the convoy benches send none, so there the flag orders as fcfs does
    priority: bool = False


def add_contender_args(ap) -> None:
    """The flags that choose the contenders (beside add_server_args's, which every one
    shares); `contenders(args)` reads them."""
    ap.add_argument(
        "--medha",
        action="append",
        default=None,
        help="medha's settings (JSON); repeat for several medha contenders, each run beside "
        f"plain vLLM in every round (default: {json.dumps(DEFAULT_MEDHA)}; none: no medha "
        "scheduler on vLLM, with --engine-medha contenders only)",
    )
    ap.add_argument(
        "--engine-medha",
        action="append",
        default=None,
        metavar="JSON",
        help="a contender on medha's own engine: `medha serve` with these settings as its flags "
        "(JSON, {} for its defaults); repeat for several",
    )
    add_peer_arg(ap)
    ap.add_argument(
        "--tuned-peers",
        action="store_true",
        help="every setting of the sweep as a --peer: --long-prefill-token-threshold 64 to "
        "1,024, with and without -adaptive, and --max-num-batched-tokens 512 and 1,024",
    )
    ap.add_argument(
        "--fresh-cache",
        action="store_true",
        help="start each medha server (on vLLM or its own engine) with an empty "
        "MEDHA_CACHE_DIR (the model stays where it is): no profile of its own, as on a new "
        "machine, so that medha's engine times itself at start (--self-profile-s) or plans "
        "from the roofline corrected online, as medha's scheduler on vLLM does",
    )
    ap.add_argument(
        "--bind",
        default=None,
        metavar="CORES",
        help="VLLM_CPU_OMP_THREADS_BIND of every vLLM server, plain vLLM's and medha's on vLLM "
        "(the same binding for each), e.g. 0-1 for both cores of this machine; --plain-bind "
        "overrides it for plain vLLM",
    )
    ap.add_argument(
        "--plain-bind",
        default=None,
        metavar="CORES",
        help="VLLM_CPU_OMP_THREADS_BIND of plain vLLM's servers only, e.g. 0-1 for both cores "
        "of this machine (default: vLLM's own binding, every core but one, as medha's servers)",
    )


def add_peer_arg(ap, binding: str = "plain vLLM's") -> None:
    """--peer: a tuned plain vLLM (the benches that take no other contender flags add it alone),
    bound to the cores `binding` says."""
    ap.add_argument(
        "--peer",
        action="append",
        default=[],
        metavar="ARGS",
        help="a tuned plain vLLM: vLLM's own flags, e.g. '--long-prefill-token-threshold 256' "
        f"(repeat for several; each with {binding} binding)",
    )


def contenders(args, flags: ServerFlags) -> dict[str, Contender]:
    """Plain vLLM first, then the tuned peers, medha's scheduler on vLLM, medha's engine."""
    given = args.medha or [json.dumps(DEFAULT_MEDHA)]
    settings = [] if given == ["none"] else [json.loads(m) for m in given]
    peers = args.peer + (TUNED_VLLM if args.tuned_peers else [])
    out = {"vLLM": Contender(server_command(flags, None, args.front))}
    out |= {
        f"vLLM {a}": Contender(
            server_command(flags, None, args.front, a), peer=True, priority=by_priority(a)
        )
        for a in peers
    }
    out |= {label(m): Contender(server_command(flags, m, args.front), m) for m in settings}
    engines = map(json.loads, args.engine_medha or [])
    out |= {engine_label(m): Contender(engine_command(flags, m), m, engine=True) for m in engines}
    return out


def by_priority(vllm_args: str) -> bool:
    """Whether vLLM's flags `vllm_args` schedule by the requests' own priorities."""
    words = vllm_args.replace("=", " ").split()  # (as server_command splits them)
    return any(a == "--scheduling-policy" and b == "priority" for a, b in zip(words, words[1:]))


def server_env(args, contender: Contender, step_log: str | None = None) -> dict:
    """The environment of a contender's server: its step log, vLLM's CPU binding (the same for
    every vLLM server unless --plain-bind), an empty medha cache with --fresh-cache."""
    env = dict(os.environ)
    if step_log:
        env["MEDHA_STEP_LOG"] = step_log
    plain = contender.medha is None
    bind = args.plain_bind if plain and args.plain_bind else args.bind
    if bind and not contender.engine:
        env["VLLM_CPU_OMP_THREADS_BIND"] = bind
    if args.fresh_cache and not plain:
        env["MEDHA_CACHE_DIR"] = tempfile.mkdtemp(prefix="medha-bench-cache-")
    return env


def engine_label(settings: dict) -> str:
    """`medha engine (lars, adaptive)`, with any other settings after them."""
    return "medha engine" + label(settings).removeprefix("vLLM + medha")


def label(medha: dict) -> str:
    """`vLLM + medha (lars, adaptive)`, with any other settings after them."""
    rest = [f"{k}={v}" for k, v in medha.items() if k not in ("policy", "chunking")]
    parts = [medha.get("policy", "lars"), medha.get("chunking", "adaptive"), *rest]
    return f"vLLM + medha ({', '.join(parts)})"
