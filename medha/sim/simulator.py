"""Event-driven cluster simulator: replicas running the unchanged scheduler, batch times from the
runtime predictor. Deterministic: the same requests and configs give the same results."""

from __future__ import annotations

import heapq
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from tqdm import tqdm

from medha.core.request import Request
from medha.dispatch.base_dispatcher import DISPATCHERS, Dispatcher
from medha.perf import ParallelConfig, Predictor, make_predictor
from medha.perf.model_specs import ModelSpec
from medha.perf.prefill_time_cache import PrefillTimeCache
from medha.perf.setup_cache import StoredWalk
from medha.scheduler.block_manager import BlockManager
from medha.scheduler.config import SchedulerConfig
from medha.scheduler.replica_scheduler import ReplicaScheduler
from medha.sim.config import ClusterConfig
from medha.sim.metrics.iteration_log import IterationLog
from medha.sim.replica import SimReplica

KV_BLOCK_SIZE = 16  # tokens per simulated KV block

# events: a batch leaves stage 1 / leaves the pipeline / an idle replica's policy lets go of
# prefills it held back (Policy.wake_at) / the dispatcher's periodic control (pla's Algorithm 2)
_STAGE1, _DONE, _WAKE, _TICK = 0, 1, 2, 3


@dataclass
class SimResult:
    requests: list[Request]
    log: IterationLog
    num_devices: int
    predictor: Predictor
    wall_s: float
    setup_s: float
    dispatcher: Dispatcher | None = None  # as the run left it (e.g. pla's pool moves)
    scheduler_stats: list = field(default_factory=list)  # each replica's SchedulerStats
    # with spp > 1: (replica, batch, stage, start, end) of every batch
    stage_times: list[tuple[int, int, int, float, float]] = field(default_factory=list)

    @property
    def simulated_s(self) -> float:
        ends = [r.finish_s for r in self.requests if r.finish_s is not None]
        return (max(ends) - min(r.arrival_s for r in self.requests)) if ends else 0.0


def kv_blocks_per_replica(
    cluster: ClusterConfig, predictor: Predictor, block_size: int = KV_BLOCK_SIZE
) -> BlockManager:
    hw, model, par = predictor.hardware, predictor.model, predictor.parallel
    if cluster.kv_memory_gb is not None:
        kv_bytes = cluster.kv_memory_gb * 2**30
    else:
        weights = model.num_params * hw.dtype_bytes / (par.tp * par.spp)
        kv_bytes = hw.mem_bytes * cluster.gpu_memory_utilization - weights
        if kv_bytes <= 0:
            raise ValueError(
                f"{model.name} does not fit on {par.tp * par.spp} {hw.name} "
                "devices per KVP group: raise --tp or --spp"
            )
    return BlockManager.from_memory(kv_bytes, model, par, hw.dtype_bytes, block_size)


def check_layout(model: ModelSpec, parallel: ParallelConfig) -> None:
    """Refuse a layout no engine could run: tensor parallelism splits the attention heads, the
    stream pipeline splits the layers."""
    if model.num_heads % parallel.tp:
        raise ValueError(
            f"tp {parallel.tp} does not divide {model.name}'s {model.num_heads} attention heads"
        )
    if parallel.spp > model.num_layers:
        raise ValueError(
            f"spp {parallel.spp} is more stages than {model.name}'s {model.num_layers} layers"
        )


