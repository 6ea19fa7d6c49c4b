"""The router's model of one replica: the `ReplicaView` the dispatchers read, built from what the
router itself sees of that replica.

Every request reaches a replica through the router, so the router knows exactly which requests
each replica holds, when each got its first token (the first token event of its stream) and when
it ended. What it cannot see is how far a replica has got with the prefills still waiting for
their first token: it predicts that with the replica's own batch-time model (read from the
replica's GET /medha/predictor: its profile or the roofline of its hardware, not its online
correction; until then, or for a replica that does not publish one, the router's
--predictor) and the prefill-time walk its scheduler uses, draining the waiting requests'
predicted work in the replica's policy order as time passes, and lets each first token
correct it (the request leaves the waiting set whatever the prediction said). A request that
is never streamed shows no first token: it waits, its work drained to nothing, until it ends.

The profile prices a replica's batches; a replica serving under load is slower than that
(1.2-1.5x on issue 33's 2-core machine, with the router and the clients beside the replicas,
while a lone request through HTTP takes what the profile says), and a replica that plans with
the roofline of its hardware may run 2x slower than it (the mixed workload of issue 51). The
model measures it over busy periods: from a dispatch that finds no request waiting for its
first token to the first token that leaves none waiting, the replica prefills exactly the work
the router sent it in that time, in whatever order it chose. The period's measured length,
less the replica's round trip (the HTTP hop the model does not price: its quickest recent
health check), against its predicted one (the iteration under way, then each request's prefill
work stretched by the decodes as they were at its dispatch) is a sample of its speed, and
`slowdown`, measured over predicted summed over the recent periods, stretches every prediction
and the drain. Every period counts, a lone short prompt's too (a workload of short prompts
must teach the replica's speed), each by its predicted length: a long period measures the speed
better than a short one, whose jitter and fixed costs weigh a larger part of it. A period
holding a request answered whole (no first token seen) or one that ended without a first token
is no sample. Until a replica has measured a period of its own, it is taken to run as its peers
priced with the same model do (the mean of their slowdowns, each measured): a replica whose
first period is one long prefill would otherwise be priced at the model's speed for all of it,
and draw the short prompts that arrive meanwhile (the mixed workload's misses, issue 51).

What a replica's prefix cache holds is predicted the same way: every prompt the router sent it,
its chained block keys kept in an LRU of the cache's capacity.
"""

from __future__ import annotations

import math
import time
from collections import OrderedDict
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass

from medha.core.request import Request, mean_due_s
from medha.dispatch.base_dispatcher import DecodeShare, Pending, decode_token_s
from medha.perf.predictor import Predictor
from medha.perf.prefill_time_cache import PrefillTimeCache
from medha.scheduler.config import SchedulerConfig
from medha.scheduler.packers import replica_policy
from medha.scheduler.prefix_cache import cacheable_pages
from medha.scheduler.replica_rules import QueueSnapshot, StepRules, prefill_order, step_budget_s

# How long an ended request's record stays for the dispatchers that look back (pla's window).
_KEEP_ENDED_S = 120.0
# The slowdown's samples (see the module): the sums of the periods' measured and predicted
# lengths forget by exp(-predicted / this) at each new period (about the last this many seconds
# of predicted work count; the first period counts in full: the start of a run is when a wrong
# speed costs most), each period's measured length clipped to this range of its predicted one
# (one stalled or cut request must not throw the model off).
_SAMPLE_WINDOW_S = 4.0
_SAMPLE_RANGE = (0.5, 3.0)


class PrefixIndex:
    """The chained block keys a replica is taken to cache, least recently sent first out."""

    def __init__(self, capacity_blocks: int) -> None:
        self.capacity_blocks = max(1, capacity_blocks)
        self._keys: OrderedDict[Hashable, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._keys)

    def match(self, keys: list[Hashable], limit: int) -> int:
        """How many of `keys` (at most `limit`), from the first, are held."""
        n = 0
        while n < limit and keys[n] in self._keys:
            n += 1
        return n

    def add(self, keys: list[Hashable]) -> None:
        for k in keys:
            self._keys[k] = None
            self._keys.move_to_end(k)
        while len(self._keys) > self.capacity_blocks:
            self._keys.popitem(last=False)


