"""How a stalwart process ends: its own streams closed first, and gone within a bound even where a library's
finaliser would block it for ever.

Why a bound is needed at all: gRPC runs each streaming call (an etcd watch, a lease keep-alive) with daemon
threads that take the call's condition lock to deliver its events. When the interpreter finalises, it stops
daemon threads wherever they are, and one stopped while it held that lock holds it for ever; collecting the
call object afterwards (``_Rendezvous.__del__``) then waits on the lock, and the process never exits, after
all of stalwart's own code has finished. Closing every stream before the interpreter finalises removes the
cause; leaving without finalisation removes the consequence, whatever library holds the lock next time.

The parts:

* :func:`track`: a resource that holds long-lived streams (every etcd ``Store`` registers itself) is closed
  by :func:`close_tracked` before the process leaves, even if its owner forgot it.
* :func:`decided`: the process has decided to exit (the agent once its ranks returned, the operator on
  SIGTERM). From then on a watchdog thread ends it within the bound, whatever its own clean-up is waiting
  for (a stream's ``__del__`` blocks the thread that drops the stream's last reference just as well as it
  blocks finalisation); a timer in C backs the thread up where no Python thread runs any more.
* :func:`leave`: for processes whose ``main`` stalwart owns (the agent, the operator, the drill): close what is
  tracked and run the ``atexit`` functions within the bound, flush the logs, then ``os._exit`` with the code,
  never running the interpreter's finalisation. Whatever overran the bound is logged (``had to leave``, with
  every thread's stack).
* :func:`guard_exit`: for processes whose ``main`` is the user's (a rank process running the training
  function): an ``atexit`` hook closes what is tracked, tells the process's supervisor that the exit has begun
  (the rank marks its status file ``exiting``), and arms faulthandler's timer in C, which dumps the stacks if
  the exit is still going at the bound. The exit code stays the script's own: the agent is the one that ends a
  rank whose exit overran, and it counts a rank that had returned from the training function as a success.

Imports nothing of stalwart: every layer may use it.
"""

from __future__ import annotations

import atexit
import contextlib
import faulthandler
import gc
import logging
import os
import sys
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import NoReturn, Protocol

__all__ = ["EXIT_BOUND", "Closeable", "close_tracked", "decided", "guard_exit", "leave",
           "set_context", "track", "untrack"]

log = logging.getLogger(__name__)

#: Seconds a process that has decided to exit may take to be gone.
EXIT_BOUND = 10.0
#: Of the bound, what :func:`leave` keeps for flushing the logs after the closing steps.
_FLUSH_RESERVE = 1.0
#: Seconds after the bound at which faulthandler's C timer ends a process whose watchdog thread cannot run
#: (the interpreter is finalising); its exit code is then 1.
_BACKSTOP = 2.0


class Closeable(Protocol):
    def close(self) -> None: ...


_tracked: weakref.WeakValueDictionary[int, Closeable] = weakref.WeakValueDictionary()
_tracked_lock = threading.Lock()
_order = 0
_context = ""
_guard_armed = False


@dataclass(slots=True)
class _Decision:
    code: int
    deadline: float  # monotonic
    bound: float


_decision: _Decision | None = None


def set_context(context: str) -> None:
    """What the exit's log lines name (e.g. ``job=... node=...``)."""
    global _context
    _context = context


def _prefix() -> str:
    return f"{_context}: " if _context else ""


def track(resource: Closeable) -> None:
    """Close ``resource`` before the process leaves (see :func:`close_tracked`). Held weakly: a resource that is
    gone needs no closing."""
    global _order
    with _tracked_lock:
        _order += 1
        _tracked[_order] = resource


def untrack(resource: Closeable) -> None:
    """``resource`` was closed by its owner."""
    with _tracked_lock:
        for key, value in list(_tracked.items()):
            if value is resource:
                del _tracked[key]


def _run_bounded(name: str, step: Callable[[], None], timeout: float) -> bool:
    """Run ``step`` in a daemon thread; whether it finished within ``timeout``. A step that overruns is left
    behind (the process is about to leave) rather than waited for."""
    finished = threading.Event()

    def run() -> None:
        try:
            step()
        except BaseException:  # a failing closer must not stop the ones after it, nor the exit
            log.exception("%s%s failed while the process was leaving", _prefix(), name)
        finally:
            finished.set()

    threading.Thread(target=run, name=f"stalwart-exit-{name}", daemon=True).start()
    return finished.wait(max(0.0, timeout))


