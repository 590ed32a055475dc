"""The etcd side of in-process restart: fault reports, the iteration barrier and its seal, the completion
barrier, heartbeats. Every write is fenced by the round's epoch; every wait is a watch with a deadline.

The key layout is :class:`stalwart.etcd.keys.RestartKeys`, the records :mod:`stalwart.api.restart`'s. This
module only does I/O; what to write and when a wait is over are :mod:`stalwart.restart.protocol`'s decisions.
"""

from __future__ import annotations

import base64
import logging
import os
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Protocol, TypeVar

from stalwart.api.relay import RelayAnswer, RelayRange, RelayRequest
from stalwart.api.restart import ArrivalRecord, DoneRecord, FaultRecord, SealRecord
from stalwart.etcd.faults import end_guard, fault_guard
from stalwart.etcd.fence import Fence
from stalwart.etcd.keys import ARRIVE, DONE, FAULT, JobKeys
from stalwart.etcd.liveness import alive_value, end_liveness, liveness_iterations
from stalwart.etcd.outage import Outage
from stalwart.etcd.store import (
    Compare,
    Delete,
    Get,
    KeyValue,
    LeaseNotFound,
    Put,
    Store,
    StoreTimeout,
    StoreUnavailable,
    Watch,
    WatchEvent,
    WatchRange,
)
from stalwart.jitter import RNG
from stalwart.restart.protocol import EpochView, apply_changes, completes, parse_view, stale_iterations

log = logging.getLogger(__name__)

__all__ = ["CoordinationTimeout", "Coordinator", "Relay"]


class CoordinationTimeout(Exception):
    """A barrier or the completion wait did not finish before its deadline."""


T = TypeVar("T")

#: How often a wait looks again at its condition when etcd is silent.
_TICK = 0.2


class Relay(Protocol):
    """Who sends a barrier request to etcd together with the pod's other ranks' (the agent's relay,
    :class:`stalwart.restart.relay.RelayClient`): its answer, or ``None`` when this process must go itself."""

    def ask(self, request: RelayRequest) -> RelayAnswer | None: ...