@dataclass(slots=True)
class BusyPeriod:
    """A stretch of time in which the replica always had a request waiting for its first token
    (see the module): when it began, its length predicted at the profile's speed so far, and
    whether it can still be a sample of the speed."""

    start_s: float
    predicted_s: float
    sample: bool = True


@dataclass(slots=True, eq=False)  # one per dispatch: identity, not field equality
class Routed:
    """One request the router sent a replica, as the router sees it."""

    request: Request
    deadline_s: float  # absolute TTFT deadline
    work_s: float  # predicted prefill work left (drained as time passes)
    expected_tokens: int
    first_token_s: float | None = None
    tokens: int = 0
    ended_s: float | None = None
    total_s: float = 0.0  # its whole predicted prefill work, as sent
    # whether the router sees its first token; a whole answer's comes with its end, so until
    # then one whose predicted work has drained is taken to be decoding (first token unknown)
    streamed: bool = True
    cached: int = 0  # prompt tokens the replica's prefix cache was predicted to hold

    @property
    def waiting(self) -> bool:
        """Still waiting for its first token, as far as the router can tell."""
        return self.first_token_s is None and (self.streamed or self.work_s > 0)

    @property
    def started(self) -> bool:
        return self.work_s < self.total_s

    @property
    def tpot_target_s(self) -> float | None:
        return self.request.tpot_target_s

    @property
    def ttft_deadline_s(self) -> float | None:
        return self.request.ttft_deadline_s

    @property
    def remaining_work_s(self) -> float:
        return self.work_s

    slack = Request.slack

    def own_due_s(self, spp: int = 1) -> float | None:
        """When its next token falls due by its own TPOT target, as the replica counts it
        (Request.own_due_s), from the first token and the tokens the router has seen; None
        if it set none or its first token is not known."""
        target = self.tpot_target_s
        if target is None or self.first_token_s is None:
            return None
        return mean_due_s(self.first_token_s, self.tokens, target, spp)

    @property
    def num_uncached_tokens(self) -> int:
        """As the replica counts them: its whole context until it looks the request up, at
        the start of its prefill."""
        return self.request.prompt_len - (self.cached if self.started else 0)


