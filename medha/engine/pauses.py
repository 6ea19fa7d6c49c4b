"""Paused steps: a step of long prefills alone pauses between the parts of its layers for
whoever waits, and resumes (SchedulerConfig.pause_steps; docs/design.md, "Paused steps").

A step is never cut short: a request that arrives during it waits for it to end, so a long
prefill's steps had to stay short (the arrival wait) and paid for it in fixed costs. A step the
scheduler marks pausable (long prefills alone: nobody waits on its end) instead calls
`Pauses.point` after each layer's attention and after each layer. There the server's new
requests are admitted (`arrivals`), and while `ReplicaScheduler.schedule_beside` has a batch
(short prefills that wait, decodes whose next token is due) it runs to its end first, its
outputs handed out at once (`deliver`) or with the step's. The paused step's state is the
locals of its forward pass; the KV it wrote so far sits in its own requests' blocks, which the
batches beside it do not touch (none of its requests is in them). Its measured time leaves
theirs out.

Only in one process, on a CPU, one batch at a time (not async scheduling, not a pipeline or
worker processes, whose steps go in lockstep across ranks): `can_pause`.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from medha.engine.errors import is_fatal

if TYPE_CHECKING:
    from medha.engine.outputs import RequestOutput


class Pauses:
    def __init__(self, engine) -> None:
        """`engine`: the LLMEngine whose steps pause (not imported here: it imports this)."""
        self.engine = engine
        # the server's: admit the requests that arrived since the step began
        self.arrivals: Callable[[], None] | None = None
        # the server's: hand the outputs of a batch run beside a paused step out now (else
        # they wait in `outputs` for the step's end)
        self.deliver: Callable[[list[RequestOutput]], None] | None = None
        self.outputs: list[RequestOutput] = []
        self.paused_s = 0.0  # time spent in batches run beside paused steps, ever
        self.count = 0  # batches run beside paused steps, ever
        self.error: Exception | None = None  # raised at a pause point, for the step's end
        self._inside = False

    def point(self) -> None:
        """Between two layers of a pausable step: run what waits, then return to it."""
        if self._inside or self.error is not None:
            return
        engine = self.engine
        self._inside = True
        try:
            while True:
                if self.arrivals is not None:
                    self.arrivals()
                batch = engine.scheduler.schedule_beside(time.monotonic())
                if batch is None:
                    return
                t0 = time.perf_counter()
                outputs = engine.isolation.take_failed() + engine.step_mode.run_now(batch)
                self.paused_s += time.perf_counter() - t0
                self.count += 1
                if self.deliver is not None:
                    self.deliver(outputs)
                else:
                    self.outputs += outputs
        except Exception as e:
            # not the paused step's failure: it must not be taken for one (its requests would
            # be failed, or bisected); fatal errors stop the engine here as anywhere
            if is_fatal(e):
                raise
            self.error = e
        finally:
            self._inside = False

    def take(self) -> list[RequestOutput]:
        """The outputs of batches run beside paused steps, not handed out yet; an error raised
        at a pause point (by the server's hooks), once the paused step has ended."""
        error, self.error = self.error, None
        if error is not None:
            raise error
        outputs, self.outputs = self.outputs, []
        return outputs


def can_pause(device_type: str, one_process: bool, async_scheduling: bool) -> bool:
    """Whether an engine can pause its steps between layers: in one process (no worker ranks
    or stages), one batch at a time, on a CPU (on a GPU the host queues the layers ahead of the
    device, so a pause there is not measured yet)."""
    return device_type == "cpu" and one_process and not async_scheduling
