"""Failure isolation around the engine's step: one request's error ends that request alone.

medha/engine/errors.py says which errors are a request's own. A request whose inputs cannot be
built, or whose sampling or text fails, ends with finish_reason "error" (`fail`) and its batch
runs without it. In one process a failing forward pass is run again in halves, down to the
request it fails with; with worker processes it is fatal (their collectives are out of step).
A batch that fails fatally is discarded, its requests ended and their blocks given back, before
the error goes up (`discarding`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time

import torch

from medha.engine.errors import RequestFailedError, is_fatal
from medha.engine.outputs import RequestOutput, RequestState, request_output

log = logging.getLogger("medha.engine")

# Forward passes in a row that failed with one request alone in them: past this, the error is not
# that request's (every forward fails) and the engine stops.
MAX_FORWARD_FAILURES = 3


class FailureIsolation:
    """Runs the engine's batches so that a request failing on its own ends alone; the outputs of
    the requests that failed wait in `failed` until the step hands them out (`take_failed`)."""

    def __init__(self, runner, workers, scheduler, states: dict[str, RequestState]) -> None:
        self.runner = runner
        self.workers = workers
        self.scheduler = scheduler
        self.states = states  # the engine's: a request is live while its state is there
        self.failed: list[RequestOutput] = []  # requests that failed since the last step
        self.forward_failures = 0  # single-request forward failures in a row

    def take_failed(self) -> list[RequestOutput]:
        failed, self.failed = self.failed, []
        return failed

    def fail(self, request_id: str, error: RequestFailedError) -> None:
        """End one request with an error; the others go on."""
        log.warning("%s", error)
        state = self.states.pop(request_id, None)
        request = self.scheduler.abort(request_id, time.monotonic(), reason="error")
        self.failed.append(request_output(request_id, request, state, error=error))

    @contextlib.contextmanager
    def discarding(self, batch):
        try:
            yield
        except BaseException:
            # the batch's requests cannot continue (their KV is in an unknown state): end them
            # and give their blocks back before the error goes up
            for r in self.scheduler.discard(batch, time.monotonic()):
                self.states.pop(r.request_id, None)
            raise

    def prepare(self, batch):
        """(StepInput, sampling chunks) of the batch's requests whose inputs can be built:
        a request whose inputs fail ends, and the step is built without it. (None, []) when
        no request is left."""
        while True:
            if not batch.num_seqs:
                return None, []
            try:
                return self.runner.prepare(batch)
            except RequestFailedError as e:
                self.fail(e.request_id, e)
                batch = _without(batch, e.request_id)

    def run(self, batch, pause=None) -> tuple[torch.Tensor, list]:
        """(logits, sampling chunks) of the batch, without the requests that fail on their
        own. `pause`: the runner's (a paused step), on the first try only: the
        halves of a failed batch run through."""
        step, chunks = self.prepare(batch)
        if step is None:
            return self.no_logits(), []
        try:
            if self.workers is not None:
                self.workers.broadcast(step)
            logits = self.runner.run(step, pause=pause)
        except Exception as e:
            if is_fatal(e) or self.workers is not None:
                raise
            return self._bisect(batch, e)
        self.forward_failures = 0
        return logits, chunks

    def _bisect(self, batch, error: Exception) -> tuple[torch.Tensor, list]:
        members = [
            c.request.request_id
            for c in (*batch.decodes, *batch.prefills)
            if c.request.request_id in self.states
        ]
        if len(members) == 1:
            self.forward_failures += 1
            if self.forward_failures > MAX_FORWARD_FAILURES:
                raise error  # every forward fails: not this request's doing
            self.fail(members[0], RequestFailedError(members[0], error))
            return self.no_logits(), []
        half = set(members[: len(members) // 2])
        parts = [
            self.run(_keeping(batch, half)),
            self.run(_keeping(batch, set(members) - half)),
        ]
        if all(m not in self.states for m in members):
            raise error  # it failed with each request alone: not any one request's doing
        return torch.cat([p[0] for p in parts]), parts[0][1] + parts[1][1]

    def no_logits(self) -> torch.Tensor:
        return torch.empty(0, self.runner.args.vocab_size, device=self.runner.device)


def _without(batch, request_id: str):
    """The batch without one request's chunk (what the runner reads: decodes, prefills)."""
    return _keeping(
        batch, {c.request.request_id for c in (*batch.decodes, *batch.prefills)} - {request_id}
    )


def _keeping(batch, request_ids: set[str]):
    return dataclasses.replace(
        batch,
        decodes=[c for c in batch.decodes if c.request.request_id in request_ids],
        prefills=[c for c in batch.prefills if c.request.request_id in request_ids],
    )
