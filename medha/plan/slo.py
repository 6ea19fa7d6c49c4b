"""SLOs: `ttft-p99=2,tpot-p99=0.1,short-ttft-p99=0.5`, checked against a simulation's summary."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

METRICS = {"ttft": "ttft_s", "tpot": "tpot_s", "tbt": "tbt_s", "e2e": "e2e_s"}
STATS = ("p50", "p90", "p99", "mean", "max")
CLASSES = ("short", "long")
_NAME = re.compile(r"(?:(short|long)-)?(ttft|tpot|tbt|e2e)-(p50|p90|p99|mean|max)")


@dataclass(frozen=True)
class Slo:
    name: str  # as the user wrote it, e.g. short-ttft-p99
    klass: str | None
    metric: str
    stat: str
    target_s: float

    def value(self, summary: dict) -> float:
        """The metric in a simulation's summary; inf where no request of the class finished."""
        where = summary["by_class"].get(self.klass, {}) if self.klass else summary
        v = where.get(METRICS[self.metric], {}).get(self.stat)
        return math.inf if v is None else float(v)


def parse_slos(text: str) -> list[Slo]:
    slos = []
    if not (text or "").strip():
        raise ValueError("slo: give at least one target, e.g. ttft-p99=2,tpot-p99=0.1")
    for item in text.split(","):
        name, sep, value = item.strip().partition("=")
        m = _NAME.fullmatch(name.strip().lower())
        if not sep or m is None:
            raise ValueError(
                f"slo: {item.strip()!r} is not [short-|long-]METRIC-STAT=SECONDS "
                f"(METRIC: {', '.join(METRICS)}; STAT: {', '.join(STATS)})"
            )
        try:
            target = float(value)
        except ValueError:
            target = math.nan
        if not (0 < target < math.inf):
            raise ValueError(f"slo: {name.strip()}={value!r}: the target must be seconds > 0")
        slos.append(Slo(name.strip().lower(), m[1], m[2], m[3], target))
    names = [s.name for s in slos]
    dup = next((n for n in names if names.count(n) > 1), None)
    if dup:
        raise ValueError(f"slo: {dup} given twice")
    return slos
