"""The search space of `medha plan`: which values each axis may take, from flags or YAML.

A point is one deployment: device kind, tp x spp x kvp per replica, replicas, scheduler
(policy and chunking), iteration budget, dispatcher and KV memory. Everything is checked
here, before any simulation runs, and an error names the key it is about.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field

from medha.plan.cost import devices

# axis -> (type, default values); None in a list means "the simulator's default"
AXES: dict[str, tuple[type, list]] = {
    "hardware": (str, ["h100"]),
    "tp": (int, [1, 2, 4, 8]),
    "spp": (int, [1]),
    "kvp": (int, [1]),
    "replicas": (int, [1, 2, 4, 8]),
    "scheduler": (str, ["lars", "fcfs/none"]),
    "iteration_budget_s": (float, [None]),
    "dispatcher": (str, ["round_robin"]),
    "kv_memory_gb": (float, [None]),
}
LIMITS = ("max_devices",)


class SpaceError(ValueError):
    """A malformed search space; the message starts with the key."""


@dataclass
class SearchSpace:
    axes: dict[str, list] = field(
        default_factory=lambda: {k: list(v) for k, (_, v) in AXES.items()}
    )
    max_devices: int | None = None

    @classmethod
    def from_mapping(cls, data: dict) -> SearchSpace:
        if not isinstance(data, dict):
            raise SpaceError("search space: expected a mapping of axis names to lists of values")
        space = cls()
        for raw_key, value in data.items():
            key = str(raw_key).replace("-", "_")
            if key in LIMITS:
                if value is not None and (
                    not isinstance(value, int) or isinstance(value, bool) or value < 1
                ):
                    raise SpaceError(f"{raw_key}: must be a positive integer, got {value!r}")
                space.max_devices = value
                continue
            if key not in AXES:
                raise SpaceError(
                    f"{raw_key}: not a search axis (axes: {', '.join(AXES)}; limits: "
                    f"{', '.join(LIMITS)})"
                )
            space.axes[key] = _values(raw_key, AXES[key][0], value)
        space.check()
        return space

    def check(self) -> None:
        """Every value builds the config it belongs to: a bad policy fails here, not in a worker."""
        from medha.perf.hardware_specs import HARDWARE_NAMES
        from medha.scheduler.config import SchedulerConfig
        from medha.sim.config import ClusterConfig

        for hw in self.axes["hardware"]:
            if hw.lower() not in HARDWARE_NAMES:
                raise SpaceError(
                    f"hardware: unknown device {hw!r} (known: {', '.join(HARDWARE_NAMES)})"
                )
        for s in self.axes["scheduler"]:
            try:
                SchedulerConfig(**scheduler_fields(s))
            except (ValueError, KeyError) as e:
                raise SpaceError(f"scheduler: {s!r}: {e}") from None
        for budget in self.axes["iteration_budget_s"]:
            if budget is not None and not (0 < budget < math.inf):
                raise SpaceError(f"iteration_budget_s: {budget!r} is not seconds > 0")
        for d in self.axes["dispatcher"]:
            try:
                ClusterConfig(dispatcher=d)
            except (ValueError, KeyError) as e:
                raise SpaceError(f"dispatcher: {d!r}: {e}") from None
        for gb in self.axes["kv_memory_gb"]:
            if gb is not None and not (0 < gb < math.inf):
                raise SpaceError(f"kv_memory_gb: {gb!r} is not GiB > 0")

    def chains(self) -> list[list[dict]]:
        """The grid as chains: each the same deployment at every replica count, ascending, so
        that the search can stop a chain at the first count that meets the SLOs; points over
        max_devices are left out."""
        a = self.axes
        chains = []
        for hw, tp, spp, kvp, sched, budget, disp, kv in itertools.product(
            a["hardware"], a["tp"], a["spp"], a["kvp"], a["scheduler"],
            a["iteration_budget_s"], a["dispatcher"], a["kv_memory_gb"],
        ):  # fmt: skip
            chain = [
                {
                    "hardware": hw.lower(),
                    "tp": tp,
                    "spp": spp,
                    "kvp": kvp,
                    "replicas": n,
                    "scheduler": sched,
                    "iteration_budget_s": budget,
                    "dispatcher": disp,
                    "kv_memory_gb": kv,
                }  # fmt: skip
                for n in sorted(set(a["replicas"]))
            ]
            if self.max_devices is not None:
                chain = [p for p in chain if devices(p) <= self.max_devices]
            chains.append(chain)
        return chains

    @property
    def grid_size(self) -> int:
        return math.prod(len(v) for v in self.axes.values())  # _values refuses duplicates


def scheduler_fields(text: str) -> dict:
    """'lars' -> policy lars (its default chunking); 'fcfs/static:512' -> policy and chunking."""
    policy, _, chunking = str(text).partition("/")
    fields = {"policy": policy.strip()}
    if chunking.strip():
        fields["chunking"] = chunking.strip()
    return fields


def _values(key: str, tp: type, value) -> list:
    items = value if isinstance(value, list) else [value]
    if not items:
        raise SpaceError(f"{key}: give at least one value")
    out = []
    for v in items:
        if v is None or (isinstance(v, str) and v.strip().lower() in ("default", "none", "null")):
            if tp in (int, str):
                raise SpaceError(f"{key}: {v!r} is not allowed here; give a {tp.__name__}")
            out.append(None)
            continue
        if tp is int:
            if isinstance(v, str) and v.strip().lstrip("+").isdigit():
                v = int(v)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise SpaceError(f"{key}: {v!r} is not a positive integer")
        elif tp is float:
            try:
                v = float(v) if not isinstance(v, bool) else math.nan
            except (TypeError, ValueError):
                raise SpaceError(f"{key}: {v!r} is not a number") from None
        elif not isinstance(v, str) or not v.strip():
            raise SpaceError(f"{key}: {v!r} is not a name")
        out.append(v)
    if len(set(out)) != len(out):
        raise SpaceError(f"{key}: a value is given twice")
    return out


def parse_list(text: str) -> list[str]:
    return [t.strip() for t in text.split(",") if t.strip()]
