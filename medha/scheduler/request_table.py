"""The request table: every live request, the queue it is in, and the only code that changes a
request's state and progress.

A live request is in exactly one queue, the one of its state: `prefilling` (waiting, prefilling
or preempted by recompute: its prefill is ahead of it), `decoding`, or `swapped` (its KV in the
swap pool). Aborted requests whose KV a running batch still writes wait in `aborted_inflight`
until that batch returns. Each operation below is one step of a request's life: it changes the
request's fields and moves it to the queue of its new state in the same call, so the queues
never disagree with the states.

    admit -> schedule_chunk / schedule_decodes -> begin_prefill -> complete -> (finished)
    attach_cached / detach_cached              a prefix-cache hit taken at a prefill's start
    evict (recompute or swap out) -> swap_in   the KV arbiter's decisions, applied
    abort, discard                             the client's or the executor's end of it

The scheduler decides (with its policy, packer and KV arbiter) and calls these; the KV arbiter
reads requests and returns decisions, never changing one; executors read requests.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from medha.core.batch import Batch, BatchResult, Chunk, KVSwap
from medha.core.request import Request, RequestState
from medha.perf.prefill_time_cache import PrefillTimeCache
from medha.scheduler.kv_arbiter import Eviction, KVArbiter, KVStats


class SchedulerInvariantError(AssertionError):
    pass


@dataclass
class SchedulerStats(KVStats):
    """The KV arbiter's preemption and swap counters, and the scheduler's own."""

    batches: int = 0
    finished: int = 0
    aborted: int = 0


class RequestTable:
    def __init__(self, prefill_times: PrefillTimeCache, stats: SchedulerStats) -> None:
        """`prefill_times` keeps each request's remaining prefill work (what the policies
        order by) current; `stats` counts finished and aborted requests. `kv` is set by the
        scheduler that owns both: the table releases a request's KV through it when the
        request ends."""
        self.prefill_times = prefill_times
        self.stats = stats
        self.kv: KVArbiter | None = None
        self._live: dict[str, Request] = {}
        self._prefilling: dict[str, Request] = {}
        self._decoding: dict[str, Request] = {}
        self._swapped: dict[str, Request] = {}  # in swap-out order
        self._resume: dict[str, RequestState] = {}  # the phase each swapped request left
        self._aborted_inflight: dict[str, Request] = {}
        # live requests that carry a target of their own (Request.told): batches look for the
        # tightest only while some do (a read per decode per batch shows in the simulator's time)
        self.told_requests = 0
        self._admissions = 0

    # ---- the queues (read-only views) ------------------------------------------------------
    @property
    def live(self) -> Mapping[str, Request]:
        """Every admitted request that has not finished or been aborted, in admission order."""
        return self._live

    @property
    def prefilling(self) -> Mapping[str, Request]:
        """Requests with prefill work ahead: waiting, prefilling, or preempted by recompute."""
        return self._prefilling

    @property
    def decoding(self) -> Mapping[str, Request]:
        return self._decoding

    @property
    def swapped(self) -> Mapping[str, Request]:
        """Requests whose KV waits in the swap pool, in swap-out order."""
        return self._swapped

    @property
    def aborted_inflight(self) -> Mapping[str, Request]:
        """Aborted requests whose KV is freed when the batches that write it return."""
        return self._aborted_inflight

    def get(self, request_id: str) -> Request | None:
        return self._live.get(request_id)

    def __len__(self) -> int:
        return len(self._live)

    def prefill_counts(self) -> tuple[int, int]:
        """(waiting, prefilling) of one instant: together, the prefill-phase queue. The queue
        is copied without running Python code in between, so without letting another thread
        in: a metrics scrape may count while the engine's thread changes it."""
        queue = tuple(self._prefilling.values())
        prefilling = RequestState.PREFILLING
        started = sum(r.state is prefilling for r in queue)
        return len(queue) - started, started

    # ---- admission and the end of a request ------------------------------------------------
    def admit(self, r: Request, deadline_s: float, work_s: float) -> None:
        """A new request, checked by the scheduler: due `deadline_s` after its arrival, with
        `work_s` of predicted prefill work ahead."""
        r.deadline_s = r.arrival_s + deadline_s
        r.total_work_s = max(work_s, 1e-12)
        r.remaining_work_s = work_s
        r.admission_seq = self._admissions
        self._admissions += 1
        self._live[r.request_id] = r
        self._prefilling[r.request_id] = r
        if r.told:
            self.told_requests += 1

    def abort(self, request_id: str, now: float, reason: str = "abort") -> Request | None:
        """End a live request; its KV is released once no running batch writes it."""
        r = self._live.pop(request_id, None)
        if r is None:
            return None
        self._leave_queues(r)
        r.transition(RequestState.ABORTED)
        r.finish_s, r.finish_reason = now, reason
        if r.num_inflight_batches:  # (a swapped request runs in no batch)
            self._aborted_inflight[request_id] = r
        else:
            self.kv.free(request_id)
        self.stats.aborted += 1
        return r

    def _finish(self, r: Request, now: float, reason: str) -> None:
        r.transition(RequestState.FINISHED)
        r.finish_s, r.finish_reason = now, reason
        kv = self.kv
        if kv.cache_outputs:  # (only a request that finished: an aborted one's KV may be torn)
            kv.cache_finished(r)
        kv.free(r.request_id)
        del self._live[r.request_id]
        self._leave_queues(r)
        self.stats.finished += 1

    def _leave_queues(self, r: Request) -> None:
        rid = r.request_id
        if r.told:
            self.told_requests -= 1
        self._prefilling.pop(rid, None)
        self._decoding.pop(rid, None)
        if self._swapped.pop(rid, None) is not None:
            del self._resume[rid]

    def _release_aborted(self, r: Request) -> None:
        if r.num_inflight_batches == 0 and self._aborted_inflight.pop(r.request_id, None):
            self.kv.free(r.request_id)

    # ---- forming a batch -------------------------------------------------------------------
    def schedule_decodes(self, requests: Iterable[Request]) -> list[Chunk]:
        """One decode token each joins a batch (their chunks): they are members of it until it
        returns (a member is never chosen as a preemption victim)."""
        chunks = []
        for r in requests:
            chunks.append(Chunk(r, r.num_scheduled, 1, True))
            r.num_scheduled += 1
            r.num_inflight_batches += 1
        return chunks

    def schedule_chunk(self, r: Request, num_tokens: int) -> Chunk:
        """`num_tokens` more of `r`'s context join a batch (their chunk)."""
        start = r.num_scheduled
        r.num_scheduled += num_tokens
        r.num_inflight_batches += 1
        return Chunk(r, start, num_tokens, start + num_tokens == r.num_tokens)

    def begin_prefill(self, r: Request, now: float) -> None:
        """`r` has a prefill chunk in the batch formed at `now`."""
        if r.state is not RequestState.PREFILLING:
            r.transition(RequestState.PREFILLING)
        if r.first_scheduled_s is None:
            r.first_scheduled_s = now

    def attach_cached(self, r: Request, hit: int, loaded: int) -> None:
        """The prefix cache supplied the first `hit` tokens of `r`'s prompt at the (re)start
        of its prefill (`loaded` of them copied back from the host tier just now): they count
        as computed, and its chunks begin after them."""
        if not hit:
            r.num_host_cached_tokens = 0  # (what an earlier try copied back is gone again)
            return
        r.num_computed = r.num_scheduled = r.num_cached_tokens = hit
        # pages copied back for an earlier try of this start, and on the device since, came
        # from the host tier too (detach_cached keeps the count)
        r.num_host_cached_tokens = min(hit, r.num_host_cached_tokens + loaded)
        r.remaining_work_s = self.prefill_times.remaining(r.num_tokens, hit)

    def detach_cached(self, r: Request) -> None:
        """Give back the cached prefix of a request that attached one and was not scheduled
        after all: it looks again when it is next considered (the cache may hold more by
        then), and its blocks are evictable meanwhile."""
        if r.num_cached_tokens and not r.started and not r.num_inflight_batches:
            self.kv.free(r.request_id)
            r.num_computed = r.num_scheduled = r.num_cached_tokens = 0

    def reprice(self) -> None:
        """Price again the prefill work of every request still in its prefill, after the
        prefill-time walk changed (the predictor was corrected from measured steps): the work
        ahead of it, and its whole prefill's (from its cached prefix on). Deadlines stay: they
        were promised at admission."""
        time = self.prefill_times.time  # (remaining(), spelled out: most have computed none)
        for r in self._prefilling.values():
            whole = time(r.num_tokens)
            cached, computed = r.num_cached_tokens, r.num_computed
            r.total_work_s = max(whole - time(cached) if cached else whole, 1e-12)
            r.remaining_work_s = max(0.0, whole - time(computed)) if computed else whole

    def evict(self, evictions: Iterable[Eviction], batch: Batch) -> None:
        """Apply the KV arbiter's evictions for `batch`: a recomputed request (its KV dropped)
        waits to prefill its whole context again; a swapped-out one keeps its progress and
        leaves every queue until it is swapped back in."""
        for r, swap in evictions:
            r.num_preemptions += 1
            if swap is None:
                r.num_computed = r.num_scheduled = 0
                r.num_cached_tokens = r.num_host_cached_tokens = 0
                r.transition(RequestState.PREEMPTED)
                r.total_work_s = max(self.prefill_times.time(r.num_tokens), 1e-12)
                r.remaining_work_s = r.total_work_s
                self._decoding.pop(r.request_id, None)
                self._prefilling[r.request_id] = r
                batch.preempted.append(r)
            else:
                self._resume[r.request_id] = r.state
                r.transition(RequestState.SWAPPED)
                r.num_swaps += 1
                self._decoding.pop(r.request_id, None)
                self._prefilling.pop(r.request_id, None)
                self._swapped[r.request_id] = r
                batch.swap_out.append(swap)

    def swap_in(self, swaps: Iterable[KVSwap], batch: Batch) -> None:
        """The KV arbiter brought these requests' KV back for `batch`: each returns to the
        phase it left, and to its queue."""
        for s in swaps:
            r = s.request
            del self._swapped[r.request_id]
            r.transition(self._resume.pop(r.request_id))
            queue = self._decoding if r.state is RequestState.DECODING else self._prefilling
            queue[r.request_id] = r
            batch.swap_in.append(s)

    def revise(self, chunk: Chunk, start: int, end: int) -> None:
        """The executor runs [start, end) of `chunk`'s request instead of what the chunk
        planned (before the batch runs): tokens before `start` that this chunk was to compute
        are computed already (a prefix-cache hit of the executor's own)."""
        r = chunk.request
        if start > r.num_computed and r.num_inflight_batches == 1:
            r.num_computed = start
        r.num_scheduled = end

    def count_placeholders(self, batch: Batch) -> None:
        """Async scheduling: the next batch is being formed while `batch` runs. The token each
        of its sampling chunks produces joins its request's context as a placeholder, so that
        the request may decode it in the next batch; a request whose prompt ends in `batch`
        is decoding from now on (its first token is on its way)."""
        batch.placeholders = True
        for chunk in batch.decodes:  # (every decode samples; one that ended meanwhile is
            chunk.request.num_placeholders += 1  # never read again)
        for chunk in batch.prefills:
            r = chunk.request
            if not chunk.samples or r.state.is_done:
                continue
            r.num_placeholders += 1
            if r.state is RequestState.PREFILLING:
                r.transition(RequestState.DECODING)
                r.remaining_work_s = 0.0
                del self._prefilling[r.request_id]
                self._decoding[r.request_id] = r

    def unschedule(self, chunk: Chunk) -> None:
        """`chunk` leaves its batch before it runs: its request waits as before."""
        chunk.request.num_scheduled = chunk.start
        chunk.request.num_inflight_batches -= 1

    # ---- results ---------------------------------------------------------------------------
    def complete(self, batch: Batch, result: BatchResult, now: float) -> list[Request]:
        """Apply a batch that ran: advance each request's KV, append the sampled tokens, end
        the requests that finished (returned)."""
        kv = self.kv
        finished: list[Request] = []
        tokens, stopped = result.token_ids, result.stopped
        # (async scheduling) each sampling chunk's token was counted as a placeholder
        placeholders = 1 if batch.placeholders else 0
        aborted, done = RequestState.ABORTED, RequestState.FINISHED
        for chunk in batch.prefills:
            r = chunk.request
            r.num_inflight_batches -= 1
            if r.state is aborted or r.state is done:
                self._release_aborted(r)
                continue
            r.num_computed = max(r.num_computed, chunk.start + chunk.num_tokens)
            if kv.prefix_caching:
                kv.cache_computed(r)
            if not chunk.samples:
                r.remaining_work_s = self.prefill_times.remaining(r.num_tokens, r.num_computed)
                continue
            r.num_placeholders -= placeholders
            if self._sampled(r, batch, tokens, stopped, now):
                finished.append(r)
            elif r.state is RequestState.PREFILLING:  # (under async scheduling: decoding already)
                r.transition(RequestState.DECODING)
                r.remaining_work_s = 0.0
                del self._prefilling[r.request_id]
                self._decoding[r.request_id] = r
        for chunk in batch.decodes:  # the hot loop of a long simulation (and of a big batch)
            r = chunk.request
            r.num_inflight_batches -= 1
            if r.state is aborted or r.state is done:
                # (done: under async scheduling, a request that stopped at the token of the
                # batch before this one, which was formed with its next decode in it)
                self._release_aborted(r)
                continue
            r.num_computed = chunk.start + 1
            r.num_placeholders -= placeholders
            if tokens is None:  # _sampled inlined: no token ids to keep (simulator, vLLM)
                r.num_output_tokens += 1
                r.token_times_s.append(now)
                if (r.num_output_tokens >= r.max_tokens or r.request_id in stopped) and self._stops(
                    r, stopped, now
                ):
                    finished.append(r)
            elif self._sampled(r, batch, tokens, stopped, now):
                finished.append(r)
        return finished

    def discard(self, batch: Batch, now: float) -> list[Request]:
        """A batch that never completed: abort its requests and release their KV, since what it
        would have written is unknown (so is the KV it was moving)."""
        requests = {c.request.request_id: c.request for c in (*batch.prefills, *batch.decodes)}
        requests.update(
            (s.request.request_id, s.request)
            for s in (*batch.swap_in, *batch.swap_out)
            if s.request.request_id in self._live
        )
        for r in requests.values():
            self.abort(r.request_id, now)
        for c in (*batch.prefills, *batch.decodes):
            c.request.num_inflight_batches -= 1
            self._release_aborted(c.request)
        return list(requests.values())

    def _sampled(
        self,
        r: Request,
        batch: Batch,
        tokens: dict[str, int] | None,
        stopped: frozenset[str],
        now: float,
    ) -> bool:
        """Record the token a sampling chunk produced; True when it finished the request."""
        if tokens is not None:
            token = tokens.get(r.request_id)
            if token is None:
                raise ValueError(f"batch {batch.batch_id}: no token for {r.request_id}")
            r.output_token_ids.append(token)
        r.num_output_tokens += 1
        r.token_times_s.append(now)
        return self._stops(r, stopped, now)

    def _stops(self, r: Request, stopped: frozenset[str], now: float) -> bool:
        """Finish `r` if its latest token ended it (a stop the executor saw, or max_tokens)."""
        if r.request_id in stopped:
            self._finish(r, now, "stop")
            return True
        if r.num_output_tokens >= r.max_tokens:
            self._finish(r, now, "length")
            return True
        return False

    # ---- checks ----------------------------------------------------------------------------
    def check_invariants(self) -> None:
        """Every live request is in the queue of its state, exactly one, with consistent
        progress; the count of requests with targets of their own is right."""
        queues = (self._prefilling, self._decoding, self._swapped)
        for rid, r in self._live.items():
            if sum(rid in q for q in queues) != 1 or r.in_prefill != (rid in self._prefilling):
                raise SchedulerInvariantError(f"{r} is in the wrong queue")
            if not (r.num_computed <= r.num_scheduled <= r.num_tokens and r.num_placeholders >= 0):
                raise SchedulerInvariantError(f"{r} has inconsistent progress")
        if any(rid not in self._live for q in queues for rid in q) or set(self._resume) != set(
            self._swapped
        ):
            raise SchedulerInvariantError("a queue holds a request that is not live")
        own = sum(r.told for r in self._live.values())
        if own != self.told_requests:
            raise SchedulerInvariantError(
                f"{own} live requests carry a target of their own, counted {self.told_requests}"
            )
