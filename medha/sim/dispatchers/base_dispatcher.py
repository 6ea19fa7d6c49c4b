"""Global dispatch: which replica a new request goes to."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, ClassVar

from medha.core.config import SchedulerConfig
from medha.core.request import Request
from medha.sim.config import ClusterConfig
from medha.utils.registry import Registry

if TYPE_CHECKING:
    from medha.sim.replica import SimReplica


class Dispatcher(ABC):
    name: ClassVar[str]

    def __init__(
        self, replicas: list[SimReplica], cluster: ClusterConfig, scheduler: SchedulerConfig
    ) -> None:
        """`cluster` carries the dispatcher's own settings; `scheduler` is the deployment's
        (resolved) scheduler config, what every replica runs, for the settings a dispatcher
        shares with a policy (the pla boundary)."""
        self.replicas = replicas

    @abstractmethod
    def pick(self, request: Request, now: float) -> SimReplica:
        """The replica that admits `request`."""


DISPATCHERS: Registry[Dispatcher] = Registry("dispatcher", __package__, suffix="_dispatcher")
