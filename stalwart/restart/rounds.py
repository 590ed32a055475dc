"""The outer loop of a rank process: one restart session per rendezvous round it takes part in.

:func:`run_rounds` builds the session of the process's round from its environment, runs it, and when the
agent hands the process to a newer round (:class:`~stalwart.restart.handover.RoundOver`, or a write of the
old round refused as ``StaleEpoch`` followed by a handover within the barrier timeout) starts the session of
the new round in the same process: no new interpreter, no new imports, the model still in memory.

The decorator's ``prepare`` hook runs here, once per process, before its first round: on a warm spare's
process while it waits parked (before the wait for its handover), so that what does not depend on the world
(the model, the optimizer, moving them to the device) is built before a round needs the spare; on any other
process before its first session. Its result goes to every call of the training function in the process
(``CallWrapper.prepared``); it never runs again there (not after the promotion, not at an in-process restart,
not in a later round). On a parked process an exception from it ends the process ``PREPARE_FAILED``, logged
with its traceback, before any round took the process: the running ranks are not touched. So does a hook that
has not returned within ``prepare_timeout`` seconds, wherever it runs (a thread of the process watches it; the
hook may be blocked in native code, where no exception reaches it, so the process writes its threads' stacks
to its log and ends itself: it holds nothing of any round yet). The process first
writes the exception, as a :class:`~stalwart.api.restart.FailureInfo`, to ``STALWART_PARKED_REPORT`` (a file
in its agent's private run directory), from which its agent reports it to the operator (the job's
``PrepareFailed`` condition names the pod and the exception). On any other process it propagates as an
exception raised by the script before its first iteration does.

A parked process started without ``LOCAL_RANK`` (a pod's standby process when the pod runs several local
ranks: it does not know which one it will replace, and a hook may choose its device by it) runs the hook
after its handover instead, as a running rank does.
"""

from __future__ import annotations

import contextlib
import faulthandler
import logging
import os
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

from stalwart import exits
from stalwart.api import pod_env
from stalwart.api.exit_codes import ExitCode
from stalwart.api.handover import PARKED_ENV, Handover
from stalwart.api.restart import FailureInfo, RankStatus
from stalwart.etcd.fence import StaleEpoch
from stalwart.etcd.store import StoreError
from stalwart.restart import phase_marks
from stalwart.restart.config import RestartConfig
from stalwart.restart.environment import RankEnvironment
from stalwart.restart.errors import RestartExit, exception_name
from stalwart.restart.handover import RoundOver, RoundWatch, is_parked
from stalwart.restart.monitor import StatusFile

log = logging.getLogger(__name__)

__all__ = ["PARKED_CHECK", "run_rounds"]

#: Seconds between a parked process's checks that its agent lives (it sleeps in the kernel in between).
PARKED_CHECK = 1.0


class _Session(Protocol):
    def abort_last(self) -> None: ...

    def close(self) -> None: ...


def _parent_alive(parent: int) -> Callable[[], bool]:
    return lambda: os.getppid() == parent


def _enter(watch: RoundWatch, handover: Handover) -> None:
    os.environ.update(handover.env)
    os.environ.pop(PARKED_ENV, None)
    watch.switched(handover.epoch)


def _mark_exiting() -> None:
    """Tell the agent, through the status file, that this process's interpreter began to exit."""
    path = os.environ.get(pod_env.STATUS_FILE)
    if not path:
        return
    try:
        status = RankStatus.from_json_bytes(Path(path).read_bytes())
    except (OSError, ValueError):
        return
    StatusFile(path).write(status.model_copy(update={"exiting": time.monotonic()}))


def _report_parked_failure(what: str, e: Exception | None = None) -> None:
    """Write why this parked process ends (``what``; ``e``: the exception) to ``STALWART_PARKED_REPORT``
    (atomically), for its agent."""
    path = os.environ.get(pod_env.PARKED_REPORT)
    if not path:
        return
    info = FailureInfo(pod=os.environ.get(pod_env.NODE_ID, ""), time=time.time(),
                       exception=None if e is None else exception_name(e)[:512],
                       message=None if e is None else str(e)[:2048],
                       reason=f"{what} (exit code {int(ExitCode.PREPARE_FAILED)}, PREPARE_FAILED)")
    tmp: str | None = None
    try:
        fd, tmp = tempfile.mkstemp(prefix=".parked-", dir=os.path.dirname(path) or ".")
        with os.fdopen(fd, "wb") as f:
            f.write(info.to_json_bytes())
        os.replace(tmp, path)
    except OSError as err:  # the pod's log still has the exception
        log.warning("cannot write the parked report %s: %s", path, err)
        if tmp is not None:
            with contextlib.suppress(OSError):
                os.unlink(tmp)


