"""`medha simulate`: flags, an optional YAML file, and --compare runs."""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import sys
import typing
from pathlib import Path

from medha.cli.common import CliError
from medha.perf import ParallelConfig
from medha.scheduler.config import SchedulerConfig
from medha.sim.config import ClusterConfig
from medha.sim.workload.generator import WorkloadConfig
from medha.utils.dataclass_cli import add_dataclass_args, dataclass_from_args, flags

if typing.TYPE_CHECKING:
    from medha.sim.runner import RunSpec

RUN_CONFIGS = (ClusterConfig, ParallelConfig, SchedulerConfig)
DESCRIPTION = """\
Simulate a cluster serving a workload with the real scheduler, batch times from the runtime
predictor. Writes summary.json, requests.csv, iterations.csv and PNG plots to --out.

Flags may also come from a YAML file (--config): keys are flag names (model, tp, policy, qps,
...), and an optional `compare:` list of runs, each a mapping of a name and the flags it
changes. --compare SPEC ... does the same from the command line, e.g.
  --compare name=medha,policy=lars name=orca,policy=fcfs,chunking=none
Every compared run sees the identical request list; the table goes to compare.md.
"""


class ConfigError(ValueError):
    pass


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "simulate",
        help="simulate a cluster serving a workload",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_dataclass_args(p, ClusterConfig, title="cluster")
    add_dataclass_args(p, ParallelConfig, title="parallelism (per replica)")
    add_dataclass_args(p, SchedulerConfig, title="scheduler")
    add_dataclass_args(p, WorkloadConfig, title="workload")
    g = p.add_argument_group("runs and output")
    g.add_argument("--config", metavar="YAML", help="read flags (and compare runs) from YAML")
    g.add_argument(
        "--compare",
        nargs="+",
        metavar="SPEC",
        default=None,
        help="runs to compare: name=NAME,flag=value,... (flags as above)",
    )
    g.add_argument("--name", default="run", help="name of the run (default: run)")
    g.add_argument(
        "--long-threshold",
        type=int,
        default=None,
        help="prompt tokens from which a request counts as long in the metrics "
        "(default: the scheduler's --long-prefill-threshold, whose default is "
        "min(32768, max_model_len / 4))",
    )
    g.add_argument("--out", default="sim-out", help="output directory (default: sim-out)")
    g.add_argument(
        "--overwrite",
        action="store_true",
        help="replace an existing --out directory, or a symlink there (the link, "
        "not what it points to); a file is never replaced",
    )
    g.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    g.add_argument(
        "--save-token-times",
        action="store_true",
        help="also write every request's token timestamps (token_times.jsonl)",
    )
    g.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=run)


def _field_types() -> dict[str, type]:
    types = {}
    for cls in RUN_CONFIGS + (WorkloadConfig,):
        types.update({f.name: f.type for f in flags(cls)})
    types["long_threshold"] = int
    return types


def _convert(key: str, value, where: str):
    tp = _field_types()[key]
    if isinstance(value, str) and tp is not str:
        text = value.strip().lower()
        try:
            if tp is bool:
                if text not in ("true", "false", "yes", "no", "1", "0"):
                    raise ValueError
                return text in ("true", "yes", "1")
            return None if text in ("none", "null") else tp(value)
        except ValueError:
            raise ConfigError(f"{where}: {key}={value!r} is not a valid {tp.__name__}") from None
    if tp is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    return value


def _normalize(key: str) -> str:
    return key.replace("-", "_")


def load_yaml(path: str, parser: argparse.ArgumentParser) -> tuple[dict, list[dict] | None]:
    import yaml

    try:
        data = yaml.safe_load(Path(path).read_text())
    except OSError as e:
        raise ConfigError(f"--config {path}: {e.strerror}") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"--config {path}: not valid YAML ({e})") from None
    if data is None:
        return {}, None
    if not isinstance(data, dict):
        raise ConfigError(f"--config {path}: expected a mapping of flag names to values")
    known = {a.dest for a in parser._actions}
    compare = data.pop("compare", None)
    values = {}
    for key, value in data.items():
        dest = _normalize(str(key))
        if dest not in known or dest in ("config", "compare", "help"):
            raise ConfigError(f"--config {path}: unknown key {key!r}")
        values[dest] = (
            _convert(dest, value, f"--config {path}") if dest in _field_types() else value
        )
    if compare is not None:
        if not isinstance(compare, list) or not all(isinstance(c, dict) for c in compare):
            raise ConfigError(f"--config {path}: compare must be a list of mappings")
        compare = [{_normalize(str(k)): v for k, v in c.items()} for c in compare]
    return values, compare


def parse_with_config(
    parser: argparse.ArgumentParser, argv: list[str] | None, path: str
) -> argparse.Namespace:
    """Parse `argv` again with the YAML file's values as defaults: flags override the file,
    which overrides the defaults."""
    try:
        values, compare = load_yaml(path, parser.simulate_parser)
    except ConfigError as e:
        raise CliError(str(e)) from None
    parser.simulate_parser.set_defaults(**values)
    args = parser.parse_args(argv)
    args.yaml_compare = compare
    return args


