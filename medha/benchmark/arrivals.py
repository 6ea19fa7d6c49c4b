"""Requests handed to an engine at set times from now, run to their end: what the benches that
time a convoy share."""

from __future__ import annotations

import time


def drive(engine, arrivals) -> dict:
    """arrivals: [(at_s, request id, prompt ids, SamplingParams)], `at_s` from now. Steps the
    engine (an LLMEngine) until every request has finished and the engine is idle; returns
    {request id: its metrics} (RequestOutput.metrics of its last output)."""
    start = time.monotonic()
    pending = sorted(arrivals, key=lambda a: a[0])
    done = {}

    def admit() -> None:
        now = time.monotonic()
        while pending and now - start >= pending[0][0]:
            at, rid, prompt, params = pending.pop(0)
            # it arrived at start + at, maybe while a forward pass ran: that wait counts
            engine.add_request(rid, prompt, params, arrival_s=start + at)

    def collect(outputs) -> None:
        for out in outputs:
            if out.finished:
                done[out.request_id] = out.metrics

    # a step paused between its layers admits what arrived meanwhile, as a server does
    # (medha/engine/pauses.py)
    engine.pauses.arrivals, engine.pauses.deliver = admit, collect
    try:
        while engine.has_unfinished() or pending:
            admit()
            collect(engine.step())
            if not engine.has_unfinished() and pending:
                time.sleep(max(0.0, pending[0][0] - (time.monotonic() - start)))
    finally:
        engine.pauses.arrivals = engine.pauses.deliver = None
    return done
