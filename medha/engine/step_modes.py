"""How LLMEngine runs its batches, one `step` at a time: schedule, run, postprocess.

Three modes, one per engine (`step_mode` picks it):

- `OneBatch`: one batch at a time, run to its end before the next is formed (a pausable
  batch runs others between its layers: medha/engine/pauses.py);
- `AsyncSteps` (async scheduling): the next batch is formed and launched while the device
  runs the last one, whose tokens its decodes read on the device;
- `PipelinedSteps` (spp > 1): a new batch enters the pipeline as soon as stage 0 is free, and
  the oldest in flight is finished.

Each batch ends the same way (`OneBatch.postprocess`): its tokens sampled, added to its
requests' states, its measured time and tokens reported to the scheduler, its outputs formed.
What a request that fails on its own does to a batch is the failure isolation's
(medha/engine/isolation.py).
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import time
from dataclasses import dataclass

import torch

from medha.core.batch import Batch, BatchResult
from medha.core.request import Request
from medha.engine.errors import RequestFailedError, blame, is_fatal
from medha.engine.host_kv import move_kv
from medha.engine.layers.sampler import DeviceSample, finish_sampling, on_host, start_sampling
from medha.engine.outputs import RequestOutput, request_output

log = logging.getLogger("medha.engine")


def step_mode(engine) -> OneBatch:
    """The mode `engine`'s steps run in: pipelined with stages, else async where it schedules
    asynchronously, else one batch at a time."""
    if engine.pipeline is not None:
        return PipelinedSteps(engine)
    if engine.async_scheduling:
        return AsyncSteps(engine)
    return OneBatch(engine)


class OneBatch:
    """One batch at a time: schedule it, run it to its end, postprocess it."""

    # (async scheduling) the batch the device runs, whose results have not reached the host
    ahead: _Ahead | None = None

    def __init__(self, engine) -> None:
        """`engine`: the LLMEngine whose batches these are (not imported here: it imports
        this). Its scheduler, runner and request states are its own; a mode reads them."""
        self.engine = engine

    def step(self) -> list[RequestOutput]:
        batch = self.engine.scheduler.schedule(time.monotonic())
        return [] if batch is None else self.run_now(batch)

    def run_now(self, batch: Batch) -> list[RequestOutput]:
        """Run `batch` to its end: its KV copies, its forward pass, its sampling. A pausable
        batch runs others between its layers (medha/engine/pauses.py); its time leaves
        theirs out."""
        e = self.engine
        t0, paused = time.perf_counter(), e.pauses.paused_s
        with e.isolation.discarding(batch):
            move_kv(batch, e.swap_blocks, e.prefix_host_blocks)
            if not batch.num_seqs:  # the batch only moved KV
                e.scheduler.update(batch, BatchResult(time.perf_counter() - t0), time.monotonic())
                return []
            logits, chunks = e.isolation.run(batch, e.pauses.point if batch.pausable else None)
        return self.postprocess(batch, chunks, logits, t0 + e.pauses.paused_s - paused)

    def postprocess(self, batch, chunks, logits: torch.Tensor, t0: float) -> list[RequestOutput]:
        """Sample the batch's next tokens, hand its result to the scheduler, report them."""
        with self.engine.isolation.discarding(batch):
            started = start_sampling(logits, self.sampled_on_host(chunks))
        return self.complete(batch, chunks, started, lambda: time.perf_counter() - t0)

    def sampled_on_host(self, chunks) -> list[bool]:
        """Which sampling rows need their whole logits on the host (a request that ended
        meanwhile needs nothing)."""
        states = (self.engine._states.get(c.request.request_id) for c in chunks)
        return [s is not None and on_host(s.params) for s in states]

    def complete(
        self, batch: Batch, chunks, started: DeviceSample | None, duration
    ) -> list[RequestOutput]:
        """The host's half of sampling the batch's rows, then its result to the scheduler and
        the outputs. `duration()`: the batch's time, read once its tokens are on the host."""
        e = self.engine
        # requests aborted or failed while the batch ran (or before it launched) are left out
        keep = [i for i, c in enumerate(chunks) if c.request.request_id in e._states]
        chunks = [chunks[i] for i in keep]
        with e.isolation.discarding(batch):
            rids = [c.request.request_id for c in chunks]
            states = [e._states[rid] for rid in rids]
            samples = []
            if started is not None:
                params, gens = [s.params for s in states], [s.generator for s in states]
                samples = finish_sampling(started, keep, params, gens, rids)
        duration = duration()
        added = self._add_tokens(chunks, states, samples)
        e.metrics.record(batch, duration)
        tokens = {c.request.request_id: smp.token for c, _, smp, _, _ in added}
        stopped = frozenset(c.request.request_id for c, _, _, _, stop in added if stop)
        finished = e.scheduler.update(
            batch, BatchResult(duration, tokens, stopped), time.monotonic()
        )
        return self._outputs(added, {r.request_id: r for r in finished})

    def _add_tokens(self, chunks, states, samples) -> list[tuple]:
        """(chunk, state, sample, text delta, whether it ends the request) of each request whose
        sampled token was added; a request whose sampling or text failed ends alone."""
        added = []
        for c, s, smp in zip(chunks, states, samples):
            rid = c.request.request_id
            try:
                if isinstance(smp, RequestFailedError):
                    raise smp
                with blame(rid):
                    delta, stop = s.add(smp)
            except RequestFailedError as e:
                self.engine.isolation.fail(rid, e)
                continue
            added.append((c, s, smp, delta, stop))
        return added

    def _outputs(self, added: list[tuple], finished: dict[str, Request]) -> list[RequestOutput]:
        outputs = []
        for c, s, smp, delta, _ in added:
            r, end = c.request, finished.get(c.request.request_id)
            if end is not None and end.finish_reason == "length":
                delta += s.detok.flush()
            outputs.append(request_output(r.request_id, r, s, sample=smp, delta=delta, end=end))
            if end is not None:
                del self.engine._states[r.request_id]
        return outputs