class TrackedReplica:
    """A replica as the router sees it (a `ReplicaView`); `events` come from the proxy."""

    def __init__(
        self,
        replica_id: int,
        predictor: Predictor,
        config: SchedulerConfig,
        prefill_times: PrefillTimeCache,
        block_size: int,
        cache_tokens: int,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.replica_id = replica_id
        self.predictor = predictor
        self.scheduler_config = config
        self.prefix_caching = True
        self.prefill_times = prefill_times
        self.block_size = block_size
        self.index = PrefixIndex(cache_tokens // block_size)
        self.clock = clock
        self._decode_token_s = decode_token_s(predictor)
        self._decode_share = DecodeShare(predictor, config.iteration_budget_s)
        self._measured_s = self._predicted_s = 0.0  # the samples' forgetting sums
        self._model = predictor.describe()  # (which peers' speed is this one's)
        # the replicas whose measured speed is this one's until it measures its own (the
        # router's list of them all: those priced with another model are passed over)
        self.peers: Sequence[TrackedReplica] = ()
        self.round_trip_s = 0.0  # its quickest recent health check (the router's to set)
        self._period: BusyPeriod | None = None  # the busy period under way, if any
        self._policy = replica_policy(config)
        self._rules = StepRules.of(config, predictor.parallel.spp)
        self._live: dict[str, Routed] = {}
        self._queue: list[Routed] = []  # those without a first token
        self._ended: OrderedDict[str, Routed] = OrderedDict()
        self._anchor = clock()

    def set_model(
        self, predictor: Predictor, config: SchedulerConfig, prefill_times: PrefillTimeCache
    ) -> None:
        """Price from now on with `predictor` under the replica's scheduler `config` (its own
        model and defaults, read from it, or the router's walk to a longer context). What the
        requests it holds were priced at stays: their work drains on. A new model starts the
        measured slowdown over (it was measured against the old one): its peers' of the new
        model until it measures its own."""
        self._drain(self.clock())
        if predictor is not self.predictor:
            self._measured_s, self._predicted_s = 0.0, 0.0
            self._model = predictor.describe()
        if self._period is not None:  # (priced with the old model)
            self._period.sample = False
        self.predictor = predictor
        self.scheduler_config = config
        self.prefill_times = prefill_times
        self._decode_token_s = decode_token_s(predictor)
        self._decode_share = DecodeShare(predictor, config.iteration_budget_s)
        self._policy = replica_policy(config)
        self._rules = StepRules.of(config, predictor.parallel.spp)

    def describe(self) -> str:
        return self._model

    # ---- events (the proxy's) ----------------------------------------------------------------
    def on_dispatch(
        self, request: Request, deadline_s: float, expected_tokens: int, streamed: bool = True
    ) -> None:
        now = self.clock()
        self._drain(now)
        cached = self.cached_tokens(request)
        work = self.prefill_work_s(request, cached)
        routed = Routed(
            request,
            deadline_s,
            work,
            expected_tokens,
            total_s=work,
            streamed=streamed,
            cached=cached,
        )
        if self._period is None or not any(r.waiting for r in self._queue):
            # a new busy period, from the iteration under way (at the profile's speed)
            self._period = BusyPeriod(now, self.iteration_left_s(now) / self.slowdown)
        self._period.predicted_s += work * self._decode_share.stretch(self._decode_contexts())
        # (a whole answer's "first token" is its end: no measure of the prefill)
        self._period.sample &= streamed
        self._live[request.request_id] = routed
        self._queue.append(routed)
        keys, _, _ = cacheable_pages(request, self.block_size)
        self.index.add(keys)

    def on_first_token(self, request_id: str) -> None:
        r = self._live.get(request_id)
        if r is not None and r.first_token_s is None:
            now = self.clock()
            self._drain(now)
            r.first_token_s, r.work_s, r.tokens = now, 0.0, 1
            self._queue.remove(r)
            period = self._period
            if period is not None and not any(q.waiting for q in self._queue):
                self._period = None  # it ends: none waits
                if period.sample and period.predicted_s > 0:
                    self._sample(now - period.start_s - self.round_trip_s, period.predicted_s)

    def _sample(self, measured_s: float, predicted_s: float) -> None:
        lo, hi = _SAMPLE_RANGE
        keep = math.exp(-predicted_s / _SAMPLE_WINDOW_S)
        self._measured_s = (
            keep * self._measured_s + min(hi, max(lo, measured_s / predicted_s)) * predicted_s
        )
        self._predicted_s = keep * self._predicted_s + predicted_s

    @property
    def measured(self) -> bool:
        """Whether it has measured a period of its own."""
        return self._predicted_s > 0

    @property
    def slowdown(self) -> float:
        """Measured time to first token over predicted (see the module): its own, else its
        peers' of the same model, else 1."""
        if self.measured:
            return self._measured_s / self._predicted_s
        learned = [p.slowdown for p in self.peers if p.measured and p._model == self._model]
        return sum(learned) / len(learned) if learned else 1.0

    def on_tokens(self, request_id: str, n: int) -> None:
        r = self._live.get(request_id)
        if r is not None:
            r.tokens += n

    def on_end(self, request_id: str) -> None:
        """The request finished, failed or was cancelled: the replica holds it no more."""
        now = self.clock()
        self._drain(now)
        r = self._live.pop(request_id, None)
        if r is not None:
            if r.first_token_s is None:
                self._queue.remove(r)
                if self._period is not None:  # its work was not all done: no measure
                    self._period.sample = False
            r.ended_s = now
            self._ended[request_id] = r
        while self._ended and next(iter(self._ended.values())).ended_s < now - _KEEP_ENDED_S:
            self._ended.popitem(last=False)

    # ---- the prediction ----------------------------------------------------------------------
    def _drain(self, now: float) -> None:
        """Spend the time since the last call on the waiting requests' work, in policy order
        (the decodes and the measured slowdown as they are now: every event drains first)."""
        dt, self._anchor = now - self._anchor, now
        if dt <= 0 or not self._queue:
            return
        dt /= self.prefill_stretch()
        for p in self._waiting_in_order(now):
            r = self._live[p.request_id]
            take = min(r.work_s, dt)
            r.work_s -= take
            dt -= take
            if dt <= 0:
                break

    # ---- ReplicaView -------------------------------------------------------------------------
    def outstanding_work_s(self) -> float:
        self._drain(self.clock())
        return sum(
            r.work_s + max(0, r.expected_tokens - r.tokens) * self._decode_token_s
            for r in self._live.values()
        )

    def _pending(self, r: Routed) -> Pending:
        return Pending(
            r.request.request_id,
            r.request.arrival_s,
            r.deadline_s,
            r.work_s,
            r.total_s,
            r.num_uncached_tokens,
            r.started,
            r.request.priority_rank,
            r.ttft_deadline_s,
        )

    def _waiting_in_order(self, now: float) -> list[Pending]:
        """The requests waiting for their first token, in the replica's prefill order (its
        queue's order is the order the router sent them in)."""
        waiting = [self._pending(r) for r in self._queue if r.waiting]
        return prefill_order(self._policy, waiting, now, self._rules.long_threshold)

    def pending(self, now: float) -> list[Pending]:
        self._drain(now)
        return [self._pending(r) for r in self._queue if r.waiting]

    def iteration_left_s(self, now: float) -> float:
        """Half an iteration of what it runs: its step's budget while prefills wait
        (`step_budget_s`; less when their work left is less), a decode iteration while it
        only decodes."""
        contexts = self._decode_contexts()
        decoding = self._decode_share.decode_iteration_s(contexts)
        if any(r.waiting for r in self._queue):
            budget = self.step_budget_s(now) or math.inf
            decoding = min(budget, decoding + sum(r.work_s for r in self._queue))
        return 0.5 * self.slowdown * decoding

    def step_budget_s(self, now: float) -> float:
        """The time budget of the step the replica runs now, by its rules
        (replica_rules.step_budget_s) over what the router knows of its queue."""
        decoding = [r for r in self._live.values() if not r.waiting]
        told = any(r.request.told for r in self._live.values())
        snapshot = QueueSnapshot(now, [r for r in self._queue if r.waiting], decoding, told)
        floor = [(self._rules.min_chunk_tokens, 0)]
        return step_budget_s(
            snapshot,
            self._rules,
            lambda: self.predictor.shape_time(floor, self._decode_contexts()),
        )

    def waiting_order(self, now: float) -> list[str]:
        """The ids of the requests waiting for their first token, in the order the router
        predicts the replica prefills them."""
        self._drain(now)
        return [p.request_id for p in self._waiting_in_order(now)]

    def _decode_contexts(self) -> list[int]:
        return [r.request.prompt_len + r.tokens for r in self._live.values() if not r.waiting]

    def prefill_stretch(self) -> float:
        return self.slowdown * self._decode_share.stretch(self._decode_contexts())

    def busy(self) -> bool:
        return bool(self._live)

    def cached_tokens(self, request: Request) -> int:
        keys, per, limit = cacheable_pages(request, self.block_size)
        return self.index.match(keys, limit) * per * self.block_size

    def prefill_work_s(self, request: Request, cached: int) -> float:
        """The replica's predicted prefill time still ahead of `request` with `cached` tokens
        of it cached. A prompt past the context of the router's model (the replica may serve
        a longer one) is priced as its stretch of the walk to that context, scaled to its
        length: a bounded estimate, low (attention grows faster), never a failed request."""
        times, total = self.prefill_times, request.prompt_len
        if total <= times.max_len:
            return times.remaining(total, cached)
        per_token = times.time(times.max_len) / times.max_len
        done = times.time(cached) if cached <= times.max_len else per_token * cached
        return max(0.0, per_token * total - done)

    def progress(self, request: Request) -> tuple[float | None, float, bool]:
        rid = request.request_id
        r = self._live.get(rid)
        if r is not None:
            return r.first_token_s, r.deadline_s, False
        r = self._ended.get(rid)
        if r is not None:
            return r.first_token_s, r.deadline_s, True
        return None, math.inf, True

    @property
    def num_live(self) -> int:
        return len(self._live)
