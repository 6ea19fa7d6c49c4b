"""Measured timings the fitted predictor learns from.

Two sources share one in-memory form:
- the Vidur CSV tables bundled in `medha/perf/profiles/` (per-op ms vs num_tokens and TP degree;
  collectives ms vs message bytes), and
- medha's own JSON profile, written by `medha profile` on the machine that will serve:

    {"format": "medha-profile", "version": 1, "model": "...", "hardware": "...",
     "ops": [{"op": "mlp_up_proj", "num_tokens": 64, "tp": 1, "time_ms": 0.1}, ...],
     "collectives": [{"collective": "all_reduce", "num_workers": 2, "devices_per_node": 2,
                      "size_bytes": 4096, "time_ms": 0.02}, ...],
     "iterations": [{"tp": 1, "prefills": [[chunk, kv_offset], ...], "decode_kv": [kv, ...],
                     "time_ms": 12.5}, ...]}

  `iterations` are whole measured forward passes; every section is optional.
"""

from __future__ import annotations

import csv
import json
from dataclasses import dataclass, field
from pathlib import Path

PROFILE_DIR = Path(__file__).parent / "profiles"
FORMAT = "medha-profile"


@dataclass(frozen=True)
class IterationRow:
    tp: int
    prefills: tuple[tuple[int, int], ...]
    decode_kv: tuple[int, ...]
    seconds: float


