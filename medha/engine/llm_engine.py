"""LLMEngine: the replica scheduler driving a real model.

    engine = LLMEngine(EngineConfig(model="smollm2"))
    engine.add_request("r1", "Hello", SamplingParams(max_tokens=16))
    while engine.has_unfinished():
        for out in engine.step():
            print(out.request_id, out.delta_text, out.finished)

Each `step` schedules one batch with the wall clock as `now`, runs it, samples, and reports the
measured time back to the scheduler (and to `engine.metrics`).

A request that fails on its own (medha/engine/errors.py says which errors those are) comes out
of `step` finished with finish_reason "error" and the message in `error`; the other requests
go on (medha/engine/isolation.py). `step` raises only errors that break the engine. What the
engine is built from (device, dtype, checkpoint, workers, predictor) is resolved once, in
medha/engine/setup.py.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import time
from dataclasses import dataclass

import torch

from medha.core.batch import Batch, BatchResult
from medha.core.config import parse_chunking
from medha.core.request import Request
from medha.engine.config import EngineConfig
from medha.engine.errors import (
    EngineError,
    InvalidRequestError,
    RequestFailedError,
    blame,
    is_fatal,
)
from medha.engine.host_kv import HostKVBlocks, move_kv
from medha.engine.isolation import FailureIsolation
from medha.engine.layers.sampler import (
    DeviceSample,
    finish_sampling,
    on_host,
    start_sampling,
)
from medha.engine.outputs import RequestOutput, RequestState, request_output
from medha.engine.pauses import Pauses, can_pause
from medha.engine.sampling_params import SamplingParams
from medha.engine.setup import EngineSetup, tune_process
from medha.engine.tokenizer import Tokenizer
from medha.perf.online_fit import CorrectedPredictor, StepLearner
from medha.perf.predictor import Predictor
from medha.scheduler.block_manager import BlockManager
from medha.scheduler.config import SchedulerConfig
from medha.scheduler.config_defaults import price_report
from medha.scheduler.packers import replica_policy
from medha.scheduler.replica_scheduler import ReplicaScheduler

log = logging.getLogger("medha.engine")

# fewer timed shapes than this (a machine too slow for --self-profile-s) fit no model worth
# planning with: the engine keeps the roofline, corrected online, and writes nothing
MIN_SELF_PROFILE_ROWS = 8
# the most the start-up probe spends (`_probe_start`): SmolLM2 in bf16 on a 2-core Xeon takes
# 2.8 s for all six shapes; a layout whose long shapes run far slower (KVP in float32 on torch's
# kernels: 69 s) skips them and learns them online
PROBE_BUDGET_S = 10.0


@dataclass(frozen=True)
class EngineStats:
    """The engine's queues and KV cache at one instant (LLMEngine.stats)."""

    waiting: int  # requests whose prefill has not started: new, or preempted by recompute
    prefilling: int  # requests whose prefill has started and not finished
    running: int  # requests decoding
    swapped: int  # requests whose KV is in the host pool
    kv_blocks_used: int
    kv_blocks_free: int
    preemptions: int  # recomputes and swap-outs since start
    # prefix cache, over every prefill started so far: prompt tokens looked up and served
    prefix_query_tokens: int = 0
    prefix_hit_tokens: int = 0
    prefix_host_hit_tokens: int = 0  # of the hits, copied back from the host tier


