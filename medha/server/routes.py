"""The plain routes: GET /health, /metrics, /v1/models and /medha/predictor.

Routes here and in completions.py and chat.py carry no return annotation: FastAPI would take
it as a response model, filter the bodies through it and change the OpenAPI document."""

from __future__ import annotations

from fastapi import APIRouter, Depends
from fastapi.responses import Response

from medha.server.errors import RequestError, SafeJSONResponse
from medha.server.state import ServerStateDep, authorize

router = APIRouter()


@router.get("/health")
async def health(state: ServerStateDep):
    if state.async_engine.dead:
        return SafeJSONResponse(
            {"status": "error", "reason": state.async_engine.dead}, status_code=503
        )
    return {"status": "ok"}


@router.get("/metrics")
async def prometheus(state: ServerStateDep):
    return Response(state.metrics.render(), media_type="text/plain; version=0.0.4")


@router.get("/v1/models", dependencies=[Depends(authorize)])
async def models(state: ServerStateDep):
    return {
        "object": "list",
        "data": [
            {
                "id": state.model_name,
                "object": "model",
                "created": state.created,
                "owned_by": "medha",
                "max_model_len": state.engine.max_model_len,
            }
        ],
    }


@router.get("/medha/predictor", dependencies=[Depends(authorize)])
async def predictor(state: ServerStateDep):
    """The batch-time model this replica plans with, as data (medha/perf/published.py): its
    base, the online correction fitted so far and the scheduler config as it now stands.
    `medha route` prices this replica's work with the base (docs/route.md says why not the
    correction) under that config; 404 where the engine has no model to describe."""
    from medha.perf.published import describe
    from medha.scheduler.config import SchedulerConfig

    model = getattr(state.engine, "predictor", None)
    scheduler = getattr(getattr(state.engine, "scheduler", None), "config", None)
    if not isinstance(scheduler, SchedulerConfig):
        scheduler = None
    description = describe(model, scheduler) if model is not None else None
    if description is None:
        raise RequestError(
            "this replica's engine publishes no batch-time model", None, 404, "not_found_error"
        )
    return description
