"""Where a hung rank process is stuck, in its log.

A process that makes no progress past its hard timeout is killed by its agent; what it was doing dies with
it. So the restart wrapper has Python's ``faulthandler`` write the stack of every thread to stderr (the pod's
log) on :data:`~stalwart.api.restart.STACKS_SIGNAL`, which the agent sends in place of its kill. faulthandler
writes from the signal handler itself, in C: the dump comes even when the main thread is blocked in native
code (a collective, a lock) and runs no Python. Then it chains to the signal's default action, which ends the
process at once: a hung process woken by the signal (a ``pause()`` or ``sleep`` returns) takes no step after
its dump. The handler is installed only where the signal still has its default action, so a script's own
handler is left alone (and its status says the agent must not send it).
"""

from __future__ import annotations

import faulthandler
import logging
import signal
import sys

from stalwart.api.restart import STACKS_SIGNAL

log = logging.getLogger(__name__)

__all__ = ["install"]


def install() -> bool:
    """Dump every thread's stack to stderr on :data:`STACKS_SIGNAL`; returns whether the handler is in place
    (registering again, in a later round of the same process, keeps it)."""
    try:
        if signal.getsignal(STACKS_SIGNAL) is not signal.SIG_DFL:  # faulthandler's own shows as the default
            return False
        faulthandler.register(STACKS_SIGNAL, file=sys.stderr, all_threads=True, chain=True)
    except (ValueError, OSError, RuntimeError, AttributeError) as e:  # no stderr descriptor, not the main thread
        log.debug("no stack dumps on %s: %s", STACKS_SIGNAL.name, e)
        return False
    return True
