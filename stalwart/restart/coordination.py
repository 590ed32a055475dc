"""The etcd side of in-process restart: fault reports, the iteration barrier and its seal, the completion
barrier, heartbeats. Every write is fenced by the round's epoch; every wait is a watch with a deadline.

The key layout is documented in :mod:`stalwart.api.restart`. This module only does I/O; the decisions
(who runs which rank) are :mod:`stalwart.restart.assignment`'s and are passed in.
"""

from __future__ import annotations

import logging
import os
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypeVar

from stalwart.api.restart import DIRECT_KINDS, AliveRecord, ArrivalRecord, DoneRecord, FaultRecord, SealRecord
from stalwart.etcd.fence import Fence
from stalwart.etcd.keys import JobKeys
from stalwart.etcd.outage import Outage
from stalwart.etcd.store import Compare, Delete, Get, KeyValue, Put, Store, StoreTimeout, StoreUnavailable, Watch

log = logging.getLogger(__name__)

__all__ = ["CoordinationTimeout", "Coordinator", "EpochView", "IterationOutcome", "barrier_complete", "record_fault"]


class CoordinationTimeout(Exception):
    """A barrier or the completion wait did not finish before its deadline."""


@dataclass(slots=True)
class EpochView:
    """What etcd holds for one epoch's restart prefix, parsed. Invalid records are skipped (and logged)."""

    revision: int = 0
    alive: dict[int, AliveRecord] = field(default_factory=dict)
    arrivals: dict[int, dict[int, ArrivalRecord]] = field(default_factory=dict)
    seals: dict[int, SealRecord] = field(default_factory=dict)
    faults: dict[int, list[tuple[int, FaultRecord]]] = field(default_factory=dict)  # it -> [(rev, rec)]
    done: dict[int, set[int]] = field(default_factory=dict)

    def first_fault(self, iteration: int) -> FaultRecord | None:
        faults = sorted(self.faults.get(iteration, []), key=lambda f: f[0])
        return faults[0][1] if faults else None

    def cause(self, iteration: int) -> FaultRecord | None:
        """The iteration's cause: its first fault of a kind seen at the faulty process (``DIRECT_KINDS``),
        else its first fault."""
        faults = [rec for _, rec in sorted(self.faults.get(iteration, []), key=lambda f: f[0])]
        return next((rec for rec in faults if rec.kind in DIRECT_KINDS), faults[0] if faults else None)

    def faults_of_others(self, iteration: int, slot: int) -> list[FaultRecord]:
        """The faults recorded in ``iteration`` by processes other than ``slot``, oldest first."""
        return [rec for _, rec in sorted(self.faults.get(iteration, []), key=lambda f: f[0]) if rec.slot != slot]


IterationOutcome = str  # "done" | "fault"


def barrier_complete(view: EpochView, iteration: int, slots: int) -> bool:
    """Whether every slot the barrier of ``iteration`` waits for has arrived. Pure.

    A slot that took no part in the last iteration and has no live process is not waited for again.
    Arrivals are bound to their process's lease and vanish with it, so the last seal (which is not) also
    says who took part: a process cut off from etcd for a moment is waited for, and comes back with a new
    lease, instead of being dropped from the world.
    """
    expected = set(range(slots))
    previous = view.arrivals.get(iteration - 1)
    if previous is not None:
        took_part = set(previous)
        last_seal = view.seals.get(iteration - 1)
        if last_seal is not None:
            took_part |= {int(s) for s in last_seal.ranks} | set(last_seal.inactive)
        expected -= {s for s in expected if s not in took_part and s not in view.alive}
    return expected <= set(view.arrivals.get(iteration, {}))


def fault_key(keys: JobKeys, epoch: int, iteration: int, slot: int) -> str:
    return f"{keys.restart}{epoch}/fault/{iteration}/{slot}"


def record_fault(store: Store, keys: JobKeys, epoch: int, rec: FaultRecord) -> bool:
    """Publish ``rec`` as the fault of slot ``rec.slot`` in its iteration, fenced by ``epoch``, unless that slot
    recorded one there already (which says more: e.g. the exception before the process died): what an agent
    does for a rank process it found dead, stopped or hung. Returns whether it was written."""
    key = fault_key(keys, epoch, rec.iteration, rec.slot)
    return Fence(store, keys, epoch).txn([Compare(key, "create", "==", 0)], [Put(key, rec.to_json_bytes())]).succeeded


