"""PLA-Serve's spatial disaggregation: prefill instances in a short and a long pool, resized by
the instance-pressure controller of the paper's Algorithm 2 (She et al., section 3.2).

A request joins the queue of its class (its uncached tokens L below L_m(H): short; the pla
policy's boundary, H the longest prefix any instance's cache holds of it), earliest deadline
first (arrival order in the deadline-free token-max mode). Instances pull from their class's
queue as they form a batch (`pull`, which the simulator calls for the replicas about to form
one): a long instance takes one request when it holds no prefill (the paper advances one long
request at a time), a short one tops what it holds up to a batch's worth (the deepest captured
batch, the AWD's token budget M), those already gathering a batch first. Queued work is no
instance's until taken, so a moved instance serves its new class's queue at once.

Every control period (`control_period_s`: the simulator's periodic event, `medha route`'s
task; the paper's "sleep Delta t", not the next arrival) the controller:

- measures each instance k: q_k, its queued prefill work (predicted seconds: what it holds and
  its share of its class's queue, split evenly over the pool) over a fixed unit
  (`queue_unit_s`, the paper's 0.4 s SLO: not the requests' deadlines, which deadline-free runs
  set far away); e_k, its SLA deviation, the mean TTFT / deadline of the requests it took
  within `window_s`, of those still waiting and of those its class's queue holds (counted with
  their wait so far); u_k, its GPU utilisation, the share of samples (at arrivals and control
  periods) that found it busy over the period;
- psi_k = alpha q_k + beta e_k - gamma u_k (the paper's signs: a busy instance that keeps its
  queue short is healthy);
- pool pressures P_s, P_l: a robust aggregate of the pool's psi (P90, the paper's choice); a
  pool left empty (n_min = 0) has its queue's pressure, as one idle instance holding it all;
- after a cool-down since the last move, moves one instance: long -> short when
  P_s > (1 + tau) P_l and n_l > n_min, short -> long when P_l > (1 + tau) P_s and n_s > n_min.
  The pool that gains must have pressure above 0 (our safeguard: with psi able to go negative,
  (1 + tau) P of a calm pool would otherwise order two idle pools). The donor's least-pressured
  instance moves; it finishes what it holds and takes the other class from then on.

The paper gives no values for the weights, tau, n_min, the cool-down, the period or the first
split; the defaults (medha/dispatch/config.py) are ours. With one instance there are no pools:
it serves both classes, and the `pla` policy separates them in time. `medha route` holds
a request's first try in these queues too (`pulls`): its replicas pull as the router sees them
take their last one's first token (of a whole, non-streamed answer it sees only the end, and
takes the prefill as done once its predicted work has drained); a retry, or a request held
past --queue-timeout-s, goes by `pick` to the least-loaded instance of its pool.
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from medha.core.request import Request
from medha.dispatch.base_dispatcher import (
    DISPATCHERS,
    Dispatcher,
    ReplicaView,
    least_work,
    ttft_deadline_s,
)
from medha.dispatch.config import DispatchSettings
from medha.scheduler.config import SchedulerConfig
from medha.scheduler.policies.pla_policy import LONG, PAPER_SIZES, SHORT, calibrate


def p90(values: list[float]) -> float:
    """90th percentile, linear between order statistics."""
    return float(np.percentile(values, 90))


AGGREGATORS = {"p90": p90, "mean": lambda v: float(np.mean(v)), "max": max}


@dataclass
class Move:
    time_s: float
    replica_id: int
    source: str
    target: str
    pressure: dict[str, float]


class PressureController:
    """Algorithm 2's decision: hysteresis tau, a least allocation n_min and a cool-down."""

    def __init__(self, tau: float, n_min: int, cooldown_s: float) -> None:
        self.tau, self.n_min, self.cooldown_s = tau, n_min, cooldown_s
        self.last_move_s = -math.inf

    def ready(self, now: float) -> bool:
        return now - self.last_move_s >= self.cooldown_s

    def decide(
        self, pressure: dict[str, float], sizes: dict[str, int], now: float
    ) -> tuple[str, str] | None:
        """(source, target) pool of the one instance to move now, or None."""
        if not self.ready(now):
            return None
        s, lg = pressure[SHORT], pressure[LONG]
        if s > (1 + self.tau) * lg and s > 0 and sizes[LONG] > self.n_min:
            self.last_move_s = now
            return LONG, SHORT
        if lg > (1 + self.tau) * s and lg > 0 and sizes[SHORT] > self.n_min:
            self.last_move_s = now
            return SHORT, LONG
        return None


@dataclass(order=True)
class Queued:
    """A request in its class's queue: in the order instances take them (earliest deadline
    first in the SLA mode, arrival order in the deadline-free token-max mode)."""

    key: tuple
    request: Request = field(compare=False)
    deadline_s: float = field(compare=False)
    work_s: float = field(compare=False)  # predicted prefill time, uncached as at its arrival