def parse_compare_spec(spec: str) -> dict:
    out = {}
    for part in spec.split(","):
        if not part.strip():
            continue
        key, sep, value = part.partition("=")
        if not sep:
            raise ConfigError(f"--compare {spec!r}: expected name=NAME,flag=value,...")
        out[_normalize(key.strip())] = value.strip()
    return out


def _run_spec(values: dict, where: str) -> RunSpec:
    from medha.sim.runner import RunSpec  # the simulator, numpy and matplotlib

    try:
        return RunSpec(
            name=str(values.get("name", "run")),
            cluster=dataclass_from_args(ClusterConfig, argparse.Namespace(**values)),
            parallel=dataclass_from_args(ParallelConfig, argparse.Namespace(**values)),
            scheduler=dataclass_from_args(SchedulerConfig, argparse.Namespace(**values)),
            long_threshold=values["long_threshold"],
        )
    except ValueError as e:
        raise ConfigError(f"{where}: {e}") from None


def build_specs(
    args: argparse.Namespace, yaml_compare: list[dict] | None
) -> tuple[list[RunSpec], WorkloadConfig]:
    base = vars(args).copy()
    try:
        workload = dataclass_from_args(WorkloadConfig, args)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    runs = []
    compare = [parse_compare_spec(s) for s in args.compare] if args.compare else yaml_compare
    if not compare:
        return [_run_spec(base, "flags")], workload
    allowed = set(_field_types()) - {f.name for f in dataclasses.fields(WorkloadConfig)}
    for i, overrides in enumerate(compare):
        where = f"compare run {i + 1}"
        bad = set(overrides) - allowed - {"name"}
        if bad:
            raise ConfigError(
                f"{where}: cannot set {', '.join(sorted(bad))} per run (workload "
                "flags are shared, so that every run sees the same requests)"
            )
        if "name" not in overrides:
            raise ConfigError(f"{where}: give it a name=...")
        values = dict(base)
        for key, value in overrides.items():
            values[key] = value if key == "name" else _convert(key, value, where)
        runs.append(_run_spec(values, where))
    names = [r.name for r in runs]
    for name in names:
        if not re.fullmatch(r"[A-Za-z0-9][\w.+-]*", name):
            raise ConfigError(f"run name {name!r}: use letters, digits, . _ + -")
    if len(set(names)) != len(names):
        raise ConfigError(f"run names must be unique, got {names}")
    return runs, workload


def run(args: argparse.Namespace) -> None:
    from medha.perf.profile_data import ProfileError
    from medha.sim.runner import OutputDirError, output_dir, simulate, write_compare, write_run
    from medha.sim.workload.traces import TraceError

    try:
        specs, workload = build_specs(args, getattr(args, "yaml_compare", None))
        compare = len(specs) > 1 or bool(args.compare) or bool(getattr(args, "yaml_compare", None))
        outcomes = []
        with output_dir(args.out, args.overwrite) as tmp:
            for spec in specs:
                if not args.quiet and spec.cluster.system == "loongserve":
                    loong = spec.cluster.loong
                    print(
                        f"[{spec.name}] loongserve: {spec.cluster.model} on "
                        f"{loong.instances} elastic instances of {spec.parallel.tp} "
                        f"{spec.cluster.hardware} (prefills over up to {loong.max_degree}"
                        + (
                            f"; {loong.reserved_short} reserved for prompts under "
                            f"{loong.short_threshold} tokens"
                            if loong.reserved_short
                            else ""
                        )
                        + (
                            f"; prefills start every {loong.prefill_every} decode iterations"
                            if loong.prefill_every
                            else ""
                        )
                        + ")",
                        file=sys.stderr,
                    )
                elif not args.quiet:
                    print(
                        f"[{spec.name}] {spec.cluster.replicas} x {spec.cluster.model} on "
                        f"{spec.parallel.world_size} {spec.cluster.hardware} (tp "
                        f"{spec.parallel.tp}, spp {spec.parallel.spp}, kvp "
                        f"{spec.parallel.kvp}); {spec.scheduler.policy or 'default'} policy, "
                        f"{spec.scheduler.chunking} chunking",
                        file=sys.stderr,
                    )
                outcome = simulate(spec, workload, progress=not args.quiet)
                write_run(
                    tmp / spec.name if compare else tmp,
                    outcome,
                    plots=not args.no_plots,
                    token_times=args.save_token_times,
                )
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
        print(
            json.dumps(
                {
                    "requests": s["requests"],
                    "ttft_s": s["ttft_s"],
                    "short_ttft_s": short["ttft_s"],
                    "long_ttft_s": long_["ttft_s"],
                    "tpot_s": s["tpot_s"],
                    "slo_attainment": s["slo_attainment"],
                    "throughput": s["throughput"],
                    "sim": s["sim"],
                },
                indent=1,
            )
        )
    print(f"results in {args.out}/", file=sys.stderr)
