"""LoongServe (Wu et al., SOSP 2024) as a baseline: elastic sequence parallelism (ESP) over a
pool of elastic instances, simulated event by event on the same requests and metrics as
medha's replicas. Built from the system's published design and the hardware's physical
parameters; what the design leaves open is an assumption, listed here and in docs/simulator.md.

The cluster: `instances` elastic instances, each one TP group of `tp` devices priced by the
ordinary predictor at that TP, placed node by node (instance i on node i x tp // devices per
node). A global manager schedules them each time something happens (an arrival, the end of a
prefill or of a decode iteration):

1. Dispatching: requests wait in one FCFS queue per pool. The head of the queue is placed
   first; nobody overtakes it (non-preemptive FCFS: while the head waits, everyone waits).
   [assumption; `backfill` relaxes it: while the head waits, a later request may start on
   free instances the head's plan does not take or that it leaves before the head's planned
   start, so the head is not delayed but for KV room (EASY backfilling)]
2. Elastic instance allocation: for each degree d = 1 .. max_degree, the d instances that
   are free soonest (free: taking part in no prefill; an instance in a prefill is free when
   it ends, which is known, since prefills run to completion), preferring one node, then
   fewer decoding requests to stall, then more free KV, then the lower index, whose KV
   memory holds the head's prompt plus outputs. The head's predicted completion is when
   the last of them is free plus the ring prefill time on them
   (medha/perf/ring_attention.py). The head takes the fewest instances whose completion is
   within `degree_tolerance` of the best one; if that plan must wait for instances still in
   a prefill, the head (and the queue) waits for them. [assumption: LoongServe's paper
   chooses with an analytical model and a dynamic program; the rule here keeps its goal,
   the shortest prefill, and its economy, no instance that buys less than the tolerance.]
3. Batching: queued prompts join the head's prefill in arrival order, while the batch
   holds at most `batch_tokens` tokens (or the head's own, if more) and their KV fits on
   the same instances; they stop at the first that does not. [assumption: a fixed cap; a
   prefill of more tokens is no more efficient on these devices.]
4. A prefill iteration runs the batch's whole prompts at once (no chunking) over the chosen
   instances, non-preemptive. An instance chosen for it stops starting decode iterations;
   the prefill begins when the last of its decode iterations in progress ends. Its decode
   batch waits until the prefill ends: the decodes of requests whose KV it holds stall.
5. Scale-down: each request's KV (prompt plus its maximum output, reserved whole at the
   prefill's start so that it never runs out and nothing is preempted [assumption]) is
   kept on the fewest instances of its prefill that hold it, the freest first. LoongServe
   moves it there during the prefill, overlapped with it: no time is charged for it.
6. Decode: an instance not in a prefill runs decode iterations of the requests whose KV it
   holds. A request whose KV spans several instances (multi-master decoding, when it does
   not fit on one) is decoded by all of them: the instance that writes its new token runs
   its token-parallel work, each holder the attention over its part, merged (one small
   exchange per layer). Instances linked by such requests run their decode iterations in
   lockstep, as one group; an iteration lasts its slowest member's time (token-parallel
   work of the requests it leads plus its attention) plus the merge.
7. Macro iterations (`prefill_every` > 0; off by default): LoongServe's released server
   (its router's step loop) starts new prefills only at the start of a macro iteration, when
   nothing decodes or after `max_wait_tokens` decode iterations since the last one began;
   while that iteration's prefills run, it starts others only on instances free now whose
   prefill ends before them (its greedy fill), and the decode iterations in it do not count.
   We count a decode iteration of the instance that has run the most since (the server
   steps every instance in lockstep, at the slowest one's pace, which would count slower).
8. Reserved pool (Medha Fig. 14's "+Reserv"): the last `reserved_short` instances serve
   prompts shorter than `short_threshold` only, the others the rest; each pool has its
   own queue and the same scheduler; a request stays in its pool.

TTFT deadlines (what SLO attainment reads) follow medha's rule with this system's own
isolated prefill time: max(factor x the best ring time over degrees 1..max_degree on an idle
cluster, the minimum), or the request's / config's fixed deadline. Iterations are logged per
instance: a prefill once on each instance it takes (its chunks on the first, the others
empty: busy, no new tokens), a decode iteration once per member (each with the decodes it
leads).
"""