class Simulator:
    def __init__(
        self,
        cluster: ClusterConfig,
        parallel: ParallelConfig,
        scheduler: SchedulerConfig,
        predictor: Predictor | None = None,
    ) -> None:
        """`predictor` overrides the one the cluster config names (tests use toy ones)."""
        t0 = time.perf_counter()
        self.cluster, self.parallel, self.scheduler_config = cluster, parallel, scheduler
        self.predictor = predictor or make_predictor(
            cluster.predictor, cluster.model, cluster.hardware, parallel
        )
        check_layout(self.predictor.model, parallel)
        if scheduler.pause_steps:
            raise ValueError(
                "pause_steps: the simulator's event loop pauses no step; medha.sim.replay (one "
                "replica) pauses them as medha's engine does"
            )
        # Building one scheduler validates the whole configuration. Its prefill-time cache,
        # which every replica of every run then shares, starts from the walk an earlier run
        # with the same inputs left on disk.
        template = ReplicaScheduler(
            scheduler, self.predictor, kv_blocks_per_replica(cluster, self.predictor)
        )
        # The scheduler's resolved config: every replica, and the metrics, read this one.
        self.scheduler_config = template.config
        self.max_model_len = template.max_model_len
        self._prefill_times: PrefillTimeCache = template.prefill_times
        self.stored_walk = StoredWalk(self._prefill_times, self.predictor, template.config)
        self.setup_s = time.perf_counter() - t0

    def _replicas(self) -> list[SimReplica]:
        return [
            SimReplica(
                i,
                ReplicaScheduler(
                    self.scheduler_config,
                    self.predictor,
                    kv_blocks_per_replica(self.cluster, self.predictor),
                    prefill_times=self._prefill_times,
                    block_tables=False,
                ),
            )
            for i in range(self.cluster.replicas)
        ]

    def run(
        self,
        requests: list[Request],
        progress: bool = False,
        on_finish: Callable[[Request, float], list[Request]] | None = None,
    ) -> SimResult:
        """`on_finish(request, now)`: the requests a closed-loop client sends once `request`
        finishes (arriving at `now` or later); they join the run and its result."""
        t0 = time.perf_counter()
        replicas = self._replicas()
        dispatcher = DISPATCHERS.get(self.cluster.dispatcher)(
            replicas, self.cluster, self.scheduler_config
        )
        bar = tqdm(
            total=len(requests),
            unit="req",
            desc="simulating",
            disable=not progress,
            mininterval=0.5,
            leave=False,
        )
        loop = _EventLoop(replicas, dispatcher, requests, on_finish, bar)
        loop.run()
        bar.close()
        wall_s = time.perf_counter() - t0
        stuck = sum(len(r.scheduler) for r in replicas) + dispatcher.held()
        if stuck:
            raise RuntimeError(f"simulation stalled with {stuck} unfinished requests")
        self.stored_walk.save()
        return SimResult(
            [*requests, *loop.sent] if loop.sent else requests,
            loop.log,
            self.cluster.replicas * self.parallel.world_size,
            self.predictor,
            wall_s,
            self.setup_s,
            dispatcher,
            [r.scheduler.stats for r in replicas],
            [(r.replica_id, *row) for r in replicas for row in r.stage_times],
        )


