"""The rank's side of ``stalwart drill``'s rank exception: raise :class:`DrillFault` in the training function
when the agent asks.

The request itself is authenticated and checked by the agent (:mod:`stalwart.agent.drill`); the rank only
learns of it by a signal from its own agent (same pod, same user), with the request's id in a file next to its
status file (the wire format is :mod:`stalwart.api.drill`'s). So nothing of the request reaches the rank from
the network, and a rank that does not run the restart wrapper never gets the signal: the agent sends it only
to a process that wrote the marker file this module leaves, naming its pid.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import tempfile
import threading
from collections.abc import Callable
from types import FrameType

from stalwart.api.drill import DRILL_SIGNAL, ack_path, marker_path, request_path

log = logging.getLogger(__name__)

__all__ = ["DrillFault", "install"]

class DrillFault(RuntimeError):
    """The exception ``stalwart drill`` injects into a rank's training function."""


def _write(path: str, data: dict[str, object]) -> None:
    fd, tmp = tempfile.mkstemp(prefix=".drill-", dir=os.path.dirname(path) or ".")
    with os.fdopen(fd, "w") as f:
        json.dump(data, f)
    os.replace(tmp, path)


def install(status_file: str | None, in_training: Callable[[], bool]) -> bool:
    """Handle :data:`DRILL_SIGNAL` in this process: raise :class:`DrillFault` when ``in_training()`` (the main
    thread is in the training function), else only acknowledge. Returns False (and does nothing) off the main
    thread, without a status file, or when something else handles the signal already."""
    if not status_file or threading.current_thread() is not threading.main_thread():
        return False
    if signal.getsignal(DRILL_SIGNAL) not in (signal.SIG_DFL, None):
        return False

    def on_signal(signum: int, frame: FrameType | None) -> None:
        request = ""
        with contextlib.suppress(OSError, ValueError), open(request_path(status_file)) as f:
            request = str(json.load(f).get("id", ""))[:64]
        raising = in_training()
        with contextlib.suppress(OSError):
            _write(ack_path(status_file), {"id": request, "raised": raising})
        if raising:
            raise DrillFault(f"injected by stalwart drill (request {request or '?'})")
        log.warning("a drill exception arrived outside the training function; ignored")

    signal.signal(DRILL_SIGNAL, on_signal)
    try:
        _write(marker_path(status_file), {"pid": os.getpid(), "signal": DRILL_SIGNAL.name})
    except OSError as e:
        log.warning("cannot write the drill marker %s: %s", marker_path(status_file), e)
    return True