@DISPATCHERS.register("pla")
class PlaDispatcher(Dispatcher):
    """Short and long prefill pools, fed from one queue per class, resized by instance
    pressure every control period."""

    def __init__(
        self, replicas: list[ReplicaView], cluster: DispatchSettings, scheduler: SchedulerConfig
    ) -> None:
        super().__init__(replicas, cluster, scheduler)
        settings = self.settings = cluster.pla
        self.config = scheduler
        self.model = calibrate(replicas[0].predictor, scheduler.pla.memory_intercept)
        self.fixed_boundary = scheduler.pla.boundary_tokens
        n = len(replicas)
        n_long = min(n - 1, settings.long_instances or max(1, n // 2))
        # The last replicas start long, the first short.
        self.role = {
            r.replica_id: (LONG if i >= n - n_long else SHORT) for i, r in enumerate(replicas)
        }
        self.controller = PressureController(settings.tau, settings.n_min, settings.cooldown_s)
        self.aggregate = AGGREGATORS[settings.aggregator]
        self._recent: dict[int, deque[Request]] = {r.replica_id: deque() for r in replicas}
        self._busy = {r.replica_id: [0, 0] for r in replicas}  # (busy, samples) this period
        self.moves: list[Move] = []
        # One instance has no pools (the pla policy separates the classes in time): requests
        # go to it at arrival and there is nothing to control.
        self.control_period_s = settings.period_s if n > 1 else None
        self.pulls = n > 1
        self.queues: dict[str, list[Queued]] = {SHORT: [], LONG: []}
        self._seq = 0
        # each class queue as the last control saw it (`_queue_state`)
        self._queued = {role: (0.0, 0.0, 0) for role in (SHORT, LONG)}
        # one batch's worth, what a short instance takes at a time: the deepest captured batch
        # and the short batches' token budget M (the pla policy's AWD groups within these)
        self.batch_depth = (getattr(replicas[0].predictor, "sizes", ()) or PAPER_SIZES)[-1]
        self.batch_tokens = scheduler.pla.memory_tokens

    def history(self, request: Request) -> int:
        return max(r.cached_tokens(request) for r in self.replicas)

    def classify(self, request: Request) -> str:
        H = self.history(request) if self.replicas[0].prefix_caching else 0
        L = request.prompt_len - H
        bound = self.fixed_boundary or self.model.boundary(H)
        return SHORT if L < bound else LONG

    def pool(self, role: str) -> list[ReplicaView]:
        return [r for r in self.replicas if self.role[r.replica_id] == role]

    def _sample_busy(self) -> None:
        """Utilisation, sampled at arrivals and control periods."""
        for r in self.replicas:
            b = self._busy[r.replica_id]
            b[0] += r.busy()
            b[1] += 1

    # ---- the simulator's cluster: class queues that instances pull from ----------------------
    def route(self, request: Request, now: float) -> ReplicaView | None:
        if len(self.replicas) == 1:
            return self.replicas[0]
        self._sample_busy()
        role = self.classify(request)
        replica = self.replicas[0]
        deadline = ttft_deadline_s(self.config, request, replica)
        work = replica.prefill_work_s(request, replica.cached_tokens(request))
        self._seq += 1
        first = deadline if self.config.pla.mode != "token-max" else request.arrival_s
        item = Queued((first, request.arrival_s, self._seq), request, deadline, work)
        heapq.heappush(self.queues[role], item)
        return None

    def held(self) -> int:
        return len(self.queues[SHORT]) + len(self.queues[LONG])

    def pull(self, ready: list[ReplicaView], now: float) -> dict[int, list[Request]]:
        """A long instance takes one request when it holds no prefill (the paper advances one
        long request at a time); a short instance tops up what it holds to one batch's worth
        (the deepest captured batch, M tokens), the instances already gathering a batch first,
        then the least loaded."""
        out: dict[int, list[Request]] = {}
        for role in (SHORT, LONG):
            queue = self.queues[role]
            members = [r for r in ready if self.role[r.replica_id] == role]
            held = {r.replica_id: r.pending(now) for r in members}
            for r in sorted(
                members,
                key=lambda r: (not held[r.replica_id], r.outstanding_work_s(), r.replica_id),
            ):
                if not queue:
                    break
                if role == LONG and held[r.replica_id]:
                    continue
                # a batch's worth: up to the deepest captured batch (short), one request
                # (long) or what fits M tokens (`--pla-long-batch all`); at least one
                limit = self.batch_depth if role == SHORT else 1
                if role == LONG and self.config.pla.long_batch == "all":
                    limit = math.inf
                taken = out.setdefault(r.replica_id, [])
                depth = len(held[r.replica_id])
                tokens = sum(p.num_uncached_tokens for p in held[r.replica_id])
                while queue and depth < limit:
                    n = queue[0].request.prompt_len
                    if depth and tokens + n > self.batch_tokens:
                        break
                    taken.append(heapq.heappop(queue).request)
                    depth, tokens = depth + 1, tokens + n
            for rid, taken in out.items():
                self._recent[rid].extend(taken)
        return {rid: taken for rid, taken in out.items() if taken}

    def drop(self, request_id: str) -> bool:
        """Take a held request out of its queue (its client left, or the router gave up
        waiting for a pull); whether it was there."""
        for queue in self.queues.values():
            for i, item in enumerate(queue):
                if item.request.request_id == request_id:
                    queue[i] = queue[-1]
                    queue.pop()
                    heapq.heapify(queue)
                    return True
        return False

    def tick(self, now: float) -> None:
        self._sample_busy()
        self._control(now)

    def pick(
        self, request: Request, now: float, candidates: list[ReplicaView] | None = None
    ) -> ReplicaView:
        """The router's retries (and a request its pool never pulled): to the least loaded
        instance of the request's pool."""
        if len(self.replicas) == 1:
            return self.replicas[0]  # one instance: the pla policy separates them in time
        self._sample_busy()
        pool = self.pool(self.classify(request)) or self.replicas  # (an emptied pool)
        if candidates is not None:  # the router's: a pool with none left falls back on all
            allowed = {r.replica_id for r in candidates}
            pool = [r for r in pool if r.replica_id in allowed] or candidates
        replica = least_work(pool)
        self._recent[replica.replica_id].append(request)
        return replica

    # ---- Algorithm 2 --------------------------------------------------------------------------
    def _control(self, now: float) -> None:
        self._queued = {role: self._queue_state(role, now) for role in (SHORT, LONG)}
        psi = {r.replica_id: self.instance_pressure(r, now) for r in self.replicas}
        for b in self._busy.values():
            b[0] = b[1] = 0
        pools = {role: self.pool(role) for role in (SHORT, LONG)}
        pressure = {
            role: self.aggregate([psi[r.replica_id] for r in members])
            if members
            else self._queue_pressure(role)
            for role, members in pools.items()
        }
        move = self.controller.decide(pressure, {k: len(v) for k, v in pools.items()}, now)
        if move is None:
            return
        source, target = move
        replica = min(pools[source], key=lambda r: (psi[r.replica_id], r.replica_id))
        self.role[replica.replica_id] = target
        self.moves.append(Move(now, replica.replica_id, source, target, pressure))

    def signals(self, replica: ReplicaView, now: float) -> tuple[float, float, float]:
        """(q, e, u) of one instance. Its queue is what it holds plus its share of its class's
        queue (the class queue's work over the pool's instances)."""
        role = self.role[replica.replica_id]
        queued = sum(p.work_s for p in replica.pending(now))
        queued += self._queued[role][0] / max(1, len(self.pool(role)))
        busy, samples = self._busy[replica.replica_id]
        u = busy / samples if samples else float(replica.busy())
        return queued / self.settings.queue_unit_s, self._slo_deviation(replica, now), u

    def _queue_pressure(self, role: str) -> float:
        """An empty pool's pressure (n_min = 0): its class's queue, as one idle instance that
        holds nothing but its share of the queue, the whole of it."""
        s = self.settings
        work, total, count = self._queued[role]
        e = total / count if count else 0.0
        return s.weight_queue * work / s.queue_unit_s + s.weight_slo * e

    def instance_pressure(self, replica: ReplicaView, now: float) -> float:
        q, e, u = self.signals(replica, now)
        s = self.settings
        return s.weight_queue * q + s.weight_slo * e - s.weight_util * u

    def _queue_state(self, role: str, now: float) -> tuple[float, float, int]:
        """A class's queue: its predicted prefill work, the sum of its requests' wait so far /
        TTFT allowed, and how many it holds."""
        work = total = 0.0
        for q in self.queues[role]:
            work += q.work_s
            allowed = q.deadline_s - q.request.arrival_s
            total += (now - q.request.arrival_s) / allowed if 0 < allowed < math.inf else 0.0
        return work, total, len(self.queues[role])

    def _slo_deviation(self, replica: ReplicaView, now: float) -> float:
        """Mean TTFT / deadline of the instance's recent requests and of those its class's
        queue holds; those still waiting count their wait so far. Requests that got their first
        token before the window leave."""
        horizon = now - self.settings.window_s
        rid = replica.replica_id
        seen = {r.request_id: replica.progress(r) for r in self._recent[rid]}

        def waiting(r: Request) -> bool:
            first, _, done = seen[r.request_id]
            return first is None and not done

        kept = deque(r for r in self._recent[rid] if r.arrival_s >= horizon or waiting(r))
        self._recent[rid] = kept
        ratios = []
        for r in kept:
            first, deadline, _ = seen[r.request_id]
            if first is None and not waiting(r):
                continue
            allowed = deadline - r.arrival_s
            end = first if first is not None else now
            ratios.append((end - r.arrival_s) / allowed if 0 < allowed < math.inf else 0.0)
        _, total, count = self._queued[self.role[rid]]
        count += len(ratios)
        return (sum(ratios) + total) / count if count else 0.0
