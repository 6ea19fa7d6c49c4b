"""Who goes first: a policy maps each waiting request to a priority key (lower runs first)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import ClassVar

from medha.core.request import Request
from medha.utils.registry import Registry

SortKey = Callable[[Request], float]


class Policy(ABC):
    name: ClassVar[str]
    summary: ClassVar[str]

    @abstractmethod
    def sort_key(self, now: float) -> SortKey:
        """A key function for `sorted`, valid at time `now`."""

    def key(self, request: Request, now: float) -> float:
        return self.sort_key(now)(request)


POLICIES: Registry[Policy] = Registry("policy", __package__, suffix="_policy")


def make_policy(name: str) -> Policy:
    return POLICIES.get(name)()
