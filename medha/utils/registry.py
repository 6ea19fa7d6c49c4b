"""Name -> class registries, so that adding a policy or packer means adding one file."""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Callable
from typing import Generic, TypeVar

T = TypeVar("T")


class Registry(Generic[T]):
    def __init__(self, kind: str, package: str | None = None, suffix: str = "") -> None:
        self.kind = kind
        self._package = package
        self._suffix = suffix
        self._entries: dict[str, type[T]] = {}
        self._discovered = package is None

    def register(self, name: str) -> Callable[[type[T]], type[T]]:
        def deco(cls: type[T]) -> type[T]:
            if name in self._entries and self._entries[name] is not cls:
                raise ValueError(f"{self.kind} {name!r} is registered twice")
            self._entries[name] = cls
            cls.name = name  # type: ignore[attr-defined]
            return cls

        return deco

    def _discover(self) -> None:
        # Import every `<variant><suffix>.py` module of the package once: each registers itself.
        if self._discovered:
            return
        self._discovered = True
        pkg = importlib.import_module(self._package)
        for info in pkgutil.iter_modules(pkg.__path__):
            if info.name.endswith(self._suffix):
                importlib.import_module(f"{self._package}.{info.name}")

    def names(self) -> list[str]:
        self._discover()
        return sorted(self._entries)

    def get(self, name: str) -> type[T]:
        self._discover()
        try:
            return self._entries[name]
        except KeyError:
            raise unknown_name(self.kind, name, self.names()) from None


def unknown_name(kind: str, name: object, choices) -> ValueError:
    """The error for a name that is none of `choices`, listing them."""
    return ValueError(f"unknown {kind} {name!r}; choose one of: {', '.join(sorted(choices))}")
