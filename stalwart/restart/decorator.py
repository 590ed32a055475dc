"""``@stalwart.restartable``: the decorator, and the callable it returns, which runs the function's rounds and
their iterations (:mod:`.rounds`, :mod:`.wrapper`)."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any, Generic, ParamSpec, TypeVar, overload

from stalwart.restart.config import RestartConfig
from stalwart.restart.rounds import run_rounds
from stalwart.restart.wrapper import CallWrapper, Session

__all__ = ["Restartable", "restartable"]

P = ParamSpec("P")
R = TypeVar("R")


def _injection(fn: Callable[..., Any]) -> str | None:
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return None
    for name, p in sig.parameters.items():
        ann = p.annotation
        if name == "call_wrapper" or ann is CallWrapper or ann == "CallWrapper":
            return name
    return None


class Restartable(Generic[P, R]):
    """The callable :func:`restartable` returns. Calling it runs the function with in-process restarts
    and returns its result (``None`` on a process that stayed a spare until the end)."""

    def __init__(self, fn: Callable[P, R], config: RestartConfig, explicit: frozenset[str] = frozenset()) -> None:
        self.fn = fn
        self.config = config
        #: The options the decorator set: the job's settings do not override them.
        self.explicit = explicit
        self._inject = _injection(fn)
        functools.update_wrapper(self, fn)

    def __call__(self, *args: P.args, **kwargs: P.kwargs) -> R:
        return run_rounds(Session, self.config, self.explicit,  # type: ignore[no-any-return]
                          lambda s, prepared: s.run(self.fn, tuple(args), dict(kwargs), self._inject, prepared))


@overload
def restartable(fn: Callable[P, R], /) -> Restartable[P, R]: ...


@overload
def restartable(fn: None = None, /, **options: Any) -> Callable[[Callable[P, R]], Restartable[P, R]]: ...


def restartable(fn: Callable[P, R] | None = None, /, **options: Any) \
        -> Restartable[P, R] | Callable[[Callable[P, R]], Restartable[P, R]]:
    """Make a training function restartable in process. Use as ``@restartable`` or
    ``@restartable(max_restarts=5, soft_timeout=30, ...)``; the options are :class:`RestartConfig`'s and are
    validated here, at decoration time. Under a TrainingJob, ``max_restarts``, ``soft_timeout``,
    ``hard_timeout`` and ``barrier_timeout`` not given here come from its ``restartPolicy.inProcess``. The
    process must run under ``stalwart agent`` (which sets the ``STALWART_*`` environment).

    ``prepare=fn`` (a callable taking no arguments) builds what does not depend on the world once per
    process, before its first round; a warm spare runs it while it waits parked. The function receives its
    result as ``call_wrapper.prepared`` (see :mod:`stalwart.restart.rounds`)."""
    config = RestartConfig(**options)
    explicit = frozenset(options)

    def decorate(f: Callable[P, R]) -> Restartable[P, R]:
        if not callable(f):
            raise TypeError(f"restartable: expected a function, got {f!r}")
        return Restartable(f, config, explicit)

    return decorate(fn) if fn is not None else decorate
