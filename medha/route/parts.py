"""The router as the modules it hands requests to see it (`RouterLike`): what admin.py and
exchange.py use of `Router` (app.py), its public interface to them. They import this, not
app.py, which imports them."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import aiohttp

    from medha.route.admission import Admission
    from medha.route.config import RouteConfig
    from medha.route.metrics import RouterMetrics
    from medha.route.placement import Placement
    from medha.route.pricing import Pricing
    from medha.route.replicas import ReplicaSet


class RouterLike(Protocol):
    config: RouteConfig
    clock: Callable[[], float]
    metrics: RouterMetrics
    pricing: Pricing  # the models the replicas' work is priced with
    replicas: ReplicaSet  # membership, health, breakers, the requests each replica runs
    placement: Placement  # the dispatcher, the requests it holds
    admission: Admission  # the requests waiting and open
    client: aiohttp.ClientSession | None  # (None until the router starts)

    @property
    def has_api_key(self) -> bool:
        """Whether clients must give the router's API key (and /replicas is served)."""
        ...

    def authorized(self, scope) -> bool:
        """Whether an HTTP request (its ASGI scope) carries the router's API key, if any."""
        ...
