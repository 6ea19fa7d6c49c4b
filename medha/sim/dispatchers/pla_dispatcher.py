"""PLA-Serve's spatial disaggregation: replicas in a short-prefill and a long-prefill pool.

Each replica has a role. A request goes to the pool of its class (prompt below the boundary
L_m: short; else long), and within the pool to the replica with the least outstanding work. An
instance-pressure controller moves replicas between the pools. Only the paper's abstract was
within reach; the controller below is our design from the issue's description:

- Pressure of an instance: the mean of three terms, each about 1 at saturation (each capped at
  `TERM_CAP` so that one runaway term cannot hide the others):
  the weighted queue, its queued prefill work (predicted seconds, so a 4K-token prompt weighs
  what it costs) over the TTFT deadline of a short request; the SLO deviation, the mean of
  TTFT / deadline over the requests it received in the last `pla_window_s` and those still
  waiting for their first token (a waiting one counts its wait so far, so a stalled instance
  shows at once); and its utilisation, the larger of the shares of its KV cache and of its
  batch slots (max_num_seqs) that running decodes hold. The last one is what fills up first on
  an instance of short requests: their prefills are cheap and their TTFT stays low until the
  decode batch is full, so without it a short pool looks idle right up to saturation.
- Pressure of a pool: the P90 over its instances (a pool is as healthy as its worst instances,
  and one outlier of ten does not move capacity).
- Hysteresis: an instance moves only from a pool at or below `pla_pressure_low` to one at or
  above `pla_pressure_high`; between the two nothing moves, so an instance that has just moved
  does not bounce back once the pressures meet.
- Cool-down: at most one move per `pla_cooldown_s`; the donor's least-pressured instance moves,
  and each pool keeps at least one. A moved replica finishes the requests it holds.

With one replica there are no pools: it serves both classes, and the `pla` policy separates them
in time. The replicas may run any policy; `pla` also keeps the classes apart in time on an
instance that is changing role.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from medha.core.config import SchedulerConfig
from medha.core.request import Request
from medha.scheduler.policies.pla_policy import LONG, SHORT, pla_boundary
from medha.sim.config import ClusterConfig
from medha.sim.dispatchers.base_dispatcher import DISPATCHERS, Dispatcher

if TYPE_CHECKING:
    from medha.sim.replica import SimReplica

TERM_CAP = 2.0


def p90(values: list[float]) -> float:
    """90th percentile, linear between order statistics."""
    return float(np.percentile(values, 90))


@dataclass
class Move:
    time_s: float
    replica_id: int
    source: str
    target: str
    pressure: dict[str, float]


class PressureController:
    """Decides when an instance moves: hysteresis between two thresholds, and a cool-down."""

    def __init__(self, high: float, low: float, cooldown_s: float) -> None:
        self.high, self.low, self.cooldown_s = high, low, cooldown_s
        self.last_move_s = -math.inf

    def ready(self, now: float) -> bool:
        return now - self.last_move_s >= self.cooldown_s

    def decide(
        self, pressure: dict[str, float], sizes: dict[str, int], now: float
    ) -> tuple[str, str] | None:
        """(source, target) pool of the one instance to move now, or None."""
        if not self.ready(now):
            return None
        for source, target in ((LONG, SHORT), (SHORT, LONG)):
            if pressure[target] >= self.high and pressure[source] <= self.low and sizes[source] > 1:
                self.last_move_s = now
                return source, target
        return None


@DISPATCHERS.register("pla")
class PlaDispatcher(Dispatcher):
    """Short and long prefill pools, routed by prompt length, resized by instance pressure."""

    def __init__(
        self, replicas: list[SimReplica], cluster: ClusterConfig, scheduler: SchedulerConfig
    ) -> None:
        super().__init__(replicas, cluster, scheduler)
        settings = cluster.pla
        # the pla policy's L_m, from the same settings and cost model
        self.boundary = pla_boundary(
            scheduler.pla, replicas[0].scheduler.predictor, scheduler.max_model_len
        )
        n = len(replicas)
        n_long = min(n - 1, settings.long_instances or max(1, n // 4))
        # The last replicas start long, the first short.
        self.role = {
            r.replica_id: (LONG if i >= n - n_long else SHORT) for i, r in enumerate(replicas)
        }
        self.controller = PressureController(
            settings.pressure_high, settings.pressure_low, settings.cooldown_s
        )
        self.window_s = settings.window_s
        # The TTFT deadline of a short request: the unit of the queue term.
        self.deadline_s = scheduler.ttft_deadline_s or scheduler.min_ttft_deadline_s
        self.max_num_seqs = scheduler.max_num_seqs
        self._recent: dict[int, deque[Request]] = {r.replica_id: deque() for r in replicas}
        self.moves: list[Move] = []
        self._next_check_s = -math.inf  # pressures are sampled a few times per window

    def classify(self, request: Request) -> str:
        return SHORT if request.prompt_len < self.boundary else LONG

    def pool(self, role: str) -> list[SimReplica]:
        return [r for r in self.replicas if self.role[r.replica_id] == role]

    def pick(self, request: Request, now: float) -> SimReplica:
        if len(self.replicas) == 1:
            return self.replicas[0]  # one instance: the pla policy separates them in time
        if self.controller.ready(now) and now >= self._next_check_s:
            self._next_check_s = now + self.window_s / 4
            self._control(now)
        replica = min(
            self.pool(self.classify(request)), key=lambda r: (r.outstanding_work_s(), r.replica_id)
        )
        self._recent[replica.replica_id].append(request)
        return replica

    # ---- the instance-pressure controller ----------------------------------------------------
    def _control(self, now: float) -> None:
        pressures = {r.replica_id: self.instance_pressure(r, now) for r in self.replicas}
        pools = {role: self.pool(role) for role in (SHORT, LONG)}
        pressure = {
            role: p90([pressures[r.replica_id] for r in members]) for role, members in pools.items()
        }
        move = self.controller.decide(pressure, {k: len(v) for k, v in pools.items()}, now)
        if move is None:
            return
        source, target = move
        replica = min(pools[source], key=lambda r: (pressures[r.replica_id], r.replica_id))
        self.role[replica.replica_id] = target
        self.moves.append(Move(now, replica.replica_id, source, target, pressure))

    def instance_pressure(self, replica: SimReplica, now: float) -> float:
        sched = replica.scheduler
        queued = sum(r.remaining_work_s for r in sched.live_requests() if r.in_prefill)
        queue = queued / self.deadline_s
        blocks = sched.blocks
        utilisation = max(
            blocks.num_used / blocks.num_blocks, sched.num_decoding / self.max_num_seqs
        )
        return (
            min(queue, TERM_CAP)
            + min(self._slo_deviation(replica.replica_id, now), TERM_CAP)
            + utilisation
        ) / 3

    def _slo_deviation(self, replica_id: int, now: float) -> float:
        """Mean TTFT / deadline of the instance's recent requests; those still waiting count
        their wait so far. Requests that got their first token before the window leave."""
        horizon = now - self.window_s
        kept = deque(r for r in self._recent[replica_id] if r.arrival_s >= horizon or _waiting(r))
        self._recent[replica_id] = kept
        ratios = [
            _ttft_ratio(r, now) for r in kept if r.first_token_s is not None or _waiting(r)
        ]  # not aborted unserved
        return sum(ratios) / len(ratios) if ratios else 0.0


def _waiting(r: Request) -> bool:
    return r.first_token_s is None and not r.state.is_done


def _ttft_ratio(r: Request, now: float) -> float:
    first = r.first_token_s if r.first_token_s is not None else now
    allowed = r.deadline_s - r.arrival_s
    return (first - r.arrival_s) / allowed if 0 < allowed < math.inf else 0.0