@dataclass
class Profile:
    sources: list[str] = field(default_factory=list)
    model: str | None = None
    hardware: str | None = None
    op_rows: list[tuple[str, int, int, float]] = field(default_factory=list)  # op, n, tp, s
    # collective, num_workers, devices_per_node, bytes, seconds
    collective_rows: list[tuple[str, int, int, int, float]] = field(default_factory=list)
    iteration_rows: list[IterationRow] = field(default_factory=list)

    def merge(self, other: Profile) -> None:
        self.sources += other.sources
        self.model = self.model or other.model
        self.hardware = self.hardware or other.hardware
        self.op_rows += other.op_rows
        self.collective_rows += other.collective_rows
        self.iteration_rows += other.iteration_rows

    def to_json(self) -> dict:
        return {
            "format": FORMAT,
            "version": 1,
            "model": self.model,
            "hardware": self.hardware,
            "ops": [
                {"op": o, "num_tokens": n, "tp": tp, "time_ms": s * 1e3}
                for o, n, tp, s in self.op_rows
            ],
            "collectives": [
                {
                    "collective": c,
                    "num_workers": w,
                    "devices_per_node": d,
                    "size_bytes": b,
                    "time_ms": s * 1e3,
                }
                for c, w, d, b, s in self.collective_rows
            ],
            "iterations": [
                {
                    "tp": r.tp,
                    "prefills": [list(p) for p in r.prefills],
                    "decode_kv": list(r.decode_kv),
                    "time_ms": r.seconds * 1e3,
                }
                for r in self.iteration_rows
            ],
        }

    def save(self, path: str | Path) -> None:
        """Write atomically, so an interrupted run never leaves a truncated profile behind;
        the directory is made if it is missing."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps(self.to_json(), indent=1))
        tmp.replace(path)


class ProfileError(ValueError):
    pass


def _num(row: dict, key: str, where: str, kind=float):
    try:
        value = kind(row[key])
    except KeyError:
        raise ProfileError(f"{where}: missing column {key!r}") from None
    except (TypeError, ValueError):
        raise ProfileError(f"{where}: {key}={row.get(key)!r} is not a number") from None
    if value < 0:
        raise ProfileError(f"{where}: {key}={value} is negative")
    return value


def _load_vidur_ops(path: Path, reader: csv.DictReader) -> Profile:
    ops = sorted({c.split(".")[1] for c in reader.fieldnames or [] if c.startswith("time_stats.")})
    prof = Profile(sources=[str(path)])
    for line, row in enumerate(reader, start=2):
        where = f"{path}:{line}"
        n = _num(row, "num_tokens", where, int)
        tp = _num(row, "num_tensor_parallel_workers", where, int)
        for op in ops:
            if row.get(f"time_stats.{op}.median", "") != "":
                prof.op_rows.append((op, n, tp, _num(row, f"time_stats.{op}.median", where) * 1e-3))
    return prof


def _load_vidur_collective(path: Path, reader: csv.DictReader) -> Profile:
    prof = Profile(sources=[str(path)])
    for line, row in enumerate(reader, start=2):
        where = f"{path}:{line}"
        coll = row.get("collective") or ""
        prof.collective_rows.append(
            (
                coll,
                _num(row, "num_workers", where, int),
                _num(row, "devices_per_node", where, int),
                _num(row, "size", where, int),
                _num(row, f"time_stats.{coll}.median", where) * 1e-3,
            )
        )
    return prof


def _load_json(path: Path) -> Profile:
    try:
        data = json.loads(path.read_text())
    except ValueError as e:
        raise ProfileError(f"{path}: not valid JSON ({e})") from None
    return profile_from_json(data, str(path))


def profile_from_json(data: object, path: str) -> Profile:
    """A profile from its JSON form (`Profile.to_json`), read from `path` (a file, or where
    else it came from: named in the errors). ProfileError for anything else."""
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise ProfileError(f'{path}: not a medha profile (expected "format": "{FORMAT}")')
    prof = Profile(sources=[path], model=data.get("model"), hardware=data.get("hardware"))
    for key in ("ops", "collectives", "iterations"):
        if not isinstance(data.get(key, []), list):
            raise ProfileError(f"{path}: {key} must be a list")
    for i, r in enumerate(data.get("ops", [])):
        where = f"{path}: ops[{i}]"
        prof.op_rows.append(
            (
                str(r.get("op")),
                _num(r, "num_tokens", where, int),
                _num(r, "tp", where, int),
                _num(r, "time_ms", where) * 1e-3,
            )
        )
    for i, r in enumerate(data.get("collectives", [])):
        where = f"{path}: collectives[{i}]"
        prof.collective_rows.append(
            (
                str(r.get("collective")),
                _num(r, "num_workers", where, int),
                _num(r, "devices_per_node", where, int),
                _num(r, "size_bytes", where, int),
                _num(r, "time_ms", where) * 1e-3,
            )
        )
    for i, r in enumerate(data.get("iterations", [])):
        where = f"{path}: iterations[{i}]"
        try:
            prefills = tuple((int(n), int(k)) for n, k in r.get("prefills", []))
            decode_kv = tuple(int(k) for k in r.get("decode_kv", []))
        except (TypeError, ValueError):
            raise ProfileError(
                f"{where}: prefills must be [chunk, kv_offset] pairs and "
                "decode_kv a list of integers"
            ) from None
        if not prefills and not decode_kv:
            raise ProfileError(f"{where}: an iteration needs prefills or decodes")
        prof.iteration_rows.append(
            IterationRow(
                _num(r, "tp", where, int), prefills, decode_kv, _num(r, "time_ms", where) * 1e-3
            )
        )
    return prof


def load_profile(path: str | Path) -> Profile:
    """Load a profile file, or every profile file in a directory."""
    path = Path(path)
    if not path.exists():
        raise ProfileError(f"profile {path} does not exist")
    if path.is_dir():
        prof = Profile()
        files = sorted(p for p in path.iterdir() if p.suffix in (".csv", ".json"))
        if not files:
            raise ProfileError(f"profile directory {path} holds no .csv or .json files")
        for f in files:
            prof.merge(load_profile(f))
        return prof
    if path.suffix == ".json":
        return _load_json(path)
    with path.open(newline="") as fh:
        reader = csv.DictReader(fh)
        cols = set(reader.fieldnames or [])
        if "num_tensor_parallel_workers" in cols:
            return _load_vidur_ops(path, reader)
        if "collective" in cols:
            return _load_vidur_collective(path, reader)
    raise ProfileError(
        f"{path}: unrecognised profile columns; expected a Vidur op table, a "
        "Vidur collective table or a medha JSON profile"
    )


BUNDLED = {
    ("a100", "llama-3-8b"): [
        "a100_Meta-Llama-3-8B_mlp.csv",
        "a100_dgx_all_reduce.csv",
        "a100_dgx_send_recv.csv",
    ],
    ("a100", "llama-3-70b"): [
        "a100_Meta-Llama-3-70B_mlp.csv",
        "a100_dgx_all_reduce.csv",
        "a100_dgx_send_recv.csv",
    ],
    ("h100", None): ["h100_dgx_all_reduce.csv", "h100_dgx_send_recv.csv"],
    ("h200", None): ["h100_dgx_all_reduce.csv", "h100_dgx_send_recv.csv"],  # same NVLink fabric
}


def bundled_profile(hardware: str, model: str) -> Profile:
    files = BUNDLED.get((hardware, model)) or BUNDLED.get((hardware, None))
    if not files:
        raise ProfileError(
            f"no bundled profile for {model} on {hardware}; measure one with "
            "`medha profile` and pass --predictor profiled:PATH"
        )
    prof = Profile()
    for name in files:
        prof.merge(load_profile(PROFILE_DIR / name))
    prof.model, prof.hardware = model, hardware
    return prof