class _PrepareDeadline:
    """Ends this process ``PREPARE_FAILED`` when the hook has not returned within ``seconds``: its threads'
    stacks to stderr (the pod's log) first, and, parked, the report for its agent."""

    def __init__(self, seconds: float, *, parked: bool) -> None:
        self.seconds, self.parked = seconds, parked
        self._returned = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="stalwart-prepare-deadline", daemon=True)

    def __enter__(self) -> None:
        self._thread.start()

    def __exit__(self, *_: object) -> None:
        self._returned.set()
        self._thread.join(timeout=5)

    def _watch(self) -> None:
        if self._returned.wait(self.seconds):
            return
        what = f"the prepare hook did not return within {self.seconds:g} s"
        log.error("%s; its threads' stacks follow; exiting %d (%s)", what, ExitCode.PREPARE_FAILED,
                  ExitCode.PREPARE_FAILED.name)
        with contextlib.suppress(Exception):
            faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        if self.parked:
            _report_parked_failure(f"{what} on a parked process")
        with contextlib.suppress(Exception):
            sys.stderr.flush()
        os._exit(int(ExitCode.PREPARE_FAILED))


def _prepare(config: RestartConfig, *, parked: bool) -> Any:
    """The result of the decorator's ``prepare`` hook (``None`` without one), within ``prepare_timeout``, its run
    marked (:mod:`.phase_marks`)."""
    if config.prepare is None:
        return None
    start = time.time()
    with _PrepareDeadline(config.prepare_timeout, parked=parked):
        if not parked:
            result = config.prepare()
            phase_marks.prepared(start, time.time(), parked=False)
            return result
        try:
            result = config.prepare()
        except Exception as e:
            log.error("parked process: the prepare hook raised %s: %s; exiting %d (%s), no round took this process",
                      exception_name(e), e, ExitCode.PREPARE_FAILED, ExitCode.PREPARE_FAILED.name, exc_info=True)
            _report_parked_failure("the prepare hook raised on a parked process", e)
            raise RestartExit(ExitCode.PREPARE_FAILED,
                              f"the prepare hook raised on a parked process: {exception_name(e)}: {e}") from e
        phase_marks.prepared(start, time.time(), parked=True)
        return result


def run_rounds(make_session: Callable[[RankEnvironment, RestartConfig, RoundWatch | None], _Session],
               base: RestartConfig, explicit: frozenset[str], run: Callable[[Any, Any], Any]) -> Any:
    """Run ``run(session, prepared)`` in this process's round and in every later round its agent hands it to
    (``prepared``: the result of ``base.prepare``, run once before the first)."""
    # Once the script ends, stalwart's streams are closed before the interpreter finalises, and the agent is
    # told that the exit began: it bounds the exit from then on (a finaliser that blocks cannot keep the
    # process, and its pod, alive).
    exits.guard_exit(began=_mark_exiting)
    watch = RoundWatch.from_env(0)
    parked = is_parked()
    if watch is not None and not parked:
        watch.start()
    try:
        if parked:
            if watch is None:
                raise RestartExit(ExitCode.NON_RETRYABLE, "a parked process needs STALWART_HANDOVER_FILE")
            parent = os.getppid()
            knows_place = pod_env.LOCAL_RANK in os.environ
            prepared = _prepare(base, parked=True) if knows_place else None
            # A parked process waits for as long as its agent lives (the agent stops it when the job ends); its
            # main thread alone watches the file until a round takes it, then the watch's own thread does.
            first = watch.wait(None, alive=_parent_alive(parent), block=PARKED_CHECK)
            phase_marks.knew()  # a round took this process: a fault took a rank (or the world grows)
            if first is None:
                raise RestartExit(ExitCode.TERMINATED, "the agent ended before a round took this spare")
            _enter(watch, first)
            watch.start()
            if not knows_place:
                prepared = _prepare(base, parked=False)
        else:
            prepared = _prepare(base, parked=False)
        while True:
            phase_marks.entered()
            env = RankEnvironment.from_env()
            if watch is not None:
                watch.switched(env.epoch)
            try:
                config = base.for_job(env.job_settings(), explicit)
            except ValueError as e:
                log.error("slot %d: invalid restart settings: %s", env.slot, e)
                raise RestartExit(ExitCode.NON_RETRYABLE, f"invalid restart settings: {e}") from None
            session = make_session(env, config, watch)
            try:
                return run(session, prepared)
            except RoundOver as e:
                phase_marks.knew()
                handover = e.handover
            except StaleEpoch as e:
                found = None if watch is None else watch.wait(time.monotonic() + config.barrier_timeout)
                if found is None:
                    raise RestartExit(ExitCode.STALE_EPOCH, str(e)) from e
                handover = found
                session.abort_last()
            except StoreError as e:
                raise RestartExit(ExitCode.COORDINATION_LOST, str(e)) from e
            except RestartExit as e:
                log.error("slot %d: giving up: %s", env.slot, e)
                raise
            finally:
                session.close()
            log.info("slot %d epoch %d: continuing in round %d (epoch %d) in process", env.slot, env.epoch,
                     handover.round, handover.epoch)
            _enter(watch, handover)  # type: ignore[arg-type]  # a handover implies a watch
    finally:
        if watch is not None:
            watch.stop()