class _EventLoop:
    """One run of Simulator.run: the arrivals still to come, the closed-loop clients' next
    requests, and the heap of events (a batch's stages ending, wake-ups, the dispatcher's
    controls). Each pass takes the events due now, routes the requests arriving now, and
    starts a batch on every replica they left ready."""

    def __init__(
        self,
        replicas: list[SimReplica],
        dispatcher: Dispatcher,
        requests: list[Request],
        on_finish: Callable[[Request, float], list[Request]] | None,
        bar: tqdm,
    ) -> None:
        self.replicas, self.dispatcher = replicas, dispatcher
        self.on_finish, self.bar = on_finish, bar
        self.log = IterationLog()
        self.arrivals = sorted(requests, key=lambda r: r.arrival_s)
        self.heap: list[tuple[float, int, int, SimReplica, object]] = []
        self.injected: list[tuple[float, int, Request]] = []  # closed-loop clients' next requests
        self.sent: list[Request] = []
        self.seq = 0
        self.i, self.n = 0, len(self.arrivals)
        self.period = dispatcher.control_period_s

    def run(self) -> None:
        if self.period is not None and self.arrivals:
            heapq.heappush(self.heap, (self.arrivals[0].arrival_s, self.seq, _TICK, None, None))
        while self.i < self.n or self.heap or self.injected:
            now = self.next_event()
            dirty: dict[int, SimReplica] = {}
            # Batches finishing now go first, so that their decodes can join the next batch.
            self._events_due(now, dirty)
            self._arrivals_due(now, dirty)
            if self.dispatcher.held():
                ready = [dirty[rid] for rid in sorted(dirty) if dirty[rid].ready]
                for rid, pulled in self.dispatcher.pull(ready, now).items():
                    for r in pulled:
                        self.replicas[rid].add(r, now)
            self._start_batches(now, dirty)

    def next_event(self) -> float:
        inf, heap, injected = math.inf, self.heap, self.injected
        return min(
            self.arrivals[self.i].arrival_s if self.i < self.n else inf,
            injected[0][0] if injected else inf,
            heap[0][0] if heap else inf,
        )

    def _push(self, when: float, kind: int, replica: SimReplica | None, batch) -> None:
        self.seq += 1
        heapq.heappush(self.heap, (when, self.seq, kind, replica, batch))

    def _events_due(self, now: float, dirty: dict[int, SimReplica]) -> None:
        heap = self.heap
        while heap and heap[0][0] <= now:
            _, _, kind, replica, batch = heapq.heappop(heap)
            if kind == _TICK:
                self._tick(now, dirty)
                continue
            dirty[replica.replica_id] = replica
            if kind == _WAKE:
                continue
            if kind == _STAGE1 or replica.spp == 1:
                replica.stage1_free = True
            if kind == _DONE:
                finished = replica.finish_batch(batch, now)
                if finished:
                    self.bar.update(len(finished))
                    for r in finished if self.on_finish else ():
                        for new in self.on_finish(r, now):
                            self.seq += 1
                            heapq.heappush(self.injected, (max(now, new.arrival_s), self.seq, new))
                            self.sent.append(new)

    def _tick(self, now: float, dirty: dict[int, SimReplica]) -> None:
        """The dispatcher's periodic control, and the next one's event."""
        self.dispatcher.tick(now)
        dirty.update((x.replica_id, x) for x in self.replicas)  # a pool may have grown
        # Again while anything can still happen. With nothing held, a control can change
        # nothing before the next event (an arrival, a batch's end, a wake-up: only then does
        # a replica take work), so the clock skips to the first period from then: a long
        # quiet stretch (a deadline-free batch waiting out T_max) costs no string of idle
        # controls, and a stalled run, with no event left, ends.
        period = self.period
        after = now + period
        if not self.dispatcher.held():
            nxt = self.next_event()
            if nxt == math.inf:
                return
            after += max(0, math.ceil((nxt - after) / period)) * period
        self._push(after, _TICK, None, None)

    def _arrivals_due(self, now: float, dirty: dict[int, SimReplica]) -> None:
        arrivals, injected = self.arrivals, self.injected
        while (self.i < self.n and arrivals[self.i].arrival_s <= now) or (
            injected and injected[0][0] <= now
        ):
            if injected and injected[0][0] <= now:
                r = heapq.heappop(injected)[2]
            else:
                r = arrivals[self.i]
                self.i += 1
            replica = self.dispatcher.route(r, now)
            if replica is None:  # held: a replica about to form a batch pulls it
                dirty.update((x.replica_id, x) for x in self.replicas)
                continue
            replica.add(r, now)
            dirty[replica.replica_id] = replica

    def _start_batches(self, now: float, dirty: dict[int, SimReplica]) -> None:
        for rid in sorted(dirty):
            replica = dirty[rid]
            if not replica.ready:
                continue
            started = replica.start_batch(now)
            if started is None:
                wake = replica.scheduler.wake_at()
                if wake is not None and wake > now:
                    self._push(wake, _WAKE, replica, None)
                continue
            batch, stage1_end, end = started
            self.log.record(rid, batch, now, end)
            self._push(end, _DONE, replica, batch)
            if replica.spp > 1:
                self._push(stage1_end, _STAGE1, replica, None)
