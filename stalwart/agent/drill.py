"""The agent's side of ``stalwart drill``: carry out authenticated fault requests on this pod's rank processes.

One thread watches ``JobKeys.drill_requests``. A request for this node is judged by :func:`judge` (pure:
signature under the job's token, job, validity, replay, the job's opt-in) and, if accepted, carried out:

* ``rank-exception``: the rank raises :class:`~stalwart.restart.drill.DrillFault` in its training function
  (signalled by its own agent; only to a process that runs the restart wrapper and said it accepts drills);
* ``rank-kill``: SIGKILL to the rank process;
* ``rank-hang``: the rank process is frozen (SIGSTOP) until its liveness has ended (its alive key gone: its
  agent removes it after the lease's TTL without a status write, as a lease of its own would have run out), as
  a process stuck in the kernel or a paused machine would be, then let go (SIGCONT). Every frozen process is
  let go when the agent stops.

Every request gets an answer under ``results/<id>`` (carried out, or refused and why), bound to the
listener's one result lease (granted at most once per half :data:`RESULT_TTL`, never per request: writing
requests cannot make the agent grant leases). A request is carried out at most once: its id is remembered
from the moment it is accepted until it expires, so a request read again (the answer's write failed and the
watch re-read it on reconnecting) is not carried out again; its answer is written again instead.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from pydantic import ValidationError

from stalwart.agent.settings import PodSettings
from stalwart.api import drill as rank_drill
from stalwart.api.drill import MAX_LIFETIME, DrillRequest, DrillResult
from stalwart.api.job_record import JobRecord
from stalwart.api.restart import RankStatus
from stalwart.etcd.outage import Outage
from stalwart.etcd.store import Store, StoreError, Watch

log = logging.getLogger(__name__)

__all__ = ["CLOCK_SKEW", "RESULT_TTL", "DrillListener", "Target", "judge"]

#: How far in the future a request's ``issued`` may be (clocks of the drill's machine and the pod differ).
CLOCK_SKEW = 30.0
#: Seconds a result's lease lasts: at least half of it is left for each result, longer than any request is
#: valid, so a replay finds it.
RESULT_TTL = 1200


@dataclass(frozen=True, slots=True)
class Target:
    """A live rank process of this pod: its status file (path and last content) and its round's epoch."""

    local_rank: int
    pid: int
    status: RankStatus | None
    epoch: int
    status_file: str


def judge(req: DrillRequest, *, token: bytes | None, job_uid: str, enabled: bool, now: float,
          answered: bool) -> str | None:
    """Why ``req`` must be refused, or None to carry it out. The signature is checked first, so that a caller
    without the job's token learns nothing else."""
    if token is None:
        return "this pod has no job token (STALWART_RPC_TOKEN) to check the request with"
    if not req.verify(token):
        return "the request is not signed with the job's token (the rpc-token of the job's Secret)"
    if req.job_uid != job_uid:
        return f"the request is for job {req.job_uid}, not this one"
    if not enabled:
        return "fault injection is not enabled for this job (spec.faultInjection.enabled: true)"
    if req.expires - req.issued > MAX_LIFETIME:
        return f"the request is valid for longer than {MAX_LIFETIME:g}s"
    if req.issued > now + CLOCK_SKEW:
        return "the request was issued in the future (check the clocks)"
    if now > req.expires:
        return "the request expired"
    if answered:
        return "the request was already answered (a replay)"
    return None