class AsyncSteps(OneBatch):
    """Async scheduling: launch one batch and finish the one before it."""

    def step(self) -> list[RequestOutput]:
        """Form and launch the next batch, then finish the one before it while the device runs
        this one: the host's scheduling, sampling and bookkeeping overlap the model. The new
        batch's decodes read their input tokens from the last batch's output on the device
        (placeholders in the scheduler's count). A batch that needs the last one's results on
        the host first (KV copies, a token sampled on the host, a failed forward pass) runs
        after it, to its end."""
        ahead, self.ahead = self.ahead, None
        batch = self.engine.scheduler.schedule(time.monotonic())
        outputs: list[RequestOutput] = []
        if ahead is not None and (batch is None or not self._overlaps(batch, ahead)):
            outputs, ahead = self._finish(ahead), None
        if batch is None:
            return outputs
        launched = None
        if not (batch.swap_in or batch.swap_out or batch.cache_in or batch.cache_out):
            with self.engine.isolation.discarding(batch):
                try:
                    launched = self._launch_ahead(batch, ahead)
                except Exception as e:  # the isolation's bisection runs it again, after ahead
                    if is_fatal(e):
                        raise
                    log.warning("batch %d failed to launch ahead (%s): running it again "
                                "alone", batch.batch_id, e)  # fmt: skip
        if launched is None:
            if ahead is not None:
                outputs, ahead = outputs + self._finish(ahead), None
            outputs += self.run_now(batch)
        self.ahead = launched
        if ahead is not None:
            outputs += self._finish(ahead)
        return outputs

    def _overlaps(self, batch: Batch, ahead: _Ahead) -> bool:
        """Whether `batch` can run before `ahead`'s results reach the host: every decode whose
        token `ahead` samples finds it on the device (a greedy row of ahead's)."""
        for c in batch.decodes:
            r = c.request
            if r.num_placeholders:
                row = ahead.rows.get(r.request_id)
                if row is None or ahead.on_host[row]:
                    return False
        return True

    def _launch_ahead(self, batch: Batch, ahead: _Ahead | None) -> _Ahead:
        """Build `batch`'s inputs, feed its pending decodes from `ahead`'s tokens on the device,
        start its forward pass and the device's half of its sampling; nothing waits for them."""
        e = self.engine
        t0 = time.perf_counter()
        step, chunks = e.isolation.prepare(batch)
        hosted = self.sampled_on_host(chunks)
        launched = _Ahead(batch, chunks, hosted)
        if step is None:  # every request of it failed on its own
            return launched
        e.metrics.overlapped += ahead is not None
        feed = None
        if step.pending:  # (built on the host, copied without waiting: see StepInput.to)
            dev = e.device
            rows = torch.tensor([row for row, _ in step.pending]).to(dev, non_blocking=True)
            src = torch.tensor([ahead.rows[rid] for _, rid in step.pending])
            feed = (rows, ahead.sampled.index[src.to(dev, non_blocking=True)])
        launched.events = _StepEvents.start(e.device)
        logits = e.runner.run(step, feed)
        launched.sampled = start_sampling(logits, hosted)
        if launched.events is not None:
            launched.events.end()
        launched.ran_s = time.perf_counter() - t0  # on a CPU the forward ran here
        return launched

    def _finish(self, ahead: _Ahead) -> list[RequestOutput]:
        """The host's half of a launched batch: wait for its tokens, complete it."""
        events = ahead.events
        return self.complete(
            ahead.batch,
            ahead.chunks,
            ahead.sampled,
            lambda: ahead.ran_s if events is None else events.elapsed_s(),
        )


