"""Interrupting the training function from the monitor thread.

The monitor decides (a peer's fault, this process's soft timeout); the main thread must then leave the
training function wherever it is. Three mechanisms, together:

* the process group's connections are shut down (by the caller), which frees a collective at once;
* an asynchronous :class:`RestartInterrupt` is set on the main thread (``PyThreadState_SetAsyncExc``): it
  is raised at the next bytecode the thread runs;
* a signal (``SIGUSR1``, only when nobody else handles it) breaks a blocking system call such as
  ``time.sleep``, so the pending exception is raised from inside it.

An interrupt is delivered at most once per iteration and only while the main thread is inside the training
function, outside :meth:`Interrupter.atomic` sections, outside ``import`` statements (an exception there would
leave a half-initialised module in ``sys.modules`` for every later iteration) and outside gRPC's and logging's
code (it could leave one of their locks held: every later etcd call or log line would deadlock); an interrupt
requested during an atomic section is raised when the section ends, one requested during an import or such
code at the next monitor tick after it. The iteration's torch Store runs its etcd calls in atomic sections and
ends its waits when :meth:`Interrupter.pending`. Leaving the training function cancels a pending interrupt
under the same lock, so the wrapper's own code never sees a stray one.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import signal
import sys
import threading
from collections.abc import Iterator
from types import FrameType

from stalwart.restart import phase_marks

log = logging.getLogger(__name__)

__all__ = ["Interrupter", "RestartInterrupt"]


class RestartInterrupt(BaseException):
    """The iteration was interrupted (a fault elsewhere, or this process timed out): the wrapper restarts.

    A ``BaseException``, so that ``except Exception`` in training code does not swallow it.
    """


_SIGNAL = signal.SIGUSR1


def _noop_handler(signum: int, frame: FrameType | None) -> None:
    # Running any Python code here lets the pending asynchronous exception fire inside the interrupted call.
    return None


def set_async_exc(thread_id: int, exc: type[BaseException] | None) -> int:
    obj = ctypes.py_object(exc) if exc is not None else None
    return int(ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread_id), obj))


#: Modules whose code takes locks from Python (``with condition:``, ``handler.acquire()``): an exception raised
#: between such an acquire and its ``with``/``try`` leaves the lock held forever, and every later user of it
#: deadlocks (gRPC's channel, so every etcd call; logging's handlers, so every log line).
_LOCKING_MODULES = ("grpc", "logging")


def _unsafe_to_raise(thread_id: int) -> str | None:
    """Why an exception must not be raised in the thread now (it runs an ``import``, or code of
    :data:`_LOCKING_MODULES`), or ``None``."""
    frame = sys._current_frames().get(thread_id)
    while frame is not None:
        if frame.f_code.co_filename.startswith("<frozen importlib"):
            return "import"
        module = frame.f_globals.get("__name__", "")
        if isinstance(module, str) and module.partition(".")[0] in _LOCKING_MODULES:
            return module
        frame = frame.f_back
    return None


class Interrupter:
    """Delivers :class:`RestartInterrupt` to the thread that runs the training function."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._thread_id = threading.get_ident()
        self._native_id = threading.get_native_id()
        self._in_user_code = False
        self._atomic_depth = 0
        self._requested: str | None = None
        self._delivered = False
        #: Counts the training function's runs: a request made for one run must not land in a later one.
        self._generation = 0
        self._use_signal = False
        if threading.current_thread() is threading.main_thread():
            try:
                if signal.getsignal(_SIGNAL) in (signal.SIG_DFL, None, _noop_handler):
                    signal.signal(_SIGNAL, _noop_handler)
                    self._use_signal = True
            except (ValueError, OSError):
                self._use_signal = False

    @property
    def requested(self) -> str | None:
        """Why an interrupt was requested in this iteration, or ``None``."""
        return self._requested

    @property
    def generation(self) -> int:
        """Which run of the training function is (or was last) inside: one more at every enter."""
        return self._generation

    @property
    def in_user_code(self) -> bool:
        """Whether the training function is running (between enter and leave)."""
        return self._in_user_code

    def pending(self) -> bool:
        """Whether an interrupt was requested and waits to be raised (an atomic section or a deferral holds
        it back): code that must not be interrupted asynchronously but waits long looks here to end early."""
        return self._requested is not None and not self._delivered and self._in_user_code

    def enter_user_code(self) -> None:
        """Called by the wrapper (its own thread) just before the training function starts."""
        with self._lock:
            self._requested = None
            self._delivered = False
            self._in_user_code = True
            self._atomic_depth = 0
            self._generation += 1

    def leave_user_code(self) -> None:
        """Called when the training function ends however it ends; cancels an undelivered interrupt."""
        with self._lock:
            self._in_user_code = False
            set_async_exc(self._thread_id, None)

    def request(self, reason: str, *, generation: int | None = None) -> bool | None:
        """Interrupt the training function (from any thread). Returns ``True`` if this call delivered it.

        With ``generation``, only that run of it (see :attr:`generation`): a decision taken in one iteration and
        acted on late (its report took seconds to write) must not end the next one, which the ranks are
        building a group for; returns ``None`` then, and requests nothing."""
        with self._lock:
            if generation is not None and generation != self._generation:
                return None
            if self._requested is None:
                self._requested = reason
                phase_marks.knew()
            return self._try_deliver()

    def _try_deliver(self) -> bool:
        if self._delivered or self._requested is None or not self._in_user_code or self._atomic_depth:
            return False
        if _unsafe_to_raise(self._thread_id) is not None:
            return False  # retried at the next monitor tick (nudge)
        self._delivered = True
        set_async_exc(self._thread_id, RestartInterrupt)
        if self._use_signal:
            with contextlib.suppress(OSError):
                signal.pthread_kill(self._thread_id, _SIGNAL)
        return True

    def nudge(self) -> bool:
        """Called on every monitor tick: deliver a deferred interrupt (the thread was importing), or signal
        the thread again while a delivered one has not ended the training function yet -- a signal that
        lands just before the thread enters a blocking call is handled only after that call returns.

        Returns whether a delivered interrupt has not ended the training function (the thread is blocked in
        native code). One deferred by an atomic section or an import is not: that section runs to its end
        untouched."""
        with self._lock:
            if not self._in_user_code or self._requested is None:
                return False
            if not self._delivered:
                self._try_deliver()
            elif self._use_signal:
                with contextlib.suppress(OSError):
                    signal.pthread_kill(self._thread_id, _SIGNAL)
            return self._delivered

    @contextlib.contextmanager
    def atomic(self) -> Iterator[None]:
        """A section the interrupt waits for (e.g. a checkpoint write); nests."""
        with self._lock:
            self._atomic_depth += 1
        try:
            yield
        finally:
            with self._lock:
                self._atomic_depth -= 1
                fire = (self._atomic_depth == 0 and self._requested is not None and not self._delivered
                        and self._in_user_code)
                if fire:
                    self._delivered = True
            if fire:
                raise RestartInterrupt(self._requested)

    def close(self) -> None:
        """Restore the signal disposition (from the main thread)."""
        if self._use_signal and threading.current_thread() is threading.main_thread():
            with contextlib.suppress(ValueError, OSError):
                if signal.getsignal(_SIGNAL) is _noop_handler:
                    signal.signal(_SIGNAL, signal.SIG_DFL)
            self._use_signal = False
