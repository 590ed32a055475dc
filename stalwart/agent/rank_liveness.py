"""The ranks' liveness on the pod's lease: one lease, kept alive by the agent, for the ``alive`` keys and barrier
arrivals of all of its rank processes.

Each rank process used to hold a heartbeat lease of its own, refreshed every third of its TTL: at 16,384 ranks
that is 4,915 refreshes a second, more than one etcd serves beside a barrier (docs/scale.md). The agent lends
its ranks one lease instead (through the barrier relay: :class:`PodLease`), its node's own rendezvous lease
where the TTLs agree (by default), so that a pod refreshes one lease, and does what the end of a rank's
own lease did, since the pod's outlives a rank: it deletes a rank's keys when the process dies, or when it stops
writing its status file (which its monitor thread writes twice a second) for the lease's TTL, as a process
stopped by SIGSTOP, or frozen, stops refreshing a lease of its own (:func:`silent`,
:func:`stalwart.etcd.liveness.end_liveness`). A rank that comes back puts its ``alive`` key again with its next
arrival. When the agent itself goes, the pod's lease ends with it, and every one of its ranks' keys with it.

Three parts, as everywhere in the agent: :func:`silent` decides, :class:`PodLease` holds the lease,
:class:`RankLiveness` acts (the runner tells it of every rank that died or that it killed, and asks it each
poll to look for silent ones).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from stalwart.api.restart import RankStatus
from stalwart.etcd.keys import JobKeys
from stalwart.etcd.liveness import end_liveness, liveness_iterations
from stalwart.etcd.store import Store, StoreError

log = logging.getLogger(__name__)

__all__ = ["PodLease", "Quiet", "RankLiveness", "silent"]


@dataclass(frozen=True, slots=True)
class Quiet:
    """One running rank process as :func:`silent` sees it: when its status file was last written (CLOCK_MONOTONIC;
    ``None``: never, or not by a monitor that says so), whether its alive key is on the pod's lease, and whether
    its liveness was ended already since that write."""

    local_rank: int
    written: float | None
    on_pod_lease: bool
    ended: bool = False


def silent(procs: Sequence[Quiet], *, now: float, ttl: float) -> list[int]:
    """The local ranks whose liveness to end now: on the pod's lease, their status file unwritten for longer than
    the lease's TTL (as long as a lease of their own would have outlived them), not ended already."""
    return [p.local_rank for p in procs
            if p.on_pod_lease and not p.ended and p.written is not None and now - p.written > ttl]


