"""The admin API: the members at run time, behind the router's API key (a router without one
has no admin endpoints: anyone could point it anywhere). GET /replicas lists them, POST
/replicas {"url": ..., "api_key": optional} adds one, DELETE /replicas/ID drains and removes one
(202; the listing says `draining` until it is gone). `ROUTES` maps (method, path) to each
handler; the ID of a replica is the path's tail."""

from __future__ import annotations

import json

from medha.route.backend import Backend
from medha.route.http_helpers import read_body, send_error, send_json, unauthorized
from medha.route.parts import RouterLike
from medha.route.replicas import ReplicaSet
from medha.server.errors import RequestError


def describe(replicas: ReplicaSet, b: Backend) -> dict:
    """A replica as GET /replicas lists it."""
    t = replicas.tracked[b.replica_id]
    return {
        "id": b.replica_id,
        "url": b.url,
        "up": b.up,
        "draining": b.draining and not b.removed,
        "removed": b.removed,
        "requests": replicas.requests(b),
        # what the router prices its work with: its own model once read, else the router's
        "predictor": t.describe(),
        "predictor_from_replica": b.predictor_base is not None,
        # its speed as measured against that model, and its HTTP hop (tracked.py)
        "slowdown": round(t.slowdown, 4),
        "round_trip_ms": round(1e3 * t.round_trip_s, 3),
        # the scheduler config its model applies: the one it published, else the defaults
        "scheduler_from_replica": b.scheduler_published is not None,
    }


async def list_replicas(router: RouterLike, receive, send, tail: str) -> None:
    replicas = router.replicas
    await send_json(send, 200, {"replicas": [describe(replicas, b) for b in replicas.members()]})


async def add_replica(router: RouterLike, receive, send, tail: str) -> None:
    try:
        payload = json.loads(await read_body(receive))
    except (ValueError, RecursionError):
        payload = None
    url = payload.get("url") if isinstance(payload, dict) else None
    key = payload.get("api_key") if isinstance(payload, dict) else None
    if (
        not isinstance(url, str)
        or len(url) > 2048
        or not url.startswith(("http://", "https://"))
        or not (key is None or isinstance(key, str))
    ):
        return await send_error(
            send,
            RequestError('expected {"url": "http://HOST:PORT", "api_key": optional string}', "url"),
        )
    try:
        b = await router.replicas.add(url, key)
    except ValueError as e:
        return await send_error(send, RequestError(str(e), "url", 409, "conflict_error"))
    await send_json(send, 201, describe(router.replicas, b))


async def remove_replica(router: RouterLike, receive, send, tail: str) -> None:
    try:
        b = router.replicas.remove(int(tail) if tail.isdigit() and len(tail) < 10 else -1)
    except KeyError:
        return await send_error(
            send, RequestError(f"no replica {tail!r}", None, 404, "not_found_error")
        )
    await send_json(send, 202, describe(router.replicas, b))


ROUTES = {
    ("GET", "/replicas"): list_replicas,
    ("POST", "/replicas"): add_replica,
    ("DELETE", "/replicas/{id}"): remove_replica,
}


async def admin(router: RouterLike, scope, receive, send) -> None:
    """A request to /replicas or /replicas/..., answered by its handler in `ROUTES`."""
    if not router.has_api_key:
        return await send_error(
            send,
            RequestError(
                "replicas are managed at run time only behind a key (medha route --api-key)",
                None,
                403,
                "permission_error",
            ),
        )
    if not router.authorized(scope):
        return await send_error(send, unauthorized())
    path = scope["path"]
    tail = path.removeprefix("/replicas/") if path != "/replicas" else ""
    route = "/replicas" if path == "/replicas" else "/replicas/{id}"
    handler = ROUTES.get((scope["method"], route))
    if handler is None:
        return await send_error(send, RequestError("method not allowed", None, 405))
    await handler(router, receive, send, tail)