class LLMEngine:
    def __init__(
        self, config: EngineConfig | None = None, scheduler: SchedulerConfig | None = None
    ) -> None:
        config = config or EngineConfig()
        tune_process(config)
        self.setup = setup = EngineSetup.resolve(config)
        self.config = setup.config  # block_size filled in
        self.device, self.dtype, self.kernels = setup.device, setup.dtype, setup.kernels
        self.model_path, self.spec = setup.model_path, setup.spec
        self.tokenizer = Tokenizer(self.model_path)
        scheduler = setup.scheduler_config(scheduler or SchedulerConfig())
        one_process = setup.parallel.world_size == 1
        self.async_scheduling = resolve_async_scheduling(self.config, self.device, one_process)
        # (settled before any worker process starts: a refusal leaves nothing running)
        scheduler = self._pause_steps(scheduler, one_process)
        self.pauses = Pauses(self)
        self.workers = setup.start_workers()
        self.pipeline = self.workers and self.workers.pipeline  # None: no stages
        self._ahead: _Ahead | None = None  # (async scheduling) the batch the device runs
        self.runner = setup.model_runner(self.workers)
        # (on a CPU, where the tests run CUDA's decode path, the graphs' padded steps run eagerly)
        if self.runner.triton_decode and self.workers is None and self.config.cuda_graphs:
            self.runner.capture_decode_graphs(scheduler.max_num_seqs, scheduler.max_model_len)
        self._inflight: collections.deque = collections.deque()  # pipelined batches
        self._plan(scheduler, setup.predictor())
        if setup.self_profile_due():
            self._profile_self(scheduler)
        elif setup.start_probe_due() and self.scheduler.learner is not None:
            self._probe_start()
        log.info("planning with %s: %s", self.predictor.describe(),
                 price_report(self.scheduler.config, self.predictor))  # fmt: skip
        self.swap_blocks = HostKVBlocks.for_swap_pool(scheduler, self.runner)
        self.prefix_host_blocks = HostKVBlocks.for_prefix_host_tier(scheduler, self.runner)
        self._states: dict[str, RequestState] = {}
        self.isolation = FailureIsolation(self.runner, self.workers, self.scheduler, self._states)
        self.metrics = EngineMetrics()
        self.governor = setup.governor(self.workers)

    def _pause_steps(self, scheduler: SchedulerConfig, one_process: bool) -> SchedulerConfig:
        """`scheduler` with pause_steps settled: on where this engine can pause its steps and
        the policy lets it (medha/engine/pauses.py), unless given; refused where asked for and
        impossible."""
        able = can_pause(self.device.type, one_process, self.async_scheduling)
        if scheduler.pause_steps is None:
            # (static:N and none keep the baselines' steps, Sarathi's and Orca's, as they are)
            adaptive = parse_chunking(scheduler.chunking)[0] == "adaptive"
            able = able and adaptive and replica_policy(scheduler).pauses_steps
            return dataclasses.replace(scheduler, pause_steps=able)
        if scheduler.pause_steps and not able:
            raise EngineError(
                "pause_steps runs in one process on a CPU, one batch at a time (not with "
                "tp/spp/kvp > 1, async scheduling or a GPU)"
            )
        if scheduler.pause_steps and not replica_policy(scheduler).pauses_steps:
            raise EngineError(
                f"pause_steps: policy {scheduler.policy} holds prefills back or picks decodes "
                "itself; its batches cannot be paused for others"
            )
        return scheduler

    def _plan(self, scheduler: SchedulerConfig, predictor: Predictor) -> None:
        """The scheduler (over a fresh KV cache) planning with `predictor`, corrected online
        unless --calibrate off. A pipeline's batch times overlap other batches', so they time no
        one batch: the model is corrected only where each batch runs alone."""
        learner = None
        if self.config.calibrate == "online" and self.pipeline is None:
            predictor = CorrectedPredictor(predictor)
            learner = StepLearner(predictor)
        setup = self.setup
        blocks = BlockManager.for_layout(setup.num_blocks, self.config.block_size, setup.parallel)
        self.predictor = predictor
        self.scheduler = ReplicaScheduler(
            scheduler, predictor, blocks, learner=learner, async_scheduling=self.async_scheduling
        )

    def _profile_self(self, scheduler: SchedulerConfig) -> None:
        """Time a grid of batch shapes for about --self-profile-s seconds (the quick grid up to
        this engine's context and max_num_seqs, corners first: medha/perf/grid.py), write it
        where `medha profile` writes, and plan with it (issue 48: no manual step before the
        scheduler knows its engine)."""
        from medha.engine.profiler import Profiler
        from medha.perf.grid import corners_first, grid

        seconds, path = self.config.self_profile_s, self.profile_path
        shapes = grid(
            self.max_model_len,
            self.kv_capacity_tokens,
            mixed=8,
            seed=0,
            quick=True,
            max_num_seqs=self.scheduler.config.max_num_seqs,
        )
        log.warning(
            "no profile of this engine at %s: timing up to %d batch shapes for about %.0f s "
            "before serving, then planning with them (once; --self-profile-s 0 skips this, "
            "`medha profile` times a full grid)",
            path, len(shapes), seconds,
        )  # fmt: skip
        start = time.perf_counter()
        try:
            profile = Profiler(self).run(
                corners_first(shapes), budget_s=seconds, predictor=self.predictor, repeats=1
            )
        except Exception as e:  # no start-up measurement ends a start (issue 68)
            if is_fatal(e):
                raise
            log.warning(
                "the start-up profile failed after %.0f s (%s: %s); planning with %s, corrected "
                "online", time.perf_counter() - start, type(e).__name__, e,
                self.predictor.describe(),
            )  # fmt: skip
            self._plan(scheduler, self.setup.predictor())  # a fresh cache, as it started
            return
        profile.sources = ["medha serve's start-up profile"]
        if len(profile.iteration_rows) < MIN_SELF_PROFILE_ROWS:
            log.warning(
                "the start-up profile timed %d shapes in %.0f s, too few to fit; planning with "
                "%s, corrected online", len(profile.iteration_rows),
                time.perf_counter() - start, self.predictor.describe(),
            )  # fmt: skip
            return
        profile.save(path)
        log.warning(
            "timed %d batch shapes in %.0f s; wrote %s",
            len(profile.iteration_rows), time.perf_counter() - start, path,
        )  # fmt: skip
        self._plan(scheduler, self.setup.predictor())

    def _probe_start(self) -> None:
        """Time the online correction's probe shapes once each before serving (a lone
        decode, a decode batch, chunks short and long, alone, after a KV prefix and beside
        decodes: a few seconds) and correct the model with them, so that the defaults resolved
        before the first request (the TPOT target and budget, the arrival wait) follow this
        machine's speed, not a roofline 2-6x off a CPU's; every batch then corrects it
        further. At most PROBE_BUDGET_S: a shape the model, as corrected so far, says would
        not fit what is left is skipped, as is one the KV cache cannot hold; a failure leaves
        the roofline, corrected online: no start-up measurement ends a start."""
        from medha.engine.profiler import Profiler, ShapeDoesNotFit
        from medha.perf.grid import Shape

        start, profiler, cold = time.perf_counter(), Profiler(self), True

        def measure(prefills, decodes) -> float | None:
            nonlocal cold
            left = PROBE_BUDGET_S - (time.perf_counter() - start)
            # (the first shape is a lone decode, which the roofline never prices at seconds)
            if not cold and self.predictor.shape_time(prefills, decodes) > left:
                return None
            try:
                # one run each, the first shape's after a warm-up: the kernels are warm after
                # it, and a shape's first run then takes within 10% of its next (1.7 s of a
                # 2.8 s probe is its largest shape, 2048 tokens after 6144)
                shape = Shape(tuple(prefills), tuple(decodes))
                seconds = profiler.measure(shape, repeats=1, warm_up=cold)
            except ShapeDoesNotFit:
                return None
            cold = False
            return seconds

        try:
            timed, skipped = self.scheduler.probe(measure)
        except Exception as e:
            if is_fatal(e):
                raise
            log.warning("the start-up probe failed (%s: %s); planning with %s, corrected "
                        "online", type(e).__name__, e, self.predictor.describe())  # fmt: skip
            return
        log.warning(
            "no profile of this engine at %s: planning from the roofline, corrected by %d "
            "probe shapes timed in %.1f s (%d skipped) and online (--no-start-probe skips them; "
            "`medha profile` times a full grid)",
            self.profile_path, timed, time.perf_counter() - start, skipped,
        )  # fmt: skip

    def close(self) -> None:
        """Stop the worker processes, if any (also done at interpreter exit)."""
        if self.workers is not None:
            self.workers.close()

    @property
    def profile_path(self) -> str:
        """Where `medha profile` writes this engine's profile and `predictor: auto` reads it."""
        return self.setup.profile_path

    # ---- requests ----------------------------------------------------------------------------
    def add_request(
        self,
        request_id: str,
        prompt: str | list[int] | None,
        params: SamplingParams | None = None,
        *,
        prompt_token_ids: list[int] | None = None,
        arrival_s: float | None = None,
        ttft_deadline_s: float | None = None,
        tpot_target_s: float | None = None,
        priority_class: str | None = None,
    ) -> None:
        """Admit a request, all or nothing: a refused one (ValueError; InvalidRequestError
        names the field) leaves the engine as it was."""
        params = params if params is not None else SamplingParams()
        if not isinstance(params, SamplingParams):
            raise InvalidRequestError(f"params must be SamplingParams, got {type(params)}")
        if prompt_token_ids is None:
            if isinstance(prompt, str):
                prompt_token_ids = self.encode_prompt(prompt)
            elif prompt is not None:
                prompt_token_ids = list(prompt)
        check_prompt(prompt_token_ids, self.max_model_len, self.runner.args.vocab_size)
        request = Request.from_tokens(
            request_id,
            time.monotonic() if arrival_s is None else arrival_s,
            prompt_token_ids,
            params.max_tokens,
            ttft_deadline_s=ttft_deadline_s,
            tpot_target_s=tpot_target_s,
            priority_class=priority_class,
        )
        state = RequestState.new(params, self.tokenizer)
        self.scheduler.add_request(request, request.arrival_s)  # validates; raises ValueError
        self._states[request_id] = state  # nothing after the scheduler took it may fail

    def encode_prompt(self, text: str, param: str = "prompt") -> list[int]:
        """Token ids of a text prompt; one that cannot fit the context is refused without
        tokenizing all of it (InvalidRequestError)."""
        return self.tokenizer.encode(text, param, limit=self.max_model_len)

    def encode_chat(self, messages: list[dict]) -> list[int]:
        """Token ids of a chat through the model's template; refused (InvalidRequestError)
        without templating when its contents alone cannot fit the context."""
        return self.tokenizer.apply_chat_template(messages, limit=self.max_model_len)

    def abort(self, request_id: str) -> bool:
        self._states.pop(request_id, None)
        return self.scheduler.abort(request_id, time.monotonic()) is not None

    def has_unfinished(self) -> bool:
        """Whether a request is live, or a batch still runs (async scheduling)."""
        return self.scheduler.has_unfinished() or self._ahead is not None

    # ---- read-only facts and counters (the server and CLI read these, not the scheduler) ----
    @property
    def max_model_len(self) -> int:
        """The longest context (prompt + output) a request may have."""
        return self.scheduler.max_model_len

    @property
    def kv_capacity_tokens(self) -> int:
        """The most KV tokens one request can hold (with KVP: across its groups)."""
        return self.scheduler.blocks.capacity_tokens

    @property
    def num_kv_blocks(self) -> int:
        return self.scheduler.blocks.num_blocks

    @property
    def policy(self) -> str:
        """The scheduling policy in use (the packer's default when none was asked for)."""
        return self.scheduler.config.policy or self.scheduler.packer.default_policy

    @property
    def chunking(self) -> str:
        return self.scheduler.config.chunking

    def stats(self) -> EngineStats:
        """A snapshot of plain counters: safe to take from any thread (a metrics scrape),
        though one taken while a step runs may mix before and after."""
        s, blocks = self.scheduler, self.scheduler.blocks
        waiting, prefilling = s.prefill_counts()
        return EngineStats(
            waiting=waiting,
            prefilling=prefilling,
            running=s.num_decoding,
            swapped=s.num_swapped,
            kv_blocks_used=blocks.num_used,
            kv_blocks_free=blocks.num_free,
            preemptions=s.stats.preemptions,
            prefix_query_tokens=s.stats.prefix_query_tokens,
            prefix_hit_tokens=s.stats.prefix_hit_tokens,
            prefix_host_hit_tokens=s.stats.prefix_host_hit_tokens,
        )

    # ---- one iteration -----------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one batch; the outputs of its requests, and of any that failed on their own.
        Under async scheduling: launch one batch and return the outputs of the one before."""
        if self.governor is not None:
            self.governor.tick()
        if self.pipeline is not None:
            outputs = self._pipelined_step()
        elif self.async_scheduling:
            outputs = self._async_step()
        else:
            batch = self.scheduler.schedule(time.monotonic())
            outputs = [] if batch is None else self._run_now(batch)
        return self.isolation.take_failed() + self.pauses.take() + outputs

    def _run_now(self, batch: Batch) -> list[RequestOutput]:
        """Run `batch` to its end: its KV copies, its forward pass, its sampling. A pausable
        batch runs others between its layers (medha/engine/pauses.py); its time leaves
        theirs out."""
        t0, paused = time.perf_counter(), self.pauses.paused_s
        with self.isolation.discarding(batch):
            move_kv(batch, self.swap_blocks, self.prefix_host_blocks)
            if not batch.num_seqs:  # the batch only moved KV
                self.scheduler.update(
                    batch, BatchResult(time.perf_counter() - t0), time.monotonic()
                )
                return []
            logits, chunks = self.isolation.run(
                batch, self.pauses.point if batch.pausable else None
            )
        return self._postprocess(batch, chunks, logits, t0 + self.pauses.paused_s - paused)

    def _async_step(self) -> list[RequestOutput]:
        """Form and launch the next batch, then finish the one before it while the device runs
        this one: the host's scheduling, sampling and bookkeeping overlap the model. The new
        batch's decodes read their input tokens from the last batch's output on the device
        (placeholders in the scheduler's count). A batch that needs the last one's results on
        the host first (KV copies, a token sampled on the host, a failed forward pass) runs
        after it, to its end."""
        ahead, self._ahead = self._ahead, None
        batch = self.scheduler.schedule(time.monotonic())
        outputs: list[RequestOutput] = []
        if ahead is not None and (batch is None or not self._overlaps(batch, ahead)):
            outputs, ahead = self._finish(ahead), None
        if batch is None:
            return outputs
        launched = None
        if not (batch.swap_in or batch.swap_out or batch.cache_in or batch.cache_out):
            with self.isolation.discarding(batch):
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
            outputs += self._run_now(batch)
        self._ahead = launched
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
        t0 = time.perf_counter()
        step, chunks = self.isolation.prepare(batch)
        hosted = self._sampled_on_host(chunks)
        launched = _Ahead(batch, chunks, hosted)
        if step is None:  # every request of it failed on its own
            return launched
        self.metrics.overlapped += ahead is not None
        feed = None
        if step.pending:  # (built on the host, copied without waiting: see StepInput.to)
            dev = self.device
            rows = torch.tensor([row for row, _ in step.pending]).to(dev, non_blocking=True)
            src = torch.tensor([ahead.rows[rid] for _, rid in step.pending])
            feed = (rows, ahead.sampled.index[src.to(dev, non_blocking=True)])
        launched.events = _StepEvents.start(self.device)
        logits = self.runner.run(step, feed)
        launched.sampled = start_sampling(logits, hosted)
        if launched.events is not None:
            launched.events.end()
        launched.ran_s = time.perf_counter() - t0  # on a CPU the forward ran here
        return launched

    def _finish(self, ahead: _Ahead) -> list[RequestOutput]:
        """The host's half of a launched batch: wait for its tokens, complete it."""
        events = ahead.events
        return self._complete(
            ahead.batch,
            ahead.chunks,
            ahead.sampled,
            lambda: ahead.ran_s if events is None else events.elapsed_s(),
        )

    def _pipelined_step(self) -> list[RequestOutput]:
        """Fill the pipeline (a new batch as soon as stage 1 is free, i.e. after this
        process ran its stage 0), then finish the oldest batch in flight."""
        while len(self._inflight) < self.config.spp:
            batch = self.scheduler.schedule(time.monotonic())
            if batch is None:
                break
            t0 = time.perf_counter()
            with self.isolation.discarding(batch):
                step, chunks = self.isolation.prepare(batch)
                if step is not None:
                    self._launch(step)
            self._inflight.append((batch, step, chunks, t0))
        if not self._inflight:
            return []
        batch, step, chunks, t0 = self._inflight.popleft()
        with self.isolation.discarding(batch):
            logits = self.isolation.no_logits() if step is None else self._collect(batch, step)
        return self._postprocess(batch, chunks, logits, t0)

    def _postprocess(self, batch, chunks, logits: torch.Tensor, t0: float) -> list[RequestOutput]:
        """Sample the batch's next tokens, hand its result to the scheduler, report them."""
        with self.isolation.discarding(batch):
            started = start_sampling(logits, self._sampled_on_host(chunks))
        return self._complete(batch, chunks, started, lambda: time.perf_counter() - t0)

    def _sampled_on_host(self, chunks) -> list[bool]:
        """Which sampling rows need their whole logits on the host (a request that ended
        meanwhile needs nothing)."""
        states = (self._states.get(c.request.request_id) for c in chunks)
        return [s is not None and on_host(s.params) for s in states]

    def _complete(
        self, batch: Batch, chunks, started: DeviceSample | None, duration
    ) -> list[RequestOutput]:
        """The host's half of sampling the batch's rows, then its result to the scheduler and
        the outputs. `duration()`: the batch's time, read once its tokens are on the host."""
        # requests aborted or failed while the batch ran (or before it launched) are left out
        keep = [i for i, c in enumerate(chunks) if c.request.request_id in self._states]
        chunks = [chunks[i] for i in keep]
        with self.isolation.discarding(batch):
            rids = [c.request.request_id for c in chunks]
            states = [self._states[rid] for rid in rids]
            samples = []
            if started is not None:
                params, gens = [s.params for s in states], [s.generator for s in states]
                samples = finish_sampling(started, keep, params, gens, rids)
        duration = duration()
        added = self._add_tokens(chunks, states, samples)
        self.metrics.record(batch, duration)
        tokens = {c.request.request_id: smp.token for c, _, smp, _, _ in added}
        stopped = frozenset(c.request.request_id for c, _, _, _, stop in added if stop)
        finished = self.scheduler.update(
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
                self.isolation.fail(rid, e)
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
                del self._states[r.request_id]
        return outputs

    def _launch(self, step) -> None:
        """Run stage 0 here and send the step into the pipeline."""
        self.pipeline.launch(step, lambda: self.runner.forward(step))

    def _collect(self, batch, step) -> torch.Tensor:
        """The logits of the oldest batch in the pipeline, once its last stage is done."""
        return self.runner.logits(step, self.pipeline.result(batch.batch_id, step.ids.numel()))

    def execute(self, batch, all_logits: bool = False) -> tuple[torch.Tensor, list]:
        """Run one batch through every rank and stage now (no overlap with other batches):
        (logits, sampling chunks) as ModelRunner.execute. The profiler and tests use it."""
        if self.pipeline is None:
            return self.runner.execute(batch, all_logits)
        step, chunks = self.runner.prepare(batch, all_logits)
        self._launch(step)
        return self._collect(batch, step), chunks


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


def resolve_async_scheduling(config: EngineConfig, device: torch.device, one_process: bool) -> bool:
    """--async-scheduling as given, else on where the model runs asynchronously to the host
    (CUDA) in one process. Refused with worker processes (their steps go in lockstep)."""
    if config.async_scheduling is None:
        return device.type == "cuda" and one_process
    if config.async_scheduling and not one_process:
        raise EngineError("async_scheduling runs in one process, not with tp/spp/kvp > 1")
    return config.async_scheduling


def check_prompt(ids: list[int] | None, max_model_len: int, vocab_size: int) -> None:
    """Refuse (InvalidRequestError naming `prompt`) an empty prompt, one longer than the
    context, and ids outside the vocabulary."""
    if not ids:
        raise InvalidRequestError("prompt must not be empty", "prompt")
    if len(ids) > max_model_len:  # before looking at each id
        raise InvalidRequestError(
            f"prompt is {len(ids)} tokens long; the model's context is {max_model_len} tokens",
            "prompt",
        )
    if (
        not all(isinstance(t, int) and not isinstance(t, bool) for t in ids)
        or min(ids) < 0
        or max(ids) >= vocab_size
    ):
        raise InvalidRequestError(
            f"prompt token ids must be integers in [0, {vocab_size})", "prompt"
        )


class EngineMetrics:
    """Measured iteration times beside the predictor's, for profiles and dashboards."""

    def __init__(self) -> None:
        self.iterations = 0
        self.overlapped = 0  # (async scheduling) batches launched while the one before ran
        self.samples: list[tuple[tuple, tuple, float, float]] = []  # prefills, decodes, meas, pred
        self.keep_samples = False

    def record(self, batch, duration: float) -> None:
        self.iterations += 1
        if self.keep_samples:
            self.samples.append((*batch.shape(), duration, batch.predicted_time_s))