class PodLease:
    """The lease the agent lends its rank processes (thread-safe). When the rank asks for the TTL of the pod's
    rendezvous lease (``node``: that lease, or None while it has none, and its TTL), it is lent that one, so that
    a pod keeps one lease alive for its membership and its ranks' liveness alike (each is what tells the others
    the pod is gone: a node's keep-alives stop with its ranks'); otherwise one of its own is granted on the first
    request with the TTL the rank asks for (its ``heartbeat_ttl``: every rank of a pod runs the same script),
    kept alive by the agent's Store, granted again when etcd lost it."""

    def __init__(self, store: Store, *, node: Callable[[], tuple[int | None, int]] | None = None,
                 context: str = "") -> None:
        self.store = store
        self.context = context
        self.node = node
        #: The lease lent last (the node's or this object's own; 0: none yet).
        self.lease = 0
        self.ttl = 0
        self._own = 0
        self._own_ttl = 0
        #: Every lease lent since the agent started: a rank may still be on one lent before the last.
        self._lent: set[int] = set()
        self._lock = threading.Lock()

    def lend(self, ttl: int, gone: int = 0, *, timeout: float | None = None) -> int:
        """The pod's lease; ``gone`` is one a rank found etcd no longer has (checked, then replaced)."""
        if ttl < 1:
            raise ValueError(f"ttl: expected seconds >= 1, got {ttl}")
        with self._lock:
            node, node_ttl = self.node() if self.node is not None else (None, 0)
            if node and node_ttl == ttl and self._holds(node, gone, timeout):
                if node != self.lease:
                    log.info("%s: the ranks' liveness is on the pod's rendezvous lease %x (TTL %d s)", self.context,
                             node, ttl)
                self._lent.add(node)
                self.lease, self.ttl = node, ttl
                return node
            if not (self._own and self._holds(self._own, gone, timeout)):
                if self._own:
                    log.warning("%s: the ranks' lease %x was lost; granting a new one", self.context, self._own)
                # Granted again with the TTL it was first granted with: the silence rule reads it (``ttl``).
                self._own_ttl = self._own_ttl or ttl
                self._own = self.store.lease_grant(self._own_ttl, timeout=timeout)
                log.info("%s: the ranks' liveness is on lease %x (TTL %d s)", self.context, self._own, self._own_ttl)
            self._lent.add(self._own)
            self.lease, self.ttl = self._own, self._own_ttl
            return self._own

    def lent(self, lease: int | None) -> bool:
        """Whether ``lease`` is one this agent lent its ranks (the keys on it are the agent's to end)."""
        with self._lock:
            return bool(lease) and lease in self._lent

    def _holds(self, lease: int, gone: int, timeout: float | None) -> bool:
        """Whether etcd still has ``lease``: asked only when a rank says it lost it (a keep-alive's answer may be
        late to say so)."""
        return lease not in self.store.lost_leases() and (
            gone != lease or self.store.lease_ttl(lease, timeout=timeout) > 0)

    def revoke(self) -> None:
        """End the lease of its own, if it granted one (the agent is leaving): every key of its ranks still bound
        to it goes at once. The node's lease goes when the node leaves the rendezvous."""
        with self._lock:
            lease, self._own, self.lease = self._own, 0, 0
            self._lent.clear()
        if lease:
            try:
                self.store.lease_revoke(lease, timeout=2.0)
            except Exception as e:  # it then expires within its TTL
                log.warning("%s: could not revoke the ranks' lease: %s", self.context, e)


class RankLiveness:
    """Ends the liveness of the agent's rank processes on the pod's lease when they die or fall silent."""

    def __init__(self, store: Store, keys: JobKeys, node_id: str, lease: PodLease, *, context: str = "") -> None:
        self.store = store
        self.keys = keys
        self.node_id = node_id
        self.lease = lease
        self.context = context
        #: local rank -> the status file's ``written`` when its liveness was ended (it is not ended twice for
        #: one silence; a write since says the process came back).
        self._ended: dict[int, float] = {}

    def end(self, local_rank: int, status: RankStatus | None, why: str) -> bool:
        """End the liveness of the process whose last status is ``status``, if it is on the pod's lease: its
        alive key and arrivals go, as its own lease's end would have taken them. Returns whether they went."""
        if status is None or status.epoch is None or not self.lease.lent(status.lease):
            return False
        try:
            gone = end_liveness(self.store, self.keys, status.epoch, slot=status.slot, node_id=self.node_id,
                                pid=status.pid, iterations=liveness_iterations(status.iteration), timeout=2.0)
        except StoreError as e:  # its peers still learn of it from the fault the agent records, or its collectives
            log.warning("%s: could not end the liveness of local rank %d (slot %d): %s", self.context, local_rank,
                        status.slot, e)
            return False
        if gone:
            log.warning("%s: local rank %d (slot %d, pid %d, epoch %d): alive key removed: %s", self.context,
                        local_rank, status.slot, status.pid, status.epoch, why)
        return gone

    def watch(self, running: Sequence[tuple[int, RankStatus | None]], now: float) -> list[int]:
        """End the liveness of the running processes (local rank, last status) whose status file went unwritten
        for the lease's TTL; returns their local ranks."""
        ttl = self.lease.ttl
        if not ttl:
            return []
        quiet = [Quiet(lr, st.written, self.lease.lent(st.lease), self._ended.get(lr) == st.written)
                 for lr, st in running if st is not None and st.state not in ("done", "failed")]
        out = silent(quiet, now=now, ttl=ttl)
        statuses = dict(running)
        for lr in out:
            st = statuses[lr]
            assert st is not None and st.written is not None
            self._ended[lr] = st.written
            self.end(lr, st, f"no status written for {now - st.written:.1f}s (the ranks' lease TTL is {ttl}s)")
        return out
