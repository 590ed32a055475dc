"""A rank process across rendezvous rounds: it leaves an ended round for the next one without restarting.

When a round ends (a pod was lost), the agent of a surviving pod keeps its rank processes and writes each a
:class:`~stalwart.api.handover.Handover` for the new round. :class:`RoundWatch` notices it (a ``stat`` of the
file every ``interval``), interrupts the training function as for a fault (the wrapper aborts the process
group, which frees peers blocked in collectives) and makes the wrapper leave the old round at its next
check (:class:`RoundOver`). :func:`run_rounds` then starts a new session in the new epoch: iteration 0 of the
new round, with the rank the new round gives. A warm spare's process starts *parked*: it imports the script
and waits here, costing no CPU (asleep in the kernel until its handover file changes: :mod:`.inotify`), until
a round takes it.

A process whose round was fenced out (a write refused with ``StaleEpoch``) waits for its handover for up to
the barrier timeout; without one (its pod is no longer in any round: it is a zombie) it exits as before.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from stalwart.api.handover import HANDOVER_FILE_ENV, PARKED_ENV, Handover
from stalwart.restart.inotify import file_wait

log = logging.getLogger(__name__)

__all__ = ["RoundOver", "RoundWatch", "is_parked", "newer", "read_handover"]


class RoundOver(Exception):
    """The process's round ended and its agent handed it to a newer one (``handover``)."""

    def __init__(self, handover: Handover) -> None:
        super().__init__(f"handed over to round {handover.round} (epoch {handover.epoch})")
        self.handover = handover


def is_parked(environ: dict[str, str] | os._Environ[str] | None = None) -> bool:
    """Whether this process is a warm spare's, started before any round took it."""
    env = os.environ if environ is None else environ
    return env.get(PARKED_ENV, "").lower() == "true"


def newer(handover: Handover | None, epoch: int) -> Handover | None:
    """``handover`` when it names a round after ``epoch`` (0: none yet), else ``None``. Pure."""
    return handover if handover is not None and handover.epoch > epoch else None


def read_handover(path: str) -> Handover | None:
    """The handover in ``path``, ``None`` when there is none or it cannot be read (logged)."""
    try:
        data = open(path, "rb").read()  # noqa: SIM115 - closed by refcount at once; one read
    except FileNotFoundError:
        return None
    except OSError as e:
        log.warning("cannot read the handover file %s: %s", path, e)
        return None
    try:
        return Handover.from_json_bytes(data)
    except ValueError as e:
        log.warning("ignoring an invalid handover file %s: %s", path, e)
        return None


@dataclass(slots=True)
class RoundWatch:
    """Watches this process's handover file for a round after ``epoch``. Thread-safe; one per process.

    ``on_new`` is called once per new handover (from the watch thread): the wrapper interrupts the training
    function there. :meth:`check` raises :class:`RoundOver` once a newer round is known.
    """

    path: str
    epoch: int
    interval: float = 0.05
    on_new: Callable[[Handover], object] | None = None
    _pending: Handover | None = None
    _seen: tuple[int, int, int] = (0, 0, 0)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    @classmethod
    def from_env(cls, epoch: int) -> RoundWatch | None:
        path = os.environ.get(HANDOVER_FILE_ENV, "")
        return cls(path, epoch) if path else None

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="stalwart-round-watch", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)
        self._thread = None

    def pending(self) -> Handover | None:
        """The handover to a round after the current one, once seen."""
        with self._lock:
            return self._pending

    def check(self) -> None:
        """Raise :class:`RoundOver` when a newer round took this process."""
        pending = self.pending()
        if pending is not None:
            raise RoundOver(pending)

    def switched(self, epoch: int) -> None:
        """The process now runs in the round of ``epoch``."""
        with self._lock:
            self.epoch = epoch
            if self._pending is not None and self._pending.epoch <= epoch:
                self._pending = None

    def poll(self) -> Handover | None:
        """Read the file if it changed; return (and remember) a handover to a newer round."""
        try:
            st = os.stat(self.path)
        except OSError:
            return None
        # The agent replaces the file (a new inode each time): mtime alone can repeat within its granularity.
        changed = (st.st_ino, st.st_mtime_ns, st.st_size)
        if changed == self._seen:
            return None
        self._seen = changed
        with self._lock:
            found = newer(read_handover(self.path), self.epoch)
            if found is None or (self._pending is not None and self._pending.epoch >= found.epoch):
                return None
            self._pending = found
        log.info("handed over to round %d (epoch %d)", found.round, found.epoch)
        if self.on_new is not None:
            self.on_new(found)
        return found

    def wait(self, deadline: float | None, alive: Callable[[], bool] = lambda: True, *,
             block: float | None = None) -> Handover | None:
        """Wait for a newer round until ``deadline`` (monotonic; ``None``: while ``alive()``). With ``block``,
        sleep in the kernel until the file changes, ``alive()`` asked every ``block`` seconds
        (:mod:`.inotify`: a parked process's wait costs no CPU), rather than look every ``interval``."""
        notify = file_wait(self.path) if block is not None else None
        try:
            while deadline is None or (now := time.monotonic()) < deadline:
                self.poll()
                pending = self.pending()
                if pending is not None:
                    return pending
                if not alive():
                    return None
                if notify is not None and block is not None:
                    notify.wait(block if deadline is None else min(block, max(0.0, deadline - now)))
                else:
                    self._stop.wait(self.interval)
            return None
        finally:
            if notify is not None:
                notify.close()

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self.poll()
            except Exception as e:  # a bad file must not end the watch; the next change is read again
                log.warning("round watch: %s", e)
