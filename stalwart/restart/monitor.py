"""The monitor thread of a rank process: notices faults (etcd watch) and a stalled main thread (soft
timeout), interrupts the training function, and keeps the status file the agent reads.

Progress of the main thread is observed without help from the training code: every ``interval`` the
monitor schedules a tiny C callback on the main thread (``Py_AddPendingCall``). The interpreter runs it only
when the main thread executes Python bytecode, so a thread blocked in a collective (until it completes), in a
system call or stopped shows no progress, while any Python-level work does. ``CallWrapper.ping()`` counts as
progress too. The soft timeout applies while the training function runs; the heartbeat in the status file is
the main thread's last progress in every phase (``now`` only where the wrapper runs outside the main thread),
so the agent's hard timeout also ends a process stuck in the wrapper's own steps (a Finalize policy, an
abort that blocks).
"""

from __future__ import annotations

import contextlib
import ctypes
import faulthandler
import logging
import os
import sys
import tempfile
import threading
import time
from collections.abc import Callable

from stalwart import exits
from stalwart.api.exit_codes import ExitCode
from stalwart.api.restart import FaultRecord, RankStatus, failure_info
from stalwart.etcd.keys import ALIVE, FAULT
from stalwart.etcd.store import StoreError, Watch, WatchEvent, WatchRange
from stalwart.jitter import RNG
from stalwart.restart import phase_marks, snapshot_held
from stalwart.restart.coordination import Coordinator
from stalwart.restart.interrupt import Interrupter
from stalwart.restart.monitor_rules import (
    interrupts_current,
    kill_limit,
    link_report,
    lost_peer_report,
    stall_limit,
    when_stuck,
)
from stalwart.restart.policies import IterationContext, free_blocked_peers
from stalwart.restart.protocol import (
    Report,
    better_cause,
    of_another,
)
from stalwart.restart.snapshot_spill import directory_for
from stalwart.restart.sockets import connection_states, retransmitting

log = logging.getLogger(__name__)

__all__ = ["Monitor", "StatusFile"]



class _MainThreadProbe:
    """Asks the main thread to run ``sem_post`` on a private semaphore (``Py_AddPendingCall``) and tells
    whether it did. The interpreter runs pending calls only between bytecodes of the main thread, so the
    post shows that the main thread ran Python code after the request was made: the monitor knows the main
    thread's progress to within one tick. A C function, not a Python callback, on purpose: an interrupt set
    on the main thread would fire inside a Python callback, where ctypes swallows it."""

    def __init__(self) -> None:
        libc = ctypes.CDLL(None, use_errno=True)
        self._sem = ctypes.create_string_buffer(64)  # sem_t is 32 bytes on 64-bit Linux
        if libc.sem_init(ctypes.byref(self._sem), 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "sem_init failed")
        self._post = ctypes.cast(libc.sem_post, ctypes.c_void_p)
        self._trywait = libc.sem_trywait
        self._trywait.argtypes = [ctypes.c_void_p]
        self._trywait.restype = ctypes.c_int
        self._add = ctypes.pythonapi.Py_AddPendingCall
        self._add.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
        self._add.restype = ctypes.c_int
        self._asked: float | None = None

    def poll(self, now: float) -> float | None:
        """Called every tick: the monotonic time of the last request the main thread has answered since the
        previous poll (it ran Python code after that time), or ``None``; then asks again if none is pending.
        The semaphore outlives the process's threads: it is never destroyed."""
        answered = None
        if self._asked is not None and self._trywait(ctypes.addressof(self._sem)) == 0:
            answered, self._asked = self._asked, None
        if self._asked is None and self._add(self._post, ctypes.addressof(self._sem)) == 0:
            self._asked = now
        return answered


def _probe() -> _MainThreadProbe | None:
    try:
        return _MainThreadProbe()
    except (OSError, AttributeError):  # not Linux: progress comes from ping() only
        return None


class StatusFile:
    """Writes :class:`RankStatus` atomically (write + rename) to ``path``; no-op when ``path`` is None."""

    def __init__(self, path: str | None) -> None:
        self.path = path

    def write(self, status: RankStatus) -> None:
        if not self.path:
            return
        directory = os.path.dirname(self.path) or "."
        try:
            fd, tmp = tempfile.mkstemp(prefix=".status-", dir=directory)
            with os.fdopen(fd, "wb") as f:
                f.write(status.to_json_bytes())
            os.replace(tmp, self.path)
        except OSError as e:
            log.warning("cannot write status file %s: %s", self.path, e)