from __future__ import annotations

import heapq
import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import lru_cache

from tqdm import tqdm

from medha.core.batch import Batch, BatchResult
from medha.core.request import Request, RequestState
from medha.perf import ParallelConfig, Predictor, make_predictor
from medha.perf.prefill_time_cache import PrefillTimeCache
from medha.perf.ring_attention import RingPrefillTime, ring_prefill_time
from medha.scheduler.config import SchedulerConfig
from medha.scheduler.config_defaults import resolve_config
from medha.scheduler.request_table import RequestTable, SchedulerStats
from medha.sim.baselines.elastic_instances import Instance, KVLedger
from medha.sim.config import ClusterConfig
from medha.sim.metrics.iteration_log import IterationLog
from medha.sim.simulator import KV_BLOCK_SIZE, SimResult, check_layout, kv_blocks_per_replica

_PREFILL_DONE, _DECODE_DONE = 0, 1


@dataclass(eq=False)
class Pool:
    name: str
    instances: list[Instance]
    max_degree: int
    queue: deque[Request] = field(default_factory=deque)


@dataclass(eq=False)
class Prefill:
    instances: list[Instance]
    batch: Batch
    start: float
    end: float
    time: RingPrefillTime


@dataclass(eq=False)
class _Plan:
    finish: float
    degree: int
    start: float
    instances: list[Instance]
    time: RingPrefillTime