class DrillListener:
    """Watches for drill requests to this node and carries them out on the processes ``targets()`` lists."""

    def __init__(self, store: Store, settings: PodSettings, targets: Callable[[], list[Target]], *,
                 context: str = "") -> None:
        self.store = store
        self.settings = settings
        self.keys = settings.keys
        self.targets = targets
        self.context = context
        self.token = settings.rpc_token.get_secret_value().encode() if settings.rpc_token else None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="stalwart-drill", daemon=True)
        self._frozen: dict[int, threading.Event] = {}
        self._lock = threading.Lock()
        self._workers: list[threading.Thread] = []
        #: Requests accepted, by id: when to forget them (the request's expiry) and their answer once known.
        self._seen: dict[str, tuple[float, DrillResult | None]] = {}
        self._result_lease: tuple[int, float] | None = None  # the lease results are bound to, granted when
        self.outage = Outage("etcd (drill requests)", logger=log, context=context)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        with self._lock:
            for thaw in self._frozen.values():
                thaw.set()
        for t in [self._thread, *self._workers]:
            if t.is_alive():
                t.join(timeout=10)

    # -- the watch ------------------------------------------------------------------------------------------

    def _run(self) -> None:
        prefix = self.keys.drill_requests
        while not self._stop.is_set():
            watch: Watch | None = None
            try:
                kvs, revision = self.store.get_prefix(prefix)
                for kv in kvs:
                    self._on_request(kv.value)
                watch = self.store.watch(prefix, prefix=True, start_revision=revision + 1)
                self.outage.ok()
                while not self._stop.is_set():
                    ev = watch.next(timeout=0.5)
                    if ev is not None and ev.type == "put":
                        self._on_request(ev.kv.value)
            except StoreError as e:
                self._stop.wait(self.outage.failed(e))
            finally:
                if watch is not None:
                    watch.cancel()

    def _on_request(self, value: bytes) -> None:
        try:
            req = DrillRequest.from_json_bytes(value)
        except (ValidationError, ValueError) as e:
            log.warning("%s: ignoring an unreadable drill request: %s", self.context, e)
            return
        if req.node_id != self.settings.node_id:
            return
        result_key = self.keys.drill_result(req.id)
        now = time.time()
        self._seen = {k: v for k, v in self._seen.items() if v[0] >= now}
        if req.id in self._seen:  # accepted before: never carried out twice; its answer written if it was lost
            _, known = self._seen[req.id]
            log.warning("%s: drill request %s read again: not carried out again", self.context, req.id)
            if known is not None and self.store.get(result_key) is None:
                self._answer(result_key, known)
            return
        record = self.store.get(self.keys.job)
        enabled = False
        if record is not None:
            with contextlib.suppress(ValidationError, ValueError):
                enabled = JobRecord.from_json_bytes(record.value).fault_injection
        refusal = judge(req, token=self.token, job_uid=self.settings.job_uid, enabled=enabled, now=now,
                        answered=self.store.get(result_key) is not None)
        if refusal is not None:
            log.warning("%s: refused drill request %s (%s on local rank %d): %s", self.context, req.id, req.kind,
                        req.local_rank, refusal)
            self._answer(result_key, DrillResult(id=req.id, node_id=self.settings.node_id, accepted=False,
                                                 reason=refusal, local_rank=req.local_rank, time=time.time()))
            return
        self._seen[req.id] = (req.expires + CLOCK_SKEW, None)  # before it is carried out: at most once
        result = self._carry_out(req)
        self._seen[req.id] = (req.expires + CLOCK_SKEW, result)
        self._answer(result_key, result)

    def _answer(self, key: str, result: DrillResult) -> None:
        try:
            self.store.put(key, result.to_json_bytes(), lease=self._lease())
        except StoreError as e:
            log.warning("%s: could not answer drill request %s: %s", self.context, result.id, e)

    def _lease(self) -> int:
        """The lease every result is bound to: one, re-granted once half of :data:`RESULT_TTL` has passed (so
        a result lives between half of it and all of it, longer than any request is valid)."""
        now = time.monotonic()
        if self._result_lease is None or now - self._result_lease[1] > RESULT_TTL / 2:
            self._result_lease = (self.store.lease_grant(RESULT_TTL, keepalive=False), now)
        return self._result_lease[0]

    # -- carrying out -----------------------------------------------------------------------------------------

    def _carry_out(self, req: DrillRequest) -> DrillResult:
        target = next((t for t in self.targets() if t.local_rank == req.local_rank), None)

        def answer(accepted: bool, reason: str) -> DrillResult:
            st = target.status if target is not None else None
            return DrillResult(id=req.id, node_id=self.settings.node_id, accepted=accepted, reason=reason,
                               local_rank=req.local_rank, rank=st.rank if st else None, slot=st.slot if st else None,
                               pid=target.pid if target is not None else None, time=time.time())

        if target is None:
            return answer(False, f"local rank {req.local_rank} has no live process on this pod")
        pid, status = target.pid, target.status
        log.warning("%s: drill %s: %s on local rank %d (pid %d)", self.context, req.id, req.kind, req.local_rank,
                    pid)
        if req.kind == "rank-kill":
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            return answer(True, "SIGKILL sent")
        if status is None or status.pid != pid or status.state != "running":
            return answer(False, "the process is not in its training function (it runs no restart wrapper, or it "
                                 "is restarting): try again")
        if req.kind == "rank-exception":
            return answer(*self._raise_in(req, pid, target.status_file))
        return answer(*self._freeze(pid, status, target.epoch))

    def _raise_in(self, req: DrillRequest, pid: int, status_file: str) -> tuple[bool, str]:
        try:
            marker = json.loads(Path(rank_drill.marker_path(status_file)).read_text())
        except (OSError, ValueError):
            marker = {}
        if marker.get("pid") != pid:
            return False, "the process does not accept drill exceptions (it runs no restart wrapper)"
        ack = Path(rank_drill.ack_path(status_file))
        with contextlib.suppress(FileNotFoundError):
            ack.unlink()
        Path(rank_drill.request_path(status_file)).write_text(json.dumps({"id": req.id}))
        try:
            os.kill(pid, rank_drill.DRILL_SIGNAL)
        except ProcessLookupError:
            return False, "the process ended"
        deadline = time.monotonic() + 5.0
        while time.monotonic() < deadline and not self._stop.is_set():
            try:
                got = json.loads(ack.read_text())
            except (OSError, ValueError):
                time.sleep(0.05)
                continue
            if got.get("id") == req.id:
                if got.get("raised"):
                    return True, "DrillFault raised in the training function"
                return False, "the signal arrived outside the training function: try again"
            time.sleep(0.05)
        return False, "the process did not take the signal within 5s (its main thread may be blocked)"

    def _freeze(self, pid: int, status: RankStatus, epoch: int) -> tuple[bool, str]:
        alive_key = f"{self.keys.restart}{epoch}/alive/{status.slot}"
        limit = min(60.0, 0.5 * (status.hard_timeout or 120.0))
        thaw = threading.Event()
        with self._lock:
            self._frozen[pid] = thaw
        try:
            os.kill(pid, signal.SIGSTOP)
        except ProcessLookupError:
            return False, "the process ended"
        worker = threading.Thread(target=self._thaw_later, args=(pid, alive_key, limit, thaw),
                                  name=f"stalwart-drill-thaw-{pid}", daemon=True)
        self._workers = [t for t in self._workers if t.is_alive()] + [worker]
        worker.start()
        return True, (f"frozen (SIGSTOP) until its liveness ends (its alive key gone; at most {limit:g}s), then let go "
                      "(SIGCONT)")

    def _thaw_later(self, pid: int, alive_key: str, limit: float, thaw: threading.Event) -> None:
        deadline = time.monotonic() + limit
        try:
            if self._wait_deleted(alive_key, deadline, thaw):
                thaw.wait(1.0)  # its peers notice within a moment of the key going
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
            with self._lock:
                self._frozen.pop(pid, None)
            log.warning("%s: drill: let the frozen process %d go", self.context, pid)

    def _wait_deleted(self, key: str, deadline: float, stop: threading.Event) -> bool:
        """Until ``key`` is gone (True), ``deadline`` (monotonic) passes or ``stop`` is set (False)."""
        while not stop.is_set() and time.monotonic() < deadline:
            watch: Watch | None = None
            try:
                kv = self.store.get(key, timeout=2.0)
                if kv is None:
                    return True
                watch = self.store.watch(key, start_revision=kv.mod_revision + 1)
                while not stop.is_set() and time.monotonic() < deadline:
                    ev = watch.next(timeout=min(0.5, max(0.0, deadline - time.monotonic())))
                    if ev is not None and ev.type == "delete":
                        return True
            except StoreError:
                stop.wait(0.5)
            finally:
                if watch is not None:
                    watch.cancel()
        return False