class Coordinator:
    """One rank process's view of its epoch's restart prefix. Thread-safe (etcd calls only).

    ``lease_ttl`` is the heartbeat: the process's ``alive`` key and its barrier arrivals are bound to a
    lease of that many seconds. With a ``relay`` it is the pod's lease its agent lends (one keep-alive per
    pod, and the agent ends the keys of a rank that dies or stops: :mod:`stalwart.etcd.liveness`); without one,
    or when the agent lends none, a lease of the process's own, kept alive by the Store. Each etcd call that
    fails because etcd is unreachable (``StoreUnavailable``, ``StoreTimeout``) is retried with jittered
    exponential backoff for up to ``retry_for`` seconds, then the error is raised: every call here may be
    repeated safely (puts of the same value; the seal is create-if-absent and reads back whichever seal won).

    With a ``relay``, the barrier's two requests per rank (the read of the cause, the arrival with the read
    its wait starts from) go to etcd in one transaction with the pod's other ranks' (:mod:`stalwart.api.relay`);
    whatever the relay does not answer, this process asks etcd itself.
    """

    def __init__(self, store: Store, keys: JobKeys, epoch: int, *, slot: int, node_id: str,
                 lease_ttl: int = 10, retry_for: float = 30.0, relay: Relay | None = None) -> None:
        self.store = store
        self.keys = keys
        self.epoch = epoch
        self.slot = slot
        self.node_id = node_id
        self.lease_ttl = lease_ttl
        self.fence = Fence(store, keys, epoch)
        self.round_keys = keys.restart_round(epoch)
        self.base = self.round_keys.base
        self.lease = 0
        #: The lease when it is the pod's, lent by the agent (0: the process's own, or none yet).
        self.lent_lease = 0
        #: The last iteration this process arrived at (-1: none): on a lent lease it takes back its arrivals
        #: about it when it stops (older ones the sealers removed: ``stale_iterations``).
        self._arrived = -1
        self.retry_for = retry_for
        self.relay = relay
        # One log line when etcd becomes unreachable and one when it is back, however many calls retry meanwhile.
        self.outage = Outage("etcd", logger=log, context=f"slot {slot} epoch {epoch}")

    def _retry(self, what: str, fn: Callable[[], T]) -> T:
        deadline = time.monotonic() + self.retry_for
        backoff = 0.05
        while True:
            try:
                result = fn()
            except (StoreUnavailable, StoreTimeout) as e:
                if time.monotonic() + backoff > deadline:
                    raise
                self.outage.failed(f"{what}: {e}")
                time.sleep(backoff * (0.5 + RNG.random()))
                backoff = min(backoff * 2, 1.0)
            else:
                self.outage.ok()
                return result

    # -- reading ----------------------------------------------------------------------------------------------

    def view(self, parts: Sequence[WatchRange] | None = None) -> EpochView:
        """The round's restart prefix as etcd holds it now; with ``parts`` (keys or prefixes relative to it),
        only those, read at one revision (the rest of the view is empty; a part with ``no_put`` is not read)."""
        if parts is None:
            kvs, revision = self._retry("read", lambda: self.store.get_prefix(self.base))
            return self.parse(kvs, revision)
        # A part watched for its deletions only has nothing to read: what exists now is not its business.
        reads = [Get(self.base + p.key, prefix=p.prefix) for p in parts if not p.no_put]
        res = self._retry("read", lambda: self.store.txn((), reads))
        return self.parse([kv for got in res.responses for kv in got], res.revision)

    def faults(self, iteration: int, *, pod: bool = False) -> EpochView:
        """A view holding only the fault records of ``iteration``. With ``pod``, read through the relay together
        with the pod's other ranks, when there is one: for a read every rank makes at the same moment (the
        cause, at the barrier), not for one a rank makes alone (the relay would wait for the others first)."""
        relayed = self._relayed(self.faults_request(iteration)) if pod else None
        return relayed if relayed is not None else self.view([WatchRange(f"{FAULT}{iteration}/", prefix=True)])

    def faults_request(self, iteration: int) -> RelayRequest:
        """What :meth:`faults` asks the relay."""
        return RelayRequest(epoch=self.epoch, iteration=iteration,
                            reads=[RelayRange(key=f"{FAULT}{iteration}/", prefix=True)])

    def arrival_request(self, iteration: int, rec: ArrivalRecord, read: Sequence[WatchRange]) -> RelayRequest:
        """What :meth:`arrive` asks the relay: the arrival, bound to this process's lease, and ``read``."""
        return RelayRequest(epoch=self.epoch, iteration=iteration, arrival=rec, lease=self.lease,
                            reads=[RelayRange(key=p.key, prefix=p.prefix) for p in read if not p.no_put])

    def answered(self, answer: RelayAnswer) -> EpochView:
        """The view the relay's ``answer`` holds: what its reads returned, at the transaction's revision."""
        return self._parse(((v.key, base64.b64decode(v.value, validate=True), v.mod_revision)
                            for got in answer.values for v in got), answer.revision)

    def _relayed(self, request: RelayRequest) -> EpochView | None:
        answer = self.relay.ask(request) if self.relay is not None else None
        if answer is None:
            return None
        try:
            if len(answer.values) != len(request.reads) or answer.revision < 1:
                raise ValueError(f"{len(answer.values)} reads at revision {answer.revision} for "
                                 f"{len(request.reads)} asked")
            return self.answered(answer)
        except ValueError as e:  # the request is made again, alone
            log.warning("slot %d: unreadable answer from the barrier relay: %s", self.slot, e)
            return None

    def parse(self, kvs: list[KeyValue], revision: int) -> EpochView:
        return self._parse(((kv.key[len(self.base):], kv.value, kv.mod_revision) for kv in kvs), revision)

    def _parse(self, items: Iterable[tuple[str, bytes, int]], revision: int) -> EpochView:
        view, problems = parse_view(items, revision)
        for key, why in problems.items():
            log.warning("epoch %d: ignoring invalid record at %s%s: %s", self.epoch, self.base, key, why)
        return view

    # -- writing (fenced) -------------------------------------------------------------------------------------

    def start(self, gone: int = 0) -> None:
        """Take the heartbeat lease (the pod's, or a new one of its own; ``gone``: a lease etcd no longer has)
        and publish this process's ``alive`` key."""
        for last in (False, True):
            lent = self._borrow(gone)
            if lent:
                self.lease = self.lent_lease = lent
            else:
                self.lent_lease = 0
                self.lease = self._retry("lease grant", lambda: self.store.lease_grant(self.lease_ttl))
            try:
                self._put_alive()
                return
            except LeaseNotFound:
                if not lent or last:
                    raise
                # The pod's lease ended before its agent's keep-alive noticed: said so, the agent grants a new one.
                gone = lent

    def _put_alive(self) -> None:
        self._retry("heartbeat put", lambda: self.fence.put(self.round_keys.alive(self.slot), self._alive(),
                                                             lease=self.lease))

    def _alive(self) -> bytes:
        return alive_value(self.slot, self.node_id, os.getpid())

    def _borrow(self, gone: int) -> int:
        """The pod's lease, as the agent lends it through the relay (0: it lends none)."""
        if self.relay is None:
            return 0
        answer = self.relay.ask(RelayRequest(epoch=self.epoch, iteration=0, lease_ttl=self.lease_ttl, lease=gone))
        return answer.lease if answer is not None else 0

    def stop(self) -> None:
        """End this process's liveness: the ``alive`` key and pending arrivals go at once (its own lease revoked,
        or, on the pod's, its keys deleted while they are still its own)."""
        if self.lent_lease:
            try:
                end_liveness(self.store, self.keys, self.epoch, slot=self.slot, node_id=self.node_id,
                             pid=os.getpid(), iterations=liveness_iterations(self._arrived)
                             if self._arrived >= 0 else (), timeout=5.0)
            except Exception as e:  # its agent ends them when it sees the process gone
                log.warning("slot %d: could not remove its alive key: %s", self.slot, e)
            self.lease = self.lent_lease = 0
        elif self.lease:
            try:
                self.store.lease_revoke(self.lease)
            except Exception as e:  # the lease then expires by itself
                log.warning("slot %d: could not revoke heartbeat lease: %s", self.slot, e)
            self.lease = 0

    def report_fault(self, rec: FaultRecord) -> bool:
        """Publish a fault of this process in ``rec.iteration`` (overwrites its earlier one there) unless the
        iteration ended done (:mod:`stalwart.etcd.faults`: it ends once). Returns whether it was written."""
        key = self.round_keys.fault(rec.iteration, self.slot)
        res = self._retry("fault report", lambda: self.fence.txn(
            [fault_guard(self.round_keys, rec.iteration)], [Put(key, rec.to_json_bytes())]))
        if not res.succeeded:
            log.info("slot %d iteration %d: not reported (%s): every process had returned, the iteration ended done",
                     self.slot, rec.iteration, rec.kind)
        return res.succeeded

    def ensure_lease(self) -> None:
        """Re-grant the heartbeat lease and re-publish the ``alive`` key if etcd dropped the lease (this
        process was cut off for longer than its TTL, or the lease was revoked): the peers saw it leave and
        restarted without it; it comes back at the next barrier."""
        if self.lease and self.lease not in self.store.lost_leases() \
                and self._retry("lease ttl", lambda: self.store.lease_ttl(self.lease)) > 0:
            return
        log.warning("slot %d: heartbeat lease lost; taking a new one", self.slot)
        self.start(gone=self.lease)

    def arrive(self, iteration: int, rec: ArrivalRecord, read: Sequence[WatchRange] | None = (), *,
               relay_read: bool = True) -> EpochView:
        """Arrive at the barrier of ``iteration``: one write, bound to the heartbeat lease, and in the same
        request a read of ``read`` (parts of the prefix, as :meth:`view` takes them; ``None``: the whole
        prefix; by default nothing) whose view, as of the arrival, is returned: what a wait after it starts
        from.

        A lease etcd no longer has (this process was cut off past its TTL; the keepalive may not have noticed
        yet) is re-granted when etcd refuses the arrival for it, so the common case costs no lease read.

        With a relay the arrival goes through it, and ``read`` with it unless ``relay_read`` is false or it is
        the whole prefix: the sealer's read is made afterwards, directly (it is large and one process's alone).
        The sealer's arrival still goes through the relay, or the pod's other ranks would wait for it there
        until the relay's linger ends."""
        if not self.lease or self.lease in self.store.lost_leases():
            self.ensure_lease()
        self._arrived = max(self._arrived, iteration)
        if self.relay is not None:
            carried = read is not None and relay_read
            relayed = self._relayed(self.arrival_request(iteration, rec, (read or ()) if carried else ()))
            if relayed is not None:
                return relayed if carried else self.view(read)
        key = self.round_keys.arrival(iteration, self.slot)
        parts = list(read) if read is not None else [WatchRange("", prefix=True)]
        reads = [Get(self.base + p.key, prefix=p.prefix) for p in parts if not p.no_put]

        def write() -> EpochView:
            # On the pod's lease the agent may have ended this process's alive key (it stopped writing its status
            # for the TTL, and came back): it comes back with its arrival, as with a lease of its own it would.
            again = [Put(self.round_keys.alive(self.slot), self._alive(), self.lease)] if self.lent_lease else []
            res = self.fence.txn((), [*again, Put(key, rec.to_json_bytes(), self.lease), *reads])
            return self.parse([kv for got in res.responses[1 + len(again):] for kv in got], res.revision)

        try:
            return self._retry("arrival", write)
        except LeaseNotFound:
            log.warning("slot %d: heartbeat lease lost; taking a new one", self.slot)
            self.start(gone=self.lease)
            return self._retry("arrival", write)

    def mark_done(self, seal: SealRecord) -> bool:
        """Mark this process's function returned in the iteration of ``seal``, counting the marks in the same
        request; the process whose mark is the last of the iteration's active processes also writes its END
        record, the one key the others wait for (:func:`~.protocol.completes`), unless a fault of the iteration was
        reported first (:mod:`stalwart.etcd.faults`: it ends once). Returns whether it wrote END."""
        iteration = seal.iteration
        rec = DoneRecord(slot=self.slot, iteration=iteration).to_json_bytes()
        marks = Get(self.round_keys.of_iteration(DONE, iteration), prefix=True, count_only=True)
        res = self._retry("completion", lambda: self.fence.txn(
            (), [Put(self.round_keys.done(iteration, self.slot), rec), marks]))
        if not completes(res.counts[1], seal):
            return False
        end = self._retry("completion end", lambda: self.fence.txn(
            [end_guard(self.round_keys, iteration)], [Put(self.round_keys.end(iteration), rec)]))
        if not end.succeeded:
            log.info("slot %d iteration %d: every process returned, but a fault was reported first: the iteration "
                     "ended faulted", self.slot, iteration)
        return end.succeeded

    def try_seal(self, seal: SealRecord) -> SealRecord:
        """Write ``seal`` unless one exists for its iteration; return the seal that holds (mine or theirs).

        The sealer also deletes the keys of iterations before the previous one, and their torch Stores.
        """
        key = self.round_keys.seal(seal.iteration)
        ops: list[Put | Delete] = [Put(key, seal.to_json_bytes())]
        res = self._retry("seal", lambda: self.fence.txn([Compare(key, "create", "==", 0)], ops, [Get(key)]))
        if not res.succeeded:
            return SealRecord.from_json_bytes(res.responses[0][0].value)
        self._cleanup_before(seal.iteration)
        return seal

    def _cleanup_before(self, sealed: int) -> None:
        stale = stale_iterations(sealed)
        if not stale:
            return
        keys = self.round_keys
        ops: list[Put | Delete] = []
        for it in stale:
            ops += [Delete(keys.of_iteration(kind, it), prefix=True) for kind in (ARRIVE, FAULT, DONE)]
            ops.append(Delete(keys.seal(it)))
            ops.append(Delete(keys.end(it)))
            ops.append(Delete(keys.torch_store_of(it), prefix=True))
        try:
            self.fence.txn((), ops)
        except Exception as e:  # cleanup is best-effort; the next sealer retries the same range
            log.warning("epoch %d: cleanup before iteration %d failed: %s", self.epoch, sealed - 1, e)

    # -- waiting ----------------------------------------------------------------------------------------------

    def _watch(self, parts: Sequence[WatchRange], start: int) -> Watch:
        ranges = [WatchRange(self.base + p.key, prefix=p.prefix, no_put=p.no_put) for p in parts]
        return self._retry("watch", lambda: self.store.watch_ranges(ranges, start_revision=start))

    def _apply(self, view: EpochView, events: list[WatchEvent]) -> EpochView:
        changes = [(ev.kv.key[len(self.base):], ev.kv.value if ev.type == "put" else None, ev.kv.mod_revision)
                   for ev in events]
        new, problems = apply_changes(view, changes, max(view.revision, events[-1].kv.mod_revision))
        for key, why in problems.items():
            log.warning("epoch %d: ignoring invalid record at %s%s: %s", self.epoch, self.base, key, why)
        return new

    def wait_until(self, done: Callable[[EpochView], object], deadline: float | None,
                   parts: Sequence[WatchRange] | None = None, *, start: EpochView | None = None,
                   notice: Callable[[list[WatchEvent]], None] | None = None) -> tuple[EpochView, object]:
        """Read the prefix (or only ``parts`` of it, see :meth:`view`) once, unless ``start`` is that read
        already (from :meth:`arrive`), then keep that view current from a watch on the same parts (events
        applied, not re-read), until ``done(view)`` returns a truthy value (returned with the view) or
        ``deadline`` (monotonic) passes (:class:`CoordinationTimeout`).

        Narrow ``parts`` keep what etcd sends this process to what ``done`` looks at: a rank that waits for
        one key is not sent every other rank's records. ``notice`` is shown each batch of events first (a
        deletion of a key the view does not hold changes nothing in it).
        """
        watched = list(parts) if parts is not None else [WatchRange("", prefix=True)]
        view = start if start is not None else self.view(parts)
        result = done(view)
        if result:
            return view, result
        watch = self._watch(watched, view.revision + 1)
        try:
            while True:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise CoordinationTimeout("deadline passed")
                try:
                    ev = watch.next(timeout=min(left, _TICK) if left is not None else _TICK)
                    batch = [] if ev is None else [ev]
                    # Take what else arrived, and decide once for the lot.
                    while ev is not None and (ev := watch.next(timeout=0)) is not None:
                        batch.append(ev)
                except (StoreUnavailable, StoreTimeout) as e:
                    # The stream broke (etcd restarting): read again and watch again from there.
                    self.outage.failed(f"watch: {e}")
                    watch.cancel()
                    view = self.view(parts)
                    result = done(view)
                    if result:
                        return view, result
                    watch = self._watch(watched, view.revision + 1)
                    continue
                # Without changes ``done`` is still asked: it may also look at the process's own state (a
                # handover to a newer round).
                if batch:
                    if notice is not None:
                        notice(batch)
                    view = self._apply(view, batch)
                result = done(view)
                if result:
                    return view, result
        finally:
            watch.cancel()