class LoongServeSimulator:
    """The same surface as `Simulator` where the runner reads it: `predictor` (one instance's),
    `scheduler_config` (resolved), `max_model_len`, `num_devices`, `run`."""

    def __init__(
        self,
        cluster: ClusterConfig,
        parallel: ParallelConfig,
        scheduler: SchedulerConfig,
        predictor: Predictor | None = None,
        check: bool = False,
    ) -> None:
        """`predictor` overrides the cluster's (tests); `check`: verify the KV ledger and the
        request table after every step (tests)."""
        t0 = time.perf_counter()
        if cluster.system != "loongserve":
            raise ValueError(f"LoongServeSimulator runs system loongserve, not {cluster.system!r}")
        if parallel.spp != 1 or parallel.kvp != 1:
            raise ValueError(
                "the loongserve system runs TP groups only: spp and kvp must be 1 "
                "(its instances are --tp devices each; --loong-instances of them)"
            )
        if scheduler.prefix_cache not in (None, "off"):
            raise ValueError("the loongserve system has no prefix cache: prefix_cache must be off")
        self.cluster, self.parallel, self.settings = cluster, parallel, cluster.loong
        self.predictor = predictor or make_predictor(
            cluster.predictor, cluster.model, cluster.hardware, parallel
        )
        hw = self.predictor.hardware
        check_layout(self.predictor.model, parallel)
        self.scheduler_config = resolve_config(scheduler, self.predictor)
        self.max_model_len = self.scheduler_config.max_model_len
        self.check = check
        s = self.settings
        if s.reserved_short and s.reserved_short >= s.instances:
            raise ValueError("loong_reserved_short must leave the long pool an instance")
        blocks = kv_blocks_per_replica(cluster, self.predictor, KV_BLOCK_SIZE)
        self.capacity = blocks.capacity_tokens
        self.num_devices = s.instances * parallel.tp
        self._tp_spans_nodes = parallel.tp > hw.devices_per_node
        # the planner prices the same prompts at each degree at every event: cache per simulator
        self._ring = lru_cache(maxsize=1 << 14)(self._ring_uncached)
        self.setup_s = time.perf_counter() - t0

    # ---- costs -----------------------------------------------------------------------------
    def _inter_node(self, instances) -> bool:
        return self._tp_spans_nodes or len({i.node for i in instances}) > 1

    def _ring_uncached(self, lens: tuple[int, ...], degree: int, inter: bool) -> RingPrefillTime:
        striped = self.settings.ring == "striped"
        return ring_prefill_time(self.predictor, lens, degree, inter, striped)

    def isolated_prefill_s(self, prompt_len: int) -> float:
        """The best prefill time of one prompt on an idle cluster (for its TTFT deadline)."""
        dpn = self.predictor.hardware.devices_per_node
        best = math.inf
        for d in range(1, self.settings.max_degree + 1):
            inter = self._tp_spans_nodes or d * self.parallel.tp > dpn
            best = min(best, self._ring((prompt_len,), d, inter).total_s)
        return best

    # ---- the run ---------------------------------------------------------------------------
    def _build(self) -> tuple[list[Instance], list[Pool]]:
        s, tp = self.settings, self.parallel.tp
        dpn = self.predictor.hardware.devices_per_node
        instances = [
            Instance(i, i * tp // dpn, self.capacity, KV_BLOCK_SIZE) for i in range(s.instances)
        ]
        k = s.reserved_short
        if k == 0:
            return instances, [Pool("all", instances, min(s.max_degree, len(instances)))]
        long_ = instances[: s.instances - k]
        short = instances[s.instances - k :]
        return instances, [
            Pool("long", long_, min(s.max_degree, len(long_))),
            Pool("short", short, min(s.max_degree, len(short))),
        ]

    def _pool_of(self, r: Request, pools: list[Pool]) -> Pool:
        if len(pools) == 1:
            return pools[0]
        return pools[1] if r.prompt_len < self.settings.short_threshold else pools[0]

    def run(
        self,
        requests: list[Request],
        progress: bool = False,
        on_finish: Callable[[Request, float], list[Request]] | None = None,
    ) -> SimResult:
        if on_finish is not None:
            raise ValueError("the loongserve system simulates open-loop arrivals only")
        t0 = time.perf_counter()
        self._start_run()
        arrivals = sorted(requests, key=lambda r: r.arrival_s)
        for r in arrivals:  # refuse what could never run before running anything
            self._validate(r)
        bar = tqdm(
            total=len(arrivals),
            unit="req",
            desc="simulating",
            disable=not progress,
            mininterval=0.5,
            leave=False,
        )
        i, n = 0, len(arrivals)
        while i < n or self._heap:
            now = min(
                arrivals[i].arrival_s if i < n else math.inf,
                self._heap[0][0] if self._heap else math.inf,
            )
            while self._heap and self._heap[0][0] <= now:
                _, _, kind, payload = heapq.heappop(self._heap)
                done = (
                    self._prefill_done(payload, now)
                    if kind == _PREFILL_DONE
                    else (self._decode_done(payload, now))
                )
                bar.update(len(done))
            while i < n and arrivals[i].arrival_s <= now:
                self._arrive(arrivals[i])
                i += 1
            for pool in self.pools:
                self._schedule_prefills(pool, now)
            self._schedule_decodes(now)
            if self.check:
                self.kv.check(self.instances)
                self.table.check_invariants()
        bar.close()
        return self._result(requests, t0)

    def _start_run(self) -> None:
        """A run's state, fresh: the instances and pools, the KV ledger, the request table,
        the log and the event heap."""
        self.instances, self.pools = self._build()
        self.kv = KVLedger(KV_BLOCK_SIZE)
        self.stats = SchedulerStats()
        # Every prefill is of the whole prompt, so a chunk always samples and the table never
        # asks this cache for remaining work; it is there because the table keeps one.
        self.table = RequestTable(
            PrefillTimeCache(self.predictor, lambda _offset, left: left, self.max_model_len),
            self.stats,
        )
        self.table.kv = self.kv
        self.log = IterationLog()
        # macro iterations (settings.prefill_every): the current one's start and end, and the
        # decode iterations each instance has run outside one since the last began
        self._macro: tuple[float, float] | None = None
        self._steps: dict[Instance, int] = {}
        self._heap: list = []
        self._seq = 0
        self._batch_id = 0

    def _arrive(self, r: Request) -> None:
        """`r` into the request table (its TTFT allowance from its best isolated prefill) and
        its pool's queue."""
        work = self.isolated_prefill_s(r.prompt_len)
        self.table.admit(r, self.scheduler_config.ttft_allowed_s(r.ttft_deadline_s, work), work)
        self._pool_of(r, self.pools).queue.append(r)

    def _result(self, requests: list[Request], t0: float) -> SimResult:
        """The run's result, once every request finished and every KV block came back."""
        stuck = len(self.table) + sum(len(p.queue) for p in self.pools)
        if stuck:
            raise RuntimeError(f"loongserve simulation stalled with {stuck} unfinished requests")
        if any(i.used for i in self.instances):
            raise RuntimeError("loongserve simulation ended with KV still reserved")
        return SimResult(
            requests,
            self.log,
            self.num_devices,
            self.predictor,
            time.perf_counter() - t0,
            self.setup_s,
            None,
            [self.stats],
        )

    def _validate(self, r: Request) -> None:
        r.validate(self.max_model_len)
        if r.state is not RequestState.WAITING or r.num_scheduled:
            raise ValueError(f"request {r.request_id!r} was already scheduled elsewhere")
        pool = self._pool_of(r, self.pools)
        room = pool.max_degree * self.capacity
        if r.prompt_len + r.max_tokens > room:
            raise ValueError(
                f"prompt_len + max_tokens = {r.prompt_len + r.max_tokens} exceeds the KV "
                f"capacity of {pool.max_degree} instances ({room} tokens), the most one "
                f"prefill of pool {pool.name!r} spreads over"
            )

    def _push(self, t: float, kind: int, payload) -> None:
        self._seq += 1
        heapq.heappush(self._heap, (t, self._seq, kind, payload))

    def _next_batch_id(self) -> int:
        self._batch_id += 1
        return self._batch_id - 1

    # ---- prefills --------------------------------------------------------------------------
    def _candidates(self, among: list[Instance], d: int, avail: dict) -> list[list[Instance]]:
        """Sets of d instances worth pricing: the soonest free in one node (each node), and
        the soonest free anywhere; ties go to fewer stalled decodes, more free KV, lower
        index."""

        def key(i: Instance):
            return (avail[i], len(i.holds), -i.free, i.index)

        ranked = sorted(among, key=key)
        sets = [ranked[:d]]
        for node in sorted({i.node for i in ranked}):
            local = [i for i in ranked if i.node == node]
            if len(local) >= d and local[:d] != sets[0]:
                sets.append(local[:d])
        return sets

    def _plan(
        self, pool: Pool, r: Request, now: float, among: list[Instance] | None = None
    ) -> _Plan | None:
        """The plan for `r` over the pool's instances, or over `among` (backfilling)."""
        among = pool.instances if among is None else among
        avail = {i: (i.prefill.end if isinstance(i.prefill, Prefill) else now) for i in among}
        if any(i.prefill is not None and not isinstance(i.prefill, Prefill) for i in among):
            raise AssertionError("an instance is taken by something other than a prefill")
        need = r.prompt_len + r.max_tokens
        plans = []
        for d in range(1, min(pool.max_degree, len(among)) + 1):
            for s in self._candidates(among, d, avail):
                # instances in a prefill hold their batch's KV already: the ledger counts it
                if self.kv.plan(need, s) is None:
                    continue
                start = max(avail[i] for i in s)
                t = self._ring((r.prompt_len,), d, self._inter_node(s))
                plans.append(_Plan(start + t.total_s, d, start, s, t))
        if not plans:
            return None
        best = min(p.finish for p in plans) - now
        ok = [p for p in plans if p.finish - now <= best * (1 + self.settings.degree_tolerance)]
        return min(ok, key=lambda p: (p.degree, p.finish, [i.index for i in p.instances]))

    def _schedule_prefills(self, pool: Pool, now: float) -> None:
        while pool.queue:
            head = pool.queue[0]
            plan = self._plan(pool, head, now)
            if plan is None or plan.start > now or not self._may_start(plan.finish, now):
                # KV or instances not free yet: the queue waits (FCFS), or backfills
                if plan is not None and self.settings.backfill:
                    self._backfill(pool, plan, now)
                return
            members = plan.instances
            batch_reqs = [head]
            taken: dict[Instance, int] = {}
            reserve = [(head, self.kv.plan(head.prompt_len + head.max_tokens, members))]
            for inst, tok in reserve[0][1]:
                taken[inst] = taken.get(inst, 0) + tok
            cap = max(self.settings.batch_tokens, head.prompt_len)
            tokens = head.prompt_len
            for r in list(pool.queue)[1:]:
                if tokens + r.prompt_len > cap:
                    break
                placed = self.kv.plan(r.prompt_len + r.max_tokens, members, taken)
                if placed is None:
                    break
                for inst, tok in placed:
                    taken[inst] = taken.get(inst, 0) + tok
                reserve.append((r, placed))
                batch_reqs.append(r)
                tokens += r.prompt_len
            for _ in batch_reqs:
                pool.queue.popleft()
            self._start_prefill(members, plan.degree, reserve, now)

    def _backfill(self, pool: Pool, head: _Plan, now: float) -> None:
        """Start later requests, in queue order, on instances free now, where they take none
        of the head's plan or leave it before the head's planned start: the head starts when
        it would have (EASY backfilling)."""
        for r in list(pool.queue)[1:]:
            spare = [i for i in pool.instances if i.prefill is None]
            if not spare:
                return
            plan = self._plan(pool, r, now, spare)
            if plan is None or plan.start > now or not self._may_start(plan.finish, now):
                continue
            if plan.finish > head.start and set(plan.instances) & set(head.instances):
                continue
            placed = self.kv.plan(r.prompt_len + r.max_tokens, plan.instances)
            pool.queue.remove(r)
            self._start_prefill(plan.instances, plan.degree, [(r, placed)], now)

    def _in_macro(self, now: float) -> bool:
        m = self._macro
        return m is not None and (now == m[0] or now < m[1])

    def _may_start(self, finish: float, now: float) -> bool:
        """Whether a prefill planned to end at `finish` may start now (macro iterations,
        assumption 7; always, with prefill_every 0)."""
        n = self.settings.prefill_every
        if not n:
            return True
        if self._in_macro(now):
            return now == self._macro[0] or finish <= self._macro[1]
        return not self.table.decoding or max(self._steps.values(), default=0) >= n

    def _start_prefill(self, members: list[Instance], degree: int, reserve, now: float) -> None:
        # the instances' decode iterations in progress finish first
        start = max([now] + [i.decode_end for i in members if i.decode_end is not None])
        t = self._ring(tuple(r.prompt_len for r, _ in reserve), degree, self._inter_node(members))
        batch = Batch(self._next_batch_id(), start, predicted_time_s=t.total_s)
        for r, placed in reserve:
            self.kv.reserve(r, placed)
            batch.prefills.append(self.table.schedule_chunk(r, r.prompt_len))
            self.table.begin_prefill(r, start)
        prefill = Prefill(members, batch, start, start + t.total_s, t)
        if self.settings.prefill_every:
            if self._in_macro(now):
                self._macro = (self._macro[0], max(self._macro[1], prefill.end))
            else:
                self._macro = (now, prefill.end)
                self._steps.clear()
        for inst in members:
            inst.prefill = prefill
        lead, *others = members
        self.log.record(lead.index, batch, start, prefill.end)
        for inst in others:  # busy with the same iteration, its tokens logged once
            self.log.record(
                inst.index,
                Batch(batch.batch_id, start, predicted_time_s=t.total_s),
                start,
                prefill.end,
            )
        self._push(prefill.end, _PREFILL_DONE, prefill)

    def _prefill_done(self, prefill: Prefill, now: float) -> list[Request]:
        for inst in prefill.instances:
            inst.prefill = None
        return self.table.complete(prefill.batch, BatchResult(prefill.time.total_s), now)

    # ---- decodes ---------------------------------------------------------------------------
    def _schedule_decodes(self, now: float) -> None:
        """Start a decode iteration on every group of instances that is idle and has decodes
        to run; a group: instances linked by requests whose KV spans them."""
        up = [i for i in self.instances if i.prefill is None]
        if not up:
            return
        parent = {i: i for i in up}

        def root(i):
            while parent[i] is not i:
                parent[i] = parent[parent[i]]
                i = parent[i]
            return i

        layouts = {}
        for r in self.table.decoding.values():
            if r.num_inflight_batches:
                continue
            master, parts = self.kv.decode_layout(r, r.num_scheduled)
            members = {master, *(inst for inst, _ in parts)}
            if any(m.prefill is not None for m in members):
                continue  # a holder is in a prefill: the decode stalls
            layouts[r] = (master, parts)
            first, *rest = members
            for m in rest:
                parent[root(m)] = root(first)
        groups: dict[Instance, list[Instance]] = {}
        for i in up:
            groups.setdefault(root(i), []).append(i)
        work: dict[Instance, list[Request]] = {}
        for r, (master, _) in layouts.items():
            work.setdefault(root(master), []).append(r)
        for g, members in groups.items():
            reqs = work.get(g)
            if reqs and all(m.decode_end is None for m in members):
                self._start_decode(members, reqs, layouts, now)

    def _start_decode(self, members, reqs, layouts, now: float) -> None:
        p = self.predictor
        led: dict[Instance, list[Request]] = {m: [] for m in members}
        kv_lens: dict[Instance, list[int]] = {m: [] for m in members}
        spread = False
        for r in reqs:
            master, parts = layouts[r]
            led[master].append(r)
            spread |= len({master, *(i for i, _ in parts)}) > 1
            for inst, kv in parts:
                kv_lens[inst].append(kv)
        times = []
        for m in members:
            n = len(led[m])
            t = p.linear_time(n, n) if n else 0.0
            times.append(t + (p.decode_attention_total(kv_lens[m]) if kv_lens[m] else 0.0))
        duration = max(times) + (self._merge_s(members, reqs) if spread else 0.0)
        end = now + duration
        batches = []
        for m in members:
            chunks = self.table.schedule_decodes(led[m])
            batch = Batch(
                self._next_batch_id(),
                now,
                decodes=chunks,
                predicted_time_s=duration,
                decode_kv_sum=sum(c.start for c in chunks),
            )
            self.log.record(m.index, batch, now, end)
            batches.append(batch)
            m.decode_end = end
        self._push(end, _DECODE_DONE, (members, batches, duration))

    def _merge_s(self, members, reqs) -> float:
        """Multi-master decoding's exchange per layer: the new tokens' queries out to the
        holders, each holder's partial output and its log-sum-exp back (fp32), between nodes
        when the group spans them."""
        p, m = self.predictor, self.predictor.model
        hw, tp = p.hardware, self.parallel.tp
        bw, lat = (
            (hw.internode_bw, hw.internode_latency_s)
            if self._inter_node(members)
            else (hw.link_bw, hw.link_latency_s)
        )
        q = math.ceil(m.num_heads / tp) * m.head_dim
        nbytes = len(reqs) * (2 * q * hw.dtype_bytes + math.ceil(m.num_heads / tp) * 4)
        return m.num_layers * (2 * lat + nbytes / bw)

    def _decode_done(self, payload, now: float) -> list[Request]:
        members, batches, duration = payload
        counts = self.settings.prefill_every and not self._in_macro(now)
        for m in members:
            m.decode_end = None
            if counts:
                self._steps[m] = self._steps.get(m, 0) + 1
        done = []
        for batch in batches:
            done += self.table.complete(batch, BatchResult(duration), now)
        return done