def close_tracked(timeout: float) -> list[str]:
    """Close every tracked resource, the newest first, within ``timeout`` seconds in all; the names of those
    that did not close in time (a closer blocked on a lock another thread holds, say)."""
    with _tracked_lock:
        resources = [r for _, r in sorted(_tracked.items(), reverse=True)]
    deadline = time.monotonic() + timeout
    late: list[str] = []
    for resource in resources:
        name = type(resource).__name__
        if not _run_bounded(f"close-{name}", resource.close, deadline - time.monotonic()):
            late.append(name)
    return late


def _flush() -> None:
    for handler in list(logging.getLogger().handlers):
        with contextlib.suppress(Exception):
            handler.flush()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            if stream is not None:
                stream.flush()


def _report_overrun(steps: list[str], bound: float) -> None:
    threads = sorted(t.name for t in threading.enumerate() if t is not threading.current_thread())
    log.warning("%shad to leave without finishing %s within %gs (threads still running: %s); every thread's "
                "stack follows", _prefix(), ", ".join(steps), bound, ", ".join(threads))
    _flush()
    with contextlib.suppress(Exception):
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)


def decided(code: int, *, bound: float = EXIT_BOUND) -> None:
    """This process has decided to exit with ``code``: it is gone within ``bound`` seconds from now, whatever
    its clean-up then waits for. A later call changes the code, never the deadline. Only for a process whose
    exit stalwart owns (the agent's and the operator's ``main``): the watchdog ends the whole process."""
    global _decision
    with _tracked_lock:
        if _decision is not None:
            _decision.code = code
            return
        _decision = _Decision(code, time.monotonic() + bound, bound)
    threading.Thread(target=_watchdog, name="stalwart-exit-watchdog", daemon=True).start()
    faulthandler.dump_traceback_later(bound + _BACKSTOP, exit=True, file=sys.stderr)


def _watchdog() -> None:
    decision = _decision
    assert decision is not None
    time.sleep(max(0.0, decision.deadline - time.monotonic()))
    _report_overrun([f"its clean-up (it decided to exit with code {decision.code})"], decision.bound)
    _flush()
    os._exit(decision.code)


def leave(code: int, *, bound: float = EXIT_BOUND) -> NoReturn:
    """End this process with ``code``: close what is tracked, run the ``atexit`` functions, flush the logs,
    and ``os._exit``, by the deadline of :func:`decided` (armed now if it was not). The interpreter's
    finalisation never runs (that is where a library's finaliser can block for ever); whatever overran the
    bound is logged with every thread's stack."""
    decided(code, bound=bound)
    decision = _decision
    assert decision is not None
    # The pid tells the exit check (stalwart.local.exitcheck) the main process's line from its ranks', which
    # write to the same log.
    log.info("%sleaving with exit code %d (bound %gs, pid %d)", _prefix(), decision.code, decision.bound, os.getpid())

    def left() -> float:
        return decision.deadline - _FLUSH_RESERVE - time.monotonic()

    late = [f"closing {name}" for name in close_tracked(left())]
    if not _run_bounded("atexit", atexit._run_exitfuncs, left()):
        late.append("the atexit functions")
    if late:
        _report_overrun(late, decision.bound)
    _flush()
    os._exit(decision.code)


def _at_exit(bound: float, began: Callable[[], None] | None) -> None:
    late = close_tracked(bound / 2)
    if late:
        _report_overrun([f"closing {name}" for name in late], bound / 2)
    if began is not None:
        try:
            began()
        except Exception:
            log.exception("%scould not say that the exit began", _prefix())
    _flush()
    # The interpreter's last collection walks every object a rank built (torch's modules among them): seconds
    # of CPU on a loaded machine, spent only to free memory the process is about to hand back anyway. Frozen
    # objects are left out of it; what their references keep is freed with the process.
    gc.freeze()
    # From here on no Python thread may run again (the interpreter is finalising, then C++ destructors run),
    # so the report lives in C: faulthandler's own thread dumps the stacks if the exit is still going.
    # The stacks come a little before the bound, so that they are in the log before the supervisor acts on it.
    faulthandler.dump_traceback_later(max(bound / 2, bound - 2.0), exit=False, file=sys.stderr)


def guard_exit(*, bound: float = EXIT_BOUND, began: Callable[[], None] | None = None) -> None:
    """Prepare this process's exit when its ``main`` is not stalwart's (see the module docstring). Idempotent.

    At interpreter exit the tracked resources are closed (half the bound at most), ``began`` is called (to tell
    the supervisor, which bounds the exit from then on), and the stacks go to stderr if the process is still
    there shortly before the bound (2 s before it, or at half of it)."""
    global _guard_armed
    with _tracked_lock:
        if _guard_armed:
            return
        _guard_armed = True
    atexit.register(_at_exit, bound, began)
