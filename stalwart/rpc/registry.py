"""Named functions that peers may call: a call names a registered function, it never ships one.

Both sides import the module that registers a function, so the name resolves to the same code everywhere.
"""

from __future__ import annotations

import inspect
import re
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from stalwart.rpc.errors import UnknownFunction

F = TypeVar("F", bound=Callable[..., Any])

_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_.:-]{0,255}$")


@dataclass(frozen=True, slots=True)
class Registered:
    name: str
    fn: Callable[..., Any]
    is_async: bool
    inline: bool


class Registry:
    """Name -> function. Thread-safe; a name is bound once (registering it again to another function fails)."""

    def __init__(self) -> None:
        self._by_name: dict[str, Registered] = {}
        self._by_fn: dict[Any, str] = {}
        self._lock = threading.Lock()

    def register(self, fn: Callable[..., Any], name: str | None = None, *, inline: bool = False) -> Registered:
        """Register ``fn`` under ``name`` (default ``module.qualname``).

        ``inline=True`` runs a plain function on the agent's event loop instead of its worker threads: only
        for functions that return in microseconds and never block. Coroutine functions always run on the loop.
        """
        if not callable(fn):
            raise TypeError(f"fn: expected a callable, got {type(fn).__name__}")
        name = name if name is not None else f"{fn.__module__}.{fn.__qualname__}"
        if not _NAME.fullmatch(name):
            raise ValueError(f"name: {name!r} must be 1-256 characters of letters, digits, '_.:-', not "
                             "starting with a digit")
        entry = Registered(name, fn, inspect.iscoroutinefunction(fn), inline)
        with self._lock:
            existing = self._by_name.get(name)
            if existing is not None and existing.fn is not fn:
                raise ValueError(f"name: {name!r} is already registered to {existing.fn!r}")
            self._by_name[name] = entry
            self._by_fn[fn] = name
        return entry

    def lookup(self, name: str) -> Registered:
        try:
            return self._by_name[name]
        except KeyError:
            raise UnknownFunction(f"no function registered as {name!r}") from None

    def name_of(self, fn: Callable[..., Any] | str) -> str:
        """The registered name of ``fn`` (a name is returned as is)."""
        if isinstance(fn, str):
            return fn
        try:
            return self._by_fn[fn]
        except (KeyError, TypeError):
            raise UnknownFunction(
                f"{getattr(fn, '__qualname__', fn)!r} is not registered; decorate it with @rpc_function") from None


#: The process-wide registry that :func:`rpc_function` fills and agents serve by default.
REGISTRY = Registry()


def rpc_function(name: str | None = None, *, inline: bool = False) -> Callable[[F], F]:
    """Decorator: register a function in the process-wide :data:`REGISTRY` (see :meth:`Registry.register`)."""

    def deco(fn: F) -> F:
        REGISTRY.register(fn, name, inline=inline)
        return fn

    return deco
