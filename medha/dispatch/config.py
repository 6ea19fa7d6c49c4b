"""The dispatchers' settings: their names and the pla dispatcher's controller (`medha simulate`
flags, through ClusterConfig). A module of its own, importing nothing of the scheduler or numpy,
so that the CLI's parser (`medha simulate --help`, `medha route --help`) builds from it alone."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Protocol

from medha.utils.registry import unknown_name

# The dispatchers by name, each implemented by one module of medha/dispatch that registers under
# it: listed here so that a config is checked without importing the dispatchers (and the
# scheduler and numpy they bring); tests/test_simulator.py keeps the list and the registry equal.
DISPATCHER_NAMES = ("round_robin", "least_work", "prefix", "slack", "pla")
PLA_DISPATCHER = "pla dispatcher"


def _help(text: str) -> dict:
    return {"group": PLA_DISPATCHER, "help": text}


PLA_AGGREGATORS = ("p90", "mean", "max")


@dataclass
class PlaDispatcherSettings:
    """The pla dispatcher's settings (flags --pla-*; medha/dispatch/pla_dispatcher.py):
    the instance-pressure controller of PLA-Serve's Algorithm 2. The paper names the
    parameters and the P90 aggregate, no values; the defaults are ours. Its short/long boundary
    L_m is the pla policy's (SchedulerConfig.pla)."""

    long_instances: int | None = field(
        default=None,
        metadata=_help(
            "pla dispatcher: instances that start in the long-prefill pool, the rest serve short "
            "prefills (default: half, rounded down: nothing is known of the classes' loads yet)",
        ),
    )
    queue_unit_s: float = field(
        default=0.4,
        metadata=_help(
            "pla dispatcher: seconds of queued prefill work that make q = 1 (the paper's 0.4 s "
            "TTFT SLO; a fixed unit, so that q still counts without deadlines)"
        ),
    )
    weight_queue: float = field(
        default=1.0,
        metadata=_help(
            "pla dispatcher: alpha, weight of the queue q (queued prefill work / queue unit) "
            "in an instance's pressure psi = alpha q + beta e - gamma u"
        ),
    )
    weight_slo: float = field(
        default=1.0,
        metadata=_help("pla dispatcher: beta, weight of the SLA deviation e (TTFT / deadline)"),
    )
    weight_util: float = field(
        default=0.5,
        metadata=_help(
            "pla dispatcher: gamma, weight of the GPU utilisation u (busy share), subtracted"
        ),
    )
    aggregator: str = field(
        default="p90",
        metadata=_help("pla dispatcher: A, a pool's pressure from its instances': p90, mean, max"),
    )
    tau: float = field(
        default=0.2,
        metadata=_help(
            "pla dispatcher: hysteresis tau: an instance moves to a pool whose pressure "
            "exceeds (1 + tau) x the other's"
        ),
    )
    n_min: int = field(
        default=1,
        metadata=_help(
            "pla dispatcher: n_min, the fewest instances a pool keeps (0 lets a pool empty: its "
            "class then waits in its queue, whose pressure is the pool's, until an instance "
            "comes back; in medha route, which has no queue, it goes to any instance)"
        ),
    )
    # 2 s, the SLA deviation's window: a move is judged again only once the deviation it was
    # made on has turned over (5 s took 20 s to move 4 instances: docs/reproductions.md)
    cooldown_s: float = field(
        default=2.0,
        metadata=_help("pla dispatcher: T_cool, least time (s) between two instance moves"),
    )
    period_s: float = field(
        default=0.5, metadata=_help("pla dispatcher: the control period Delta t (s)")
    )
    window_s: float = field(
        default=2.0,
        metadata=_help(
            "pla dispatcher: requests dispatched this recently (s), or still waiting for their "
            "first token, make up an instance's SLA deviation",
        ),
    )

    def __post_init__(self) -> None:
        for name in ("cooldown_s", "window_s", "period_s", "queue_unit_s"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
                raise ValueError(f"pla_{name} must be a positive number, got {value!r}")
        for name in ("weight_queue", "weight_slo", "weight_util", "tau"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
                raise ValueError(f"pla_{name} must be a number >= 0, got {value!r}")
        n = self.long_instances
        if n is not None and not (isinstance(n, int) and n >= 1):
            raise ValueError(f"pla_long_instances must be a positive integer, got {n!r}")
        n = self.n_min
        if not (isinstance(n, int) and n >= 0):
            raise ValueError(f"pla_n_min must be an integer >= 0, got {n!r}")
        if self.aggregator not in PLA_AGGREGATORS:
            raise unknown_name("pla_aggregator", self.aggregator, PLA_AGGREGATORS)


class DispatchSettings(Protocol):
    """What a dispatcher reads of its deployment's settings: the simulator passes its
    ClusterConfig (medha/sim/config.py), the router a `BareDispatchSettings`."""

    pla: PlaDispatcherSettings


@dataclass
class BareDispatchSettings:
    """The dispatchers' settings with no cluster config around them (a `DispatchSettings`):
    what `medha route` passes, at their defaults."""

    pla: PlaDispatcherSettings = field(default_factory=lambda: PlaDispatcherSettings())