class Monitor:
    """One thread per rank process, for its whole life. ``begin``/``end`` bracket each iteration's run."""

    def __init__(self, coord: Coordinator, interrupter: Interrupter, *, soft_timeout: float,
                 interval: float, status: StatusFile, watch_main_thread: bool,
                 startup_timeout: float | None = None, hard_timeout: float | None = None,
                 end_process: Callable[[int], object] = exits.leave) -> None:
        self.coord = coord
        self.interrupter = interrupter
        #: How the process ends when its main thread is given up: its streams closed and its logs flushed, within
        #: the exit bound (tests pass a recorder).
        self._end_process = end_process
        self.soft_timeout = soft_timeout
        #: What the agent is told (the status file's ``hard_timeout``): see :func:`~.monitor_rules.kill_limit`.
        self.hard_timeout = hard_timeout
        # Until an iteration's first ping its ranks may wait in the group's first collectives (DDP's parameter
        # broadcast) for a peer that is still starting: the main thread shows no progress there for as long as
        # the slowest peer takes, which the barrier timeout bounds, not the soft timeout.
        self.startup_timeout = max(soft_timeout, startup_timeout or soft_timeout)
        self._pinged = False
        self._generation = 0
        self.interval = interval
        self.status_file = status
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._iteration = -1
        self._ctx: IterationContext | None = None
        self._active: frozenset[int] = frozenset()
        self._running = False
        self._timed_out = False
        #: Since when a delivered interrupt has not freed the main thread, and whether that was spilled for.
        self._stuck_since: float | None = None
        self._spilled = False
        self._abandoned = False
        self._faults: dict[int, FaultRecord] = {}  # the first fault seen in each iteration
        self._causes: dict[int, FaultRecord] = {}  # the iteration's cause as known so far (see DIRECT_KINDS)
        self.last_progress = time.monotonic()
        self.pid = os.getpid()
        self.status = RankStatus(slot=coord.slot, pid=self.pid, state="starting", epoch=coord.epoch,
                                 heartbeat=time.monotonic(), soft_timeout=soft_timeout,
                                 hard_timeout=self._kill_limit())
        self._status_dirty = True
        self._status_written = 0.0
        self._step: int | None = None
        self._step_time: float | None = None
        self._first_step: tuple[int, int, float] | None = None  # (iteration, step, wall time) of its first step
        self._probe = _probe() if watch_main_thread else None
        self._thread = threading.Thread(target=self._run, name=f"stalwart-monitor-{coord.slot}", daemon=True)
        self._marks_sink: Callable[[object], None] = lambda marks: self.update_status(recovery=marks)

    # -- called by the main thread ----------------------------------------------------------------------------

    def start(self) -> None:
        self._thread.start()
        phase_marks.attach(self._marks_sink)

    def stop(self) -> None:
        phase_marks.detach(self._marks_sink)
        self._stop.set()
        # A session whose round was over before it began (a second round sealed during a handover) closes a
        # monitor that never started.
        if self._thread.ident is not None:
            self._thread.join(timeout=10)
        self._flush_status(force=True)

    def begin(self, iteration: int, ctx: IterationContext, active: frozenset[int] = frozenset()) -> None:
        """The iteration's run starts (before Initialize); ``active`` are the slots running it. A fault already
        seen for it interrupts at once."""
        with self._lock:
            self._iteration = iteration
            self._ctx = ctx
            self._active = active
            self._running = True
            self._timed_out = False
            self._stuck_since = None
            self._spilled = False
            self._first_step = None
            self._pinged = False
            self.last_progress = time.monotonic()
            self._generation = self.interrupter.generation  # the wrapper entered user code just before
            seen = self._faults.get(iteration)
        phase_marks.sealed(iteration, self.coord.epoch)
        if seen is not None and of_another(seen, self.coord.slot, self.pid):
            self._interrupt(f"fault in slot {seen.slot}: {seen.kind}", iteration)

    def end(self) -> None:
        with self._lock:
            self._running = False
            self._ctx = None

    def ping(self, step: int | None = None) -> None:
        """Progress from the training code: a few attribute writes, so that it may be called every step. The
        first step of an iteration is kept with its time: it is when training went on after a restart."""
        self.last_progress = time.monotonic()
        self._pinged = True
        if step is not None:
            self._step = step
            self._step_time = time.time()
            if self._first_step is None:
                self._first_step = (self._iteration, step, self._step_time)
                phase_marks.stepped()

    def hung(self, iteration: int) -> bool:
        """Whether this process's own soft timeout fired in ``iteration``: its report is written or on its way, and
        the interrupt follows it. An error the main thread meets meanwhile (its peer, interrupted by that report,
        closed their connections) is the hang's consequence, not a fault to record over the report."""
        with self._lock:
            return self._timed_out and self._iteration == iteration

    def fault_seen(self, iteration: int) -> FaultRecord | None:
        with self._lock:
            return self._faults.get(iteration)

    def update_status(self, **changes: object) -> None:
        with self._lock:
            self.status = self.status.model_copy(update=changes)
            self._status_dirty = True
        if "state" in changes:
            self._flush_status(force=True)

    # -- the thread ---------------------------------------------------------------------------------------------

    def _interrupt(self, reason: str, iteration: int | None = None) -> None:
        """Interrupt the running iteration: ``iteration`` only, when given (the one a report was made in)."""
        with self._lock:
            ctx, running, current, generation = self._ctx, self._running, self._iteration, self._generation
        if not running or ctx is None:
            return
        if not interrupts_current(iteration, current):
            log.info("slot %d: not interrupting iteration %d for what happened in iteration %s: %s",
                     self.coord.slot, current, iteration, reason)
            return
        # The request first: freeing the connections fails this process's own collective at once, and the
        # training thread must then find the interrupt requested, or it takes that failure for a fault of its
        # own and records it over this process's report (a hang then reads as an exception).
        delivered = self.interrupter.request(reason, generation=generation)
        if delivered is None:
            return  # that run ended meanwhile: its connections are gone, the next run's are not ours to free
        free_blocked_peers(ctx)
        if delivered:
            log.info("slot %d iteration %d: interrupting: %s", self.coord.slot, ctx.iteration, reason)

    def _on_fault(self, rec: FaultRecord) -> None:
        with self._lock:
            first = rec.iteration not in self._faults
            if first:
                self._faults[rec.iteration] = rec
            better = better_cause(self._causes.get(rec.iteration), rec)
            if better:
                self._causes[rec.iteration] = rec
            current = self._iteration
        if better:
            self.update_status(last_failure=failure_info(rec))
        if rec.iteration == current and of_another(rec, self.coord.slot, self.pid):
            link = self._link_seen_down(rec)
            self._interrupt(f"fault in slot {rec.slot}: {rec.kind}", rec.iteration)
            if link is not None:  # written once the connections are freed: the interrupt does not wait for etcd
                log.warning("slot %d iteration %d: %s", self.coord.slot, link.iteration, link.reason)
                self._report(link)

    def _link_seen_down(self, peer: FaultRecord) -> Report | None:
        """This end's word on a link a peer's hang report may be about, read before the interrupt frees the
        connections (:func:`~.monitor_rules.link_report`)."""
        with self._lock:
            ctx, iteration, reported = self._ctx, self._iteration, self._timed_out
        if ctx is None or ctx.group.sockets_before is None or peer.kind != "soft_timeout":
            return None
        return link_report(peer, self.coord.slot, iteration=iteration, rank=ctx.rank, reported=reported,
                           unreachable=tuple(retransmitting(ctx.group.sockets_before)))

    def _open_watch(self) -> Watch:
        # One read, not the coordinator's retrying one: the thread must keep ticking during an outage. Only the
        # fault records and the heartbeats' deletions are this thread's business: it is not sent the barrier's
        # arrivals and completion marks (with N ranks, N events for each of N monitors).
        kvs, revision = self.coord.store.get_prefix(self.coord.base + FAULT)
        view = self.coord.parse(kvs, revision)
        for it in view.faults:
            first = view.first_fault(it)
            if first is not None:
                self._on_fault(first)
        return self.coord.store.watch_ranges(
            [WatchRange(self.coord.base + FAULT, prefix=True),
             WatchRange(self.coord.base + ALIVE, prefix=True, no_put=True)], start_revision=revision + 1)

    def _on_event(self, ev: WatchEvent) -> None:
        rel = ev.kv.key[len(self.coord.base):]
        if ev.type == "put" and rel.startswith(FAULT):
            try:
                self._on_fault(FaultRecord.from_json_bytes(ev.kv.value))
            except ValueError as e:
                log.warning("ignoring invalid fault record at %s: %s", ev.kv.key, e)
        elif ev.type == "delete" and rel.startswith(ALIVE):
            with contextlib.suppress(ValueError):
                self._on_peer_lost(int(rel[len(ALIVE):]))

    def _on_peer_lost(self, slot: int) -> None:
        """A peer's heartbeat lease ended (it died without closing its connections, or was cut off)."""
        with self._lock:
            ctx, running, iteration, active = self._ctx, self._running, self._iteration, self._active
        if not running or ctx is None:
            return
        report = lost_peer_report(slot, self.coord.slot, iteration=iteration, rank=ctx.rank, active=active)
        if report is not None:
            self._report_and_interrupt(report)

    def _report(self, report: Report) -> bool:
        """Record ``report``; False only when etcd refused it because the iteration had ended done."""
        try:
            return self.coord.report_fault(report.record(self.coord.slot, self.coord.node_id, time.time(),
                                                         pid=self.pid))
        except Exception as e:  # interrupting matters more than reporting, but a lost report must be seen
            log.warning("slot %d iteration %d: the %s fault was not recorded (%s: %s)", self.coord.slot,
                        report.iteration, report.kind, type(e).__name__, e)
            return True

    def _report_and_interrupt(self, report: Report) -> None:
        if not self._report(report):
            return  # every process returned: a peer that exits after that is no fault, and nothing is left to stop
        # The report may have taken seconds to write (etcd under load): meanwhile a peer's fault may have ended
        # the iteration, and the next one must not be interrupted for this one's hang.
        self._interrupt(report.reason, report.iteration)

    def _run(self) -> None:
        # Ticks (the soft timeout, the probe, the status file) go on at every interval whatever etcd does:
        # an outage only delays the watch's reopening.
        watch: Watch | None = None
        backoff = 0.1
        reopen_at = 0.0
        try:
            while not self._stop.is_set():
                if watch is None and time.monotonic() >= reopen_at:
                    try:
                        watch = self._open_watch()
                        backoff = 0.1
                    except StoreError as e:
                        self.coord.outage.failed(f"fault watch: {e}")  # logged once per outage
                        reopen_at = time.monotonic() + backoff * (0.5 + RNG.random())
                        backoff = min(backoff * 2, 2.0)
                ev = None
                if watch is None:
                    self._stop.wait(self.interval)
                else:
                    try:
                        ev = watch.next(timeout=self.interval)
                    except StoreError as e:
                        self.coord.outage.failed(f"fault watch: {e}")
                        watch.cancel()
                        watch = None
                if ev is not None:
                    self._on_event(ev)
                self._tick()
        finally:
            if watch is not None:
                watch.cancel()

    def _tick(self) -> None:
        stuck = self.interrupter.nudge()
        if stuck:
            self._free_again()
        now = time.monotonic()
        self._act_if_stuck(now, stuck)
        if self._probe is not None:
            answered = self._probe.poll(now)
            if answered is not None:
                self.last_progress = max(self.last_progress, answered)
        with self._lock:
            running, ctx, iteration = self._running, self._ctx, self._iteration
            limit = stall_limit(self.soft_timeout, self.startup_timeout, pinged=self._pinged)
            stalled = running and not self._timed_out and now - self.last_progress > limit
            if stalled:
                self._timed_out = True
        if stalled and ctx is not None:
            which = "soft timeout" if limit == self.soft_timeout else "startup timeout, before the first ping"
            reason = f"no progress for {now - self.last_progress:.1f}s ({which} {limit}s)"
            unreachable: list[str] = []
            if ctx.group.sockets_before is not None:
                # Read before the interrupt frees the connections: what they held says whether the network is
                # at fault (sent bytes retransmitted unacknowledged) rather than a process.
                unreachable = retransmitting(ctx.group.sockets_before)
                if unreachable:
                    reason += (f"; bytes sent to {', '.join(unreachable[:4])} are retransmitted unacknowledged: "
                               "the link to it carries nothing")
            log.warning("slot %d iteration %d: %s", self.coord.slot, iteration, reason)
            if ctx.group.sockets_before is not None:
                log.warning("slot %d iteration %d: its process groups' connections: %s", self.coord.slot, iteration,
                            "; ".join(connection_states(ctx.group.sockets_before)) or "none")
            self._report_and_interrupt(Report(iteration, ctx.rank, "soft_timeout", reason,
                                              unreachable=tuple(unreachable)))
        self._flush_status()

    def _kill_limit(self) -> float | None:
        if self.hard_timeout is None:
            return None
        return kill_limit(self.soft_timeout, self.hard_timeout, self.startup_timeout, pinged=self._pinged)

    def _act_if_stuck(self, now: float, stuck: bool) -> None:
        """A main thread still blocked after its interrupt waits on what no interrupt frees (a transfer gloo does
        not fail): write the snapshots this process holds where the process that takes its place finds them,
        then end this one for its agent to start that one (:func:`~.monitor_rules.when_stuck`)."""
        with self._lock:
            self._stuck_since = (self._stuck_since or now) if stuck else None
            since, iteration = self._stuck_since, self._iteration
            action = when_stuck(None if since is None else now - since, spilled=self._spilled)
            if action == "spill":
                self._spilled = True
            elif action == "abandon" and self._abandoned:
                action = "wait"  # once: the process is on its way out
            elif action == "abandon":
                self._abandoned = True
        blocked = now - (since or now)
        if action == "spill":
            self._spill(iteration, blocked)
        elif action == "abandon":
            self._abandon(iteration, blocked)

    def _abandon(self, iteration: int, blocked: float) -> None:
        log.warning("slot %d iteration %d: the main thread is still blocked %.1fs after its interrupt: ending this "
                    "process (exit code %d) for its agent to start a new one", self.coord.slot, iteration, blocked,
                    ExitCode.ABANDONED)
        self._flush_status(force=True)
        with contextlib.suppress(Exception):  # where the main thread waits, as the agent's kill would dump it
            faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        self._end_process(int(ExitCode.ABANDONED))

    def _spill(self, iteration: int, blocked: float) -> None:
        if not self.status_file.path:
            return
        directory = directory_for(self.status_file.path)
        try:
            written = snapshot_held.spill(directory)
        except (OSError, RuntimeError) as e:
            log.warning("slot %d iteration %d: cannot spill the snapshots this process holds to %s: %s",
                        self.coord.slot, iteration, directory, e)
            return
        if written:
            log.warning("slot %d iteration %d: the main thread is still blocked %.1fs after its interrupt (a transfer "
                        "gloo does not fail); wrote the %d bytes of snapshots it holds to %s for the process that "
                        "takes its place", self.coord.slot, iteration, blocked, written, directory)

    def _free_again(self) -> None:
        """Shut down the group's connections again while a delivered interrupt has not ended the training
        function: a connection opened after the first shutdown (the main thread was inside a C call that
        connects, to a peer that is paused and never answers) would hold it until the collective timeout."""
        with self._lock:
            ctx = self._ctx if self._running else None
        if ctx is not None:
            free_blocked_peers(ctx)

    def _flush_status(self, force: bool = False) -> None:
        now = time.monotonic()
        with self._lock:
            if not force and now - self._status_written < 0.5:
                return
            # Without a probe, progress outside the training function is not seen: the wrapper's own waits
            # have deadlines, so it is taken as progressing there.
            beat = self.last_progress if self._running or self._probe is not None else now
            # The first step belongs to the iteration it was taken in; the next one has none until it steps.
            first = self._first_step if self._first_step and self._first_step[0] == self.status.iteration else None
            snapshot = snapshot_held.published()
            self.status = self.status.model_copy(update={
                "heartbeat": beat, "hard_timeout": self._kill_limit(), "step": self._step, "step_time": self._step_time,
                "stall_limit": stall_limit(self.soft_timeout, self.startup_timeout, pinged=self._pinged),
                "first_step": first[1] if first else None, "first_step_time": first[2] if first else None,
                "snapshot_step": snapshot.step, "snapshot_time": snapshot.time,
                "snapshot_fallback": snapshot.fallback, "written": now, "lease": self.coord.lent_lease or None})
            status = self.status
            self._status_written = now
        self.status_file.write(status)