class PipelinedSteps(OneBatch):
    """Pipeline stages (spp > 1): up to spp batches in flight, this process running stage 0."""

    def __init__(self, engine) -> None:
        super().__init__(engine)
        self.inflight: collections.deque = collections.deque()  # pipelined batches

    def step(self) -> list[RequestOutput]:
        """Fill the pipeline (a new batch as soon as stage 1 is free, i.e. after this
        process ran its stage 0), then finish the oldest batch in flight."""
        e = self.engine
        while len(self.inflight) < e.config.spp:
            batch = e.scheduler.schedule(time.monotonic())
            if batch is None:
                break
            t0 = time.perf_counter()
            with e.isolation.discarding(batch):
                step, chunks = e.isolation.prepare(batch)
                if step is not None:
                    self.launch(step)
            self.inflight.append((batch, step, chunks, t0))
        if not self.inflight:
            return []
        batch, step, chunks, t0 = self.inflight.popleft()
        with e.isolation.discarding(batch):
            logits = e.isolation.no_logits() if step is None else self.collect(batch, step)
        return self.postprocess(batch, chunks, logits, t0)

    def launch(self, step) -> None:
        """Run stage 0 here and send the step into the pipeline."""
        e = self.engine
        e.pipeline.launch(step, lambda: e.runner.forward(step))

    def collect(self, batch, step) -> torch.Tensor:
        """The logits of the oldest batch in the pipeline, once its last stage is done."""
        e = self.engine
        return e.runner.logits(step, e.pipeline.result(batch.batch_id, step.ids.numel()))


@dataclass
class _StepEvents:
    """CUDA events around a launched batch's work on the device: its time there, which is
    what a step costs when the host's work overlaps it."""

    begin: torch.cuda.Event
    stop: torch.cuda.Event

    @classmethod
    def start(cls, device: torch.device) -> _StepEvents | None:
        if device.type != "cuda":
            return None
        events = cls(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
        events.begin.record()
        return events

    def end(self) -> None:
        self.stop.record()

    def elapsed_s(self) -> float:
        self.stop.synchronize()
        return self.begin.elapsed_time(self.stop) / 1e3


@dataclass
class _Ahead:
    """(async scheduling) A launched batch whose results have not reached the host."""

    batch: Batch
    chunks: list  # its sampling chunks, in the order of their logits rows
    on_host: list[bool]  # the rows sampled on the host (their tokens are not on the device)
    sampled: DeviceSample | None = None  # None: nothing ran (every request failed)
    events: _StepEvents | None = None  # on CUDA
    ran_s: float = 0.0  # the launch's time (where the forward ran in it: on a CPU)
    # request id -> its row of logits (the tokens the next batch's decodes read)
    rows: dict[str, int] = dataclasses.field(init=False)

    def __post_init__(self) -> None:
        self.rows = {c.request.request_id: i for i, c in enumerate(self.chunks)}
