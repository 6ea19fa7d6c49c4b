"""The engine loop beside the HTTP event loop, with an asyncio face for the handlers.

Only the engine's thread touches the scheduler and the model: handlers send it commands (add,
abort) through a queue and get outputs back on a per-request asyncio queue, so a long forward
pass never blocks the event loop and the event loop never races the scheduler.

`medha serve` runs this loop on the main thread, the one that loaded the model, and uvicorn on
another. torch's OpenMP pool serves the first thread that used it well; small parallel ops
from any other thread cost several times more, enough to slow a lone request down measurably
(docs/server.md).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from medha.engine.errors import EngineDeadError, RequestFailedError, is_fatal
from medha.engine.llm_engine import LLMEngine
from medha.engine.sampling_params import SamplingParams
from medha.scheduler.config_defaults import PAUSE_WAIT_SHARE, chat_time_s
from medha.server.arrivals import Arrivals
from medha.server.metrics import ServerMetrics

log = logging.getLogger("medha.server")


class QueueFullError(RuntimeError):
    """The bounded waiting queue is full; new requests get 429."""


@dataclass
class _Stream:
    queue: asyncio.Queue
    loop: asyncio.AbstractEventLoop
    first_token: bool = False

    def put(self, item) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, item)


@dataclass
class _Add:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    slo: dict
    stream: _Stream
    admitted: concurrent.futures.Future


class AsyncEngine:
    def __init__(self, engine: LLMEngine, metrics: ServerMetrics, max_waiting: int) -> None:
        self.engine = engine
        self.metrics = metrics
        self.max_waiting = max_waiting
        self.dead: str | None = None  # why the loop stopped, once it has
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._stopped = threading.Event()
        self._streams: dict[str, _Stream] = {}  # engine thread only
        # submitted and without a first token yet: counted when a handler submits (so a burst
        # cannot slip past the bound before the engine thread sees it), uncounted by the engine
        self._waiting = 0
        self._waiting_lock = threading.Lock()
        # a step paused between layers admits the requests that arrived meanwhile and runs
        # whoever waits first, their tokens streamed at once (medha/engine/pauses.py)
        engine.pauses.arrivals = self._apply_commands
        engine.pauses.deliver = self._dispatch
        # the requests the HTTP server is still receiving (counted by its CountArrivals): an
        # idle engine's first step waits for them, a bounded time (`_gather`)
        self.arrivals = Arrivals(on_end=self._wake.set)

    # ---- event-loop side ---------------------------------------------------------------------
    def start(self) -> None:
        """Run the engine loop on a thread of its own (tests, embedding in another app)."""
        threading.Thread(target=self.run, name="medha-engine", daemon=True).start()

    async def add(
        self, request_id: str, prompt_ids: list[int], params: SamplingParams, **slo
    ) -> asyncio.Queue:
        """Admit one request; its RequestOutputs (then None, or an exception: the request's
        RequestFailedError, or EngineDeadError) arrive on the returned queue. Raises what
        admission raised (ValueError for a request the engine refuses), the engine unchanged."""
        if self.dead:
            raise EngineDeadError(self.dead)
        with self._waiting_lock:
            if self._waiting >= self.max_waiting:
                raise QueueFullError(f"{self._waiting} requests are waiting (--max-waiting)")
            self._waiting += 1
        loop = asyncio.get_running_loop()
        stream = _Stream(asyncio.Queue(), loop)
        admitted: concurrent.futures.Future = concurrent.futures.Future()
        # arrival is now, not when the engine thread gets to it after its running iteration:
        # deadlines and TTFT count from here
        slo = slo | {"arrival_s": time.monotonic()}
        self._send(_Add(request_id, prompt_ids, params, slo, stream, admitted))
        await asyncio.wrap_future(admitted)
        return stream.queue

    def abort(self, request_id: str) -> None:
        self._send(("abort", request_id))

    def stop(self, timeout: float = 10.0) -> None:
        self._stop.set()
        self._wake.set()
        self._stopped.wait(timeout)

    def _send(self, command) -> None:
        self._commands.put(command)
        self._wake.set()

    # ---- engine thread -----------------------------------------------------------------------
    def run(self, while_: Callable[[], bool] = lambda: True) -> None:
        """The engine loop, on the calling thread, until stop() or `while_()` turns false."""
        try:
            while not self._stop.is_set() and while_():
                idle = not self.engine.has_unfinished()
                self._apply_commands()
                if not self.engine.has_unfinished():
                    self._wake.wait(0.1)
                    self._wake.clear()
                    continue
                if idle:
                    self._gather()
                self._step()
            self._fail_all("server shutting down", dead=False)
        except Exception as e:  # only fatal errors leave engine.step: fail loudly, never hang
            log.exception("engine loop failed")
            self._fail_all(f"engine failed: {type(e).__name__}: {e}")
        self._stopped.set()

    def _gather(self) -> None:
        """Before the first step after an idle spell: admit the requests of the same burst that
        the HTTP server is still receiving (medha/server/arrivals.py), so that they start in
        one step instead of waiting out a step of the first one. Bounded by a third of a chat's
        time alone as the engine's model prices it (PAUSE_WAIT_SHARE: what a paused step lets
        an arrival wait); a request alone ends the wait as soon as it is submitted."""
        if not self.arrivals.pending:
            return
        bound = PAUSE_WAIT_SHARE * chat_time_s(self.engine.predictor, self.engine.max_model_len)
        deadline = time.monotonic() + bound
        while (
            self.arrivals.pending
            and not self._stop.is_set()
            and (left := deadline - time.monotonic()) > 0
        ):
            self._wake.wait(left)
            self._wake.clear()
            self._apply_commands()

    def _pending_commands(self):
        while True:
            try:
                yield self._commands.get_nowait()
            except queue.Empty:
                return

    def _apply_commands(self) -> None:
        for cmd in self._pending_commands():
            if isinstance(cmd, _Add):
                self._admit(cmd)
            elif self.engine.abort(cmd[1]):
                stream = self._streams.pop(cmd[1], None)
                if stream and not stream.first_token:
                    self._left_waiting()
                self.metrics.requests.labels("aborted").inc()

    def _admit(self, cmd: _Add) -> None:
        try:
            self.engine.add_request(
                cmd.request_id, None, cmd.params, prompt_token_ids=cmd.prompt_ids, **cmd.slo
            )
        except Exception as e:  # admission is all or nothing: the request's error alone
            if is_fatal(e):
                raise
            self._left_waiting()
            cmd.admitted.set_exception(e)
            return
        self._streams[cmd.request_id] = cmd.stream
        cmd.admitted.set_result(None)

    def _left_waiting(self) -> None:
        with self._waiting_lock:
            self._waiting -= 1

    def _step(self) -> None:
        ran = self.engine.metrics.iterations
        t0 = time.perf_counter()
        outputs = self.engine.step()  # empty after a batch of prefill chunks only
        if self.engine.metrics.iterations == ran:
            time.sleep(0.001)  # nothing runnable this instant (e.g. memory held by a batch)
            return
        self.metrics.iteration.observe(time.perf_counter() - t0)
        self._dispatch(outputs)

    def _dispatch(self, outputs) -> None:
        """Each output to its request's stream (a paused step hands out the outputs of the
        batches it paused for here at once: medha/engine/pauses.py)."""
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is None:
                continue
            if not stream.first_token:
                stream.first_token = True
                self._left_waiting()
            if out.finish_reason == "error":  # this request failed on its own
                del self._streams[out.request_id]
                stream.put(RequestFailedError(out.request_id, out.error or "unknown error"))
                self.metrics.requests.labels("failed").inc()
                continue
            stream.put(out)
            if out.finished:
                del self._streams[out.request_id]
                stream.put(None)
                self.metrics.finished(out)

    def _fail_all(self, reason: str, dead: bool = True) -> None:
        if dead:
            self.dead = reason
        for rid, stream in list(self._streams.items()):
            self.engine.abort(rid)
            stream.put(EngineDeadError(reason))
            self.metrics.requests.labels("failed" if dead else "aborted").inc()
        self._streams.clear()
        with self._waiting_lock:
            self._waiting = 0
        # commands that arrived after the loop ended: refuse them instead of leaving them hanging
        for cmd in self._pending_commands():
            if isinstance(cmd, _Add):
                cmd.admitted.set_exception(EngineDeadError(reason))


def is_final(item) -> bool:
    return item is None or isinstance(item, BaseException)