T = TypeVar("T")

#: How often a wait looks again at its condition when etcd is silent.
_TICK = 0.2


class Coordinator:
    """One rank process's view of its epoch's restart prefix. Thread-safe (etcd calls only).

    ``lease_ttl`` is the heartbeat: the process's ``alive`` key and its barrier arrivals are bound to a
    lease of that many seconds, kept alive by the Store. Each etcd call that fails because etcd is
    unreachable (``StoreUnavailable``, ``StoreTimeout``) is retried with jittered exponential backoff for up
    to ``retry_for`` seconds, then the error is raised: every call here may be repeated safely (puts of
    the same value; the seal is create-if-absent and reads back whichever seal won).
    """

    def __init__(self, store: Store, keys: JobKeys, epoch: int, *, slot: int, node_id: str,
                 lease_ttl: int = 10, retry_for: float = 30.0) -> None:
        self.store = store
        self.keys = keys
        self.epoch = epoch
        self.slot = slot
        self.node_id = node_id
        self.lease_ttl = lease_ttl
        self.fence = Fence(store, keys, epoch)
        self.base = f"{keys.restart}{epoch}/"
        self.lease = 0
        self.retry_for = retry_for
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
                time.sleep(backoff * (0.5 + random.random()))
                backoff = min(backoff * 2, 1.0)
            else:
                self.outage.ok()
                return result

    # -- keys -----------------------------------------------------------------------------------------------

    def alive_key(self, slot: int) -> str:
        return f"{self.base}alive/{slot}"

    def arrive_key(self, iteration: int, slot: int) -> str:
        return f"{self.base}arrive/{iteration}/{slot}"

    def seal_key(self, iteration: int) -> str:
        return f"{self.base}seal/{iteration}"

    def fault_key(self, iteration: int, slot: int) -> str:
        return fault_key(self.keys, self.epoch, iteration, slot)

    def done_key(self, iteration: int, slot: int) -> str:
        return f"{self.base}done/{iteration}/{slot}"

    def torch_store_prefix(self, iteration: int) -> str:
        return f"{self.keys.torch_store(self.epoch)}{iteration}/"

    # -- reading ----------------------------------------------------------------------------------------------

    def view(self) -> EpochView:
        kvs, revision = self._retry("read", lambda: self.store.get_prefix(self.base))
        return self.parse(kvs, revision)

    def parse(self, kvs: list[KeyValue], revision: int) -> EpochView:
        v = EpochView(revision=revision)
        for kv in kvs:
            parts = kv.key[len(self.base):].split("/")
            try:
                kind = parts[0]
                if kind == "alive" and len(parts) == 2:
                    v.alive[int(parts[1])] = AliveRecord.from_json_bytes(kv.value)
                elif kind == "arrive" and len(parts) == 3:
                    v.arrivals.setdefault(int(parts[1]), {})[int(parts[2])] = \
                        ArrivalRecord.from_json_bytes(kv.value)
                elif kind == "seal" and len(parts) == 2:
                    v.seals[int(parts[1])] = SealRecord.from_json_bytes(kv.value)
                elif kind == "fault" and len(parts) == 3:
                    v.faults.setdefault(int(parts[1]), []).append(
                        (kv.mod_revision, FaultRecord.from_json_bytes(kv.value)))
                elif kind == "done" and len(parts) == 3:
                    v.done.setdefault(int(parts[1]), set()).add(int(parts[2]))
            except ValueError as e:
                log.warning("epoch %d: ignoring invalid record at %s: %s", self.epoch, kv.key, e)
        return v

    # -- writing (fenced) -------------------------------------------------------------------------------------

    def start(self) -> None:
        """Grant the heartbeat lease and publish this process's ``alive`` key."""
        self.lease = self._retry("lease grant", lambda: self.store.lease_grant(self.lease_ttl))
        rec = AliveRecord(slot=self.slot, node_id=self.node_id, pid=os.getpid())
        self._retry("heartbeat put", lambda: self.fence.put(self.alive_key(self.slot), rec.to_json_bytes(),
                                                             lease=self.lease))

    def stop(self) -> None:
        """Revoke the lease: the ``alive`` key and pending arrivals go at once."""
        if self.lease:
            try:
                self.store.lease_revoke(self.lease)
            except Exception as e:  # the lease then expires by itself
                log.warning("slot %d: could not revoke heartbeat lease: %s", self.slot, e)
            self.lease = 0

    def report_fault(self, rec: FaultRecord) -> None:
        """Publish a fault of this process in ``rec.iteration`` (overwrites its earlier one there)."""
        self._retry("fault report", lambda: self.fence.put(self.fault_key(rec.iteration, self.slot),
                                                           rec.to_json_bytes()))

    def ensure_lease(self) -> None:
        """Re-grant the heartbeat lease and re-publish the ``alive`` key if etcd dropped the lease (this
        process was cut off for longer than its TTL, or the lease was revoked): the peers saw it leave and
        restarted without it; it comes back at the next barrier."""
        if self.lease and self.lease not in self.store.lost_leases() \
                and self._retry("lease ttl", lambda: self.store.lease_ttl(self.lease)) > 0:
            return
        log.warning("slot %d: heartbeat lease lost; granting a new one", self.slot)
        self.start()

    def arrive(self, iteration: int, rec: ArrivalRecord) -> None:
        self.ensure_lease()
        self._retry("arrival", lambda: self.fence.put(self.arrive_key(iteration, self.slot), rec.to_json_bytes(),
                                                      lease=self.lease))

    def mark_done(self, iteration: int) -> None:
        rec = DoneRecord(slot=self.slot, iteration=iteration)
        self._retry("completion", lambda: self.fence.put(self.done_key(iteration, self.slot),
                                                         rec.to_json_bytes()))

    def try_seal(self, seal: SealRecord) -> SealRecord:
        """Write ``seal`` unless one exists for its iteration; return the seal that holds (mine or theirs).

        The sealer also deletes the keys of iterations before the previous one, and their torch Stores.
        """
        key = self.seal_key(seal.iteration)
        ops: list[Put | Delete] = [Put(key, seal.to_json_bytes())]
        res = self._retry("seal", lambda: self.fence.txn([Compare(key, "create", "==", 0)], ops, [Get(key)]))
        if not res.succeeded:
            return SealRecord.from_json_bytes(res.responses[0][0].value)
        self._cleanup_before(seal.iteration - 1)
        return seal

    def _cleanup_before(self, iteration: int) -> None:
        if iteration <= 0:
            return
        ops: list[Put | Delete] = []
        for it in range(max(0, iteration - 2), iteration):
            for kind in ("arrive", "fault", "done"):
                ops.append(Delete(f"{self.base}{kind}/{it}/", prefix=True))
            ops.append(Delete(self.seal_key(it)))
            ops.append(Delete(self.torch_store_prefix(it), prefix=True))
        try:
            self.fence.txn((), ops)
        except Exception as e:  # cleanup is best-effort; the next sealer retries the same range
            log.warning("epoch %d: cleanup before iteration %d failed: %s", self.epoch, iteration, e)

    # -- waiting ----------------------------------------------------------------------------------------------

    def _watch(self, sub: str, start: int) -> Watch:
        return self._retry("watch", lambda: self.store.watch(self.base + sub, prefix=True, start_revision=start))

    def wait_until(self, done: Callable[[EpochView], object], deadline: float | None,
                   sub: str = "") -> tuple[EpochView, object]:
        """Re-read the prefix whenever something under ``base + sub`` changes, until ``done(view)`` returns a
        truthy value (returned with the view) or ``deadline`` (monotonic) passes (:class:`CoordinationTimeout`).
        """
        view = self.view()
        result = done(view)
        if result:
            return view, result
        watch = self._watch(sub, view.revision + 1)
        try:
            while True:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise CoordinationTimeout("deadline passed")
                try:
                    ev = watch.next(timeout=min(left, _TICK) if left is not None else _TICK)
                except (StoreUnavailable, StoreTimeout) as e:
                    # The stream broke (etcd restarting): re-read and watch again from there.
                    self.outage.failed(f"watch: {e}")
                    watch.cancel()
                    view = self.view()
                    result = done(view)
                    if result:
                        return view, result
                    watch = self._watch(sub, view.revision + 1)
                    continue
                if ev is None:
                    # Nothing changed in etcd; ``done`` may also look at the process's own state (a handover
                    # to a newer round), so it is asked again on the last view.
                    result = done(view)
                    if result:
                        return view, result
                    continue
                # Drain what else arrived before re-reading once.
                while watch.next(timeout=0) is not None:
                    pass
                view = self.view()
                result = done(view)
                if result:
                    return view, result
        finally:
            watch.cancel()
