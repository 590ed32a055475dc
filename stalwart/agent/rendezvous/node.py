"""One node's side of the rendezvous (:class:`NodeHandle`): register (a lease and a lease-bound node key, created
only if absent), wait for a round, watch for its end, ask for a new one, close the rendezvous, leave. Every
write that belongs to a round goes through the round's :class:`~stalwart.etcd.fence.Fence`. The shared watch
and the protocol state are the process's :class:`~stalwart.agent.rendezvous.driver.Rendezvous`.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from typing import TYPE_CHECKING

from stalwart.agent.rendezvous.errors import (
    DuplicateNode,
    Fenced,
    NodeLost,
    RendezvousCancelled,
    RendezvousClosed,
    RendezvousError,
    RendezvousTimeout,
)
from stalwart.agent.rendezvous.protocol import (
    NodeEntry,
    SealerClaim,
    View,
    role_of,
    round_status,
    waiting_nodes,
)
from stalwart.agent.rendezvous.rounds import RoundEnd, RoundInfo
from stalwart.api.rendezvous import ClosedRecord, FenceRecord, NodeRecord, RerendezvousRequest, SealerRecord
from stalwart.etcd.fence import Fence
from stalwart.etcd.keys import CLOSED, NODES, REQUEST, SEALER
from stalwart.etcd.outage import Backoff
from stalwart.etcd.store import Compare, Get, KeyValue, Op, Put, StoreError, StoreUnavailable, Txn
from stalwart.jitter import RNG

if TYPE_CHECKING:
    from stalwart.agent.rendezvous.driver import Rendezvous
    from stalwart.etcd.torch_store import EtcdTorchStore

log = logging.getLogger(__name__)

__all__ = ["KEY_LOSS_BACKOFF", "NodeHandle"]


#: Between re-registrations of a node whose key keeps being lost without a round in between.
KEY_LOSS_BACKOFF = Backoff(initial=0.5, cap=10.0)


def fence_reason(value: bytes) -> str:
    """The reason a fence record gives (its value is only read, never trusted for more)."""
    try:
        return FenceRecord.from_json_bytes(value).reason or "no reason given"
    except ValueError:
        return "an unreadable fence record"


class NodeHandle:
    """One node's side of the rendezvous. Get it from :meth:`Rendezvous.node`.

    Methods may be called from any thread, but one node should be driven by one thread at a time.
    """

    def __init__(self, rdzv: Rendezvous, record: NodeRecord, incarnation: str | None = None) -> None:
        self.rdzv = rdzv
        self.record = record
        self.node_id = record.node_id
        self.key = rdzv.prefix + NODES + record.node_id
        #: The fence record of this incarnation (the pod's uid), compared absent by every registration.
        self.fence_key = rdzv.keys.fenced(incarnation) if incarnation else None
        self.lease: int | None = None
        self.create_revision: int | None = None
        self.info: RoundInfo | None = None
        self._end_seen: tuple[int, float | None] = (0, None)
        self._wake = threading.Event()
        self._cancel = threading.Event()
        self._left = False
        self._key_losses = 0  # consecutive losses of the node key without a round in between

    # -- registration ------------------------------------------------------------------------------------

    def _register(self, deadline: float) -> None:
        """Grant a lease and create the node key under it (only if absent); retries while etcd is unreachable."""
        store, settings = self.rdzv.store, self.rdzv.settings
        value = self.record.to_json_bytes()
        backoff = 0.1
        while True:
            try:
                if self.lease is None:
                    self.lease = store.lease_grant(settings.node_ttl)
                compares = [Compare(self.key, "create", "==", 0)]
                if self.fence_key is not None:
                    compares.append(Compare(self.fence_key, "create", "==", 0))
                res = store.txn(compares, self._registration(value, self.lease),
                                [Get(self.key), *([Get(self.fence_key)] if self.fence_key else [])])
                if res.succeeded:
                    self._registered(res.revision, self.lease, self._sealer_found(res.responses[0], res.revision))
                    return
                if len(res.responses) > 1 and res.responses[1]:
                    lease, self.lease = self.lease, None
                    with contextlib.suppress(StoreError):
                        store.lease_revoke(lease)
                    raise Fenced(f"node {self.node_id}: fenced by the operator "
                                 f"({fence_reason(res.responses[1][0].value)}); it may not register again")
                existing = res.responses[0]
                if existing and existing[0].lease == self.lease:
                    # Our own earlier attempt landed although its answer was lost.
                    self._registered(existing[0].create_revision, self.lease)
                    return
                holder = existing[0].lease if existing else 0
                created = existing[0].create_revision if existing else 0
                if not self._wait_key_released(holder, created, deadline):
                    store.lease_revoke(self.lease)
                    self.lease = None
                    raise DuplicateNode(f"node id {self.node_id!r} is held by another live node (lease "
                                        f"{holder:x}) and was not released before the join deadline")
            except StoreUnavailable as e:
                if time.monotonic() + backoff >= deadline:
                    raise RendezvousTimeout(f"node {self.node_id}: etcd unreachable while joining: {e}") from e
                self.rdzv._outage.failed(f"node {self.node_id} joining: {e}")  # logs once per outage
                self._pause(backoff * (0.5 + RNG.random()))
                backoff = min(2.0, backoff * 2)

    def _registration(self, value: bytes, lease: int) -> list[Op]:
        """The node key, and the sealer's key too while nobody holds it: a nested transaction, so the first
        node to register claims it in the same write (its compares are judged on etcd before the write, so the
        read of the key before it tells who holds it after)."""
        sealer_key = self.rdzv.prefix + SEALER
        claim = Put(sealer_key, SealerRecord(node_id=self.node_id).to_json_bytes(), lease)
        return [Get(sealer_key), Put(self.key, value, lease),
                Txn((Compare(sealer_key, "create", "==", 0),), (claim,))]

    def _sealer_found(self, held: list[KeyValue], revision: int) -> SealerClaim | None:
        """Who holds the sealer's key after a registration that read it as ``held`` before claiming it."""
        if not held:
            assert self.lease is not None
            return SealerClaim(self.node_id, revision, self.lease)
        try:
            return SealerClaim(SealerRecord.from_json_bytes(held[0].value).node_id, held[0].create_revision,
                               held[0].lease)
        except ValueError:
            return None  # a corrupt record: the watch's view reports it

    def _registered(self, create_revision: int, lease: int, sealer: SealerClaim | None = None) -> None:
        self.create_revision = create_revision
        self.rdzv._set_local(self.node_id, True, NodeEntry(self.record, create_revision, lease), sealer)

    def _wait_key_released(self, holder: int, created: int, deadline: float) -> bool:
        """Wait (on the watch) until the node key held under lease ``holder`` since revision ``created`` is
        gone: a restarted node's previous incarnation keeps its key until its lease expires. ``False`` if the
        deadline comes first."""
        log.info("node %s: id still held by lease %x (a previous incarnation?); waiting for it to go",
                 self.node_id, holder)
        while True:
            self._wake.clear()
            view = self.rdzv.view()
            # Every view is sent the deletion; a full one that read the prefix after it no longer holds the key.
            entry = view.nodes.get(self.node_id)
            if view.gone.get(self.node_id, 0) > created or (
                    view.full and view.revision >= created and (entry is None or entry.lease != holder)):
                return True
            remaining = deadline - time.monotonic()
            if remaining <= 0 or self.rdzv._stop.is_set():
                return False
            self._check_running()
            self._wake.wait(min(remaining, 1.0))

    def _own_entry_ok(self, view: View) -> bool:
        """False once the view shows this node's key gone or re-created since we registered."""
        if self.create_revision is None:
            return False
        e = view.nodes.get(self.node_id)
        if e is not None and e.create_revision == self.create_revision:
            return True
        return view.revision < self.create_revision  # the watch has not caught up with our own write yet

    def _holds_own_entry(self, view: View) -> bool:
        """Whether ``view`` knows this node's key as registered (a light view learns it from the registration,
        never from the watch)."""
        if self.create_revision is None:
            return False
        e = view.nodes.get(self.node_id)
        return view.revision >= self.create_revision or (e is not None and e.create_revision == self.create_revision)

    # -- the public contract -----------------------------------------------------------------------------

    def join(self, timeout: float | None = None) -> RoundInfo:
        """Register (if not already) and wait for the next live round sealed after the last one returned.

        Returns at once a :class:`RoundInfo`: as a member or spare of the new round, or with role
        ``"waiting"`` if a round was already live when this node arrived (it will be in the next one; the
        members see it in :meth:`waiting_nodes`). Call again after :meth:`wait_round_end` for the next round.
        If this node's key was lost (lease expired), it registers again under a new lease.

        Raises :class:`RendezvousClosed` if the rendezvous is closed before a round includes this node,
        :class:`RendezvousTimeout` after ``timeout`` (default: ``settings.join_timeout``) seconds, and
        :class:`DuplicateNode` if another live node holds this id until the deadline (a dead previous
        incarnation's key is waited out: it goes when its lease expires). On timeout the node leaves.
        """
        if self._left:
            raise RendezvousError(f"node {self.node_id} has left; get a new handle to join again")
        limit = self.rdzv.settings.join_timeout if timeout is None else timeout
        deadline = time.monotonic() + limit
        last_epoch = 0 if self.info is None else self.info.epoch
        while True:
            self._check_running()
            view = self.rdzv.view()
            if self.lease is None or not self._own_entry_ok(view) or self.lease in self.rdzv.store.lost_leases():
                if self.lease is not None:
                    # A fenced node (its lease revoked because it is no longer one of the job's) would lose
                    # each new key at once: back off, so that it does not hammer etcd until it is stopped.
                    self._key_losses += 1
                    delay = min(KEY_LOSS_BACKOFF.delay(self._key_losses, RNG.random()),
                                max(0.0, deadline - time.monotonic()))
                    log.warning("node %s: key lost (lease expired or revoked, %d in a row); registering again "
                                "in %.1fs", self.node_id, self._key_losses, delay)
                    self._drop_lease()
                    self._pause(delay)
                self._register(deadline)
                continue
            self._wake.clear()
            view = self.rdzv.view()
            if self._holds_own_entry(view):
                info = self._round_info(view, last_epoch)
                if info is not None:
                    self.info = info
                    self._key_losses = 0
                    return info
                if view.closed:
                    raise RendezvousClosed(f"node {self.node_id}: the rendezvous is closed")
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                self.leave()
                err = self.rdzv.last_error
                raise RendezvousTimeout(
                    f"node {self.node_id}: no round within {limit:.1f}s ({len(view.nodes)} nodes present, "
                    f"min {self.rdzv.settings.min_nodes}, max {self.rdzv.settings.max_nodes})"
                    + (f"; last etcd error: {err}" if err else ""))
            self._wake.wait(min(remaining, 1.0))

    def _check_running(self) -> None:
        if self._cancel.is_set():
            raise RendezvousCancelled(f"node {self.node_id}: stop requested")
        if self.rdzv._stop.is_set():
            raise RendezvousError(f"node {self.node_id}: the rendezvous client was shut down")

    def _pause(self, seconds: float) -> None:
        """Sleep ``seconds`` unless a stop is requested meanwhile (then raise :class:`RendezvousCancelled`)."""
        if self._cancel.wait(seconds):
            self._check_running()

    def cancel(self) -> None:
        """Stop request (from any thread): a blocked :meth:`join` or :meth:`wait_round_end` raises
        :class:`RendezvousCancelled` within a moment, and so does every later call of either."""
        self._cancel.set()
        self._wake.set()

    def _round_info(self, view: View, after_epoch: int) -> RoundInfo | None:
        sealed = view.sealed
        if sealed is None or sealed.epoch <= after_epoch or not round_status(view).live:
            return None
        role = role_of(view, self.node_id)
        if role is None or self.create_revision is None:
            return None  # our key went meanwhile: the caller's loop registers again
        if self.create_revision < sealed.epoch and not sealed.knows(self.node_id):
            return None  # a large round whose bucket with this node was not read yet
        return RoundInfo(self.node_id, sealed.epoch, role, sealed.header, self.create_revision,
                         sealed.members.get(self.node_id) if role == "member" else None,
                         sealed.spares.get(self.node_id) if role == "spare" else None, sealed.manifest)

    def wait_round_end(self, timeout: float) -> RoundEnd | None:
        """Block until the round last returned by :meth:`join` is over for this node; ``None`` if
        ``timeout`` passes first. It is over when a member's key goes, a re-rendezvous is requested, a newer
        round is sealed, this node's own key goes, or (for spares and waiting nodes) the rendezvous closes."""
        info = self.info
        if info is None:
            raise RendezvousError(f"node {self.node_id}: wait_round_end before join")
        deadline = time.monotonic() + timeout
        while True:
            self._check_running()
            self._wake.clear()
            end = self.round_end()
            if end is not None:
                return end
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return None
            self._wake.wait(min(remaining, 1.0))

    def round_end(self) -> RoundEnd | None:
        """Why the round last returned by :meth:`join` is over, or ``None`` while it is live (no waiting). The
        first time a round's end is seen is kept (:attr:`end_seen`: a mark of the recovery's detection)."""
        end = self._round_end()
        if end is not None and self._end_seen[0] != end.epoch:
            self._end_seen = (end.epoch, time.time())
        return end

    @property
    def end_seen(self) -> float | None:
        """Wall-clock time this handle first saw the end of a round it ran in, the last one (None: none)."""
        return self._end_seen[1]

    def _round_end(self) -> RoundEnd | None:
        info = self.info
        if info is None:
            return None
        view = self.rdzv.view()
        if not self._own_entry_ok(view) or (self.lease is not None and self.lease in self.rdzv.store.lost_leases()):
            return RoundEnd(info.epoch, f"node {self.node_id}'s key is gone", (self.node_id,), view.closed, True)
        if view.epoch != info.epoch:
            why = f"round {view.sealed.header.round} was sealed" if view.sealed else "the manifest was deleted"
            if view.sealed is not None and view.sealed.header.reason:
                why += f" ({view.sealed.header.reason})"
            return RoundEnd(info.epoch, why, (), view.closed)
        status = round_status(view)
        if not status.live:
            return RoundEnd(info.epoch, status.reason, status.lost, view.closed)
        if view.closed and info.role != "member":
            return RoundEnd(info.epoch, "the rendezvous is closed", (), True)
        return None

    def waiting_nodes(self) -> list[str]:
        """Ids of present nodes outside the current round (late arrivals a new round would take in), as far as
        this process's view knows them: a light view knows only its own nodes (see :meth:`waiting_count`)."""
        return waiting_nodes(self.rdzv.view())

    def waiting_count(self) -> int:
        """How many present nodes are outside the current round. A light view does not hold the other nodes'
        keys, so it asks etcd how many node keys there are (one count-only read) and subtracts the round's
        members and spares that are still there. (Of a large round it knows only its own buckets: a node gone
        from another bucket still counts as there, so the count may be short, never long.)"""
        view = self.rdzv.view()
        if view.full or view.sealed is None:
            return len(waiting_nodes(view))
        sealed, planned = view.sealed, view.sealed.header.view_revision
        listed = sealed.header.members + sealed.header.spares - sum(
            1 for n in (*sealed.members, *sealed.spares) if view.gone.get(n, 0) > planned)
        return max(0, self.rdzv.store.count_prefix(self.rdzv.prefix + NODES) - listed)

    def fence(self) -> Fence:
        """A :class:`Fence` for writes bound to the round last returned by :meth:`join`."""
        info = self.info
        if info is None:
            raise RendezvousError(f"node {self.node_id}: no round yet; join first")
        return Fence(self.rdzv.store, self.rdzv.keys, info.epoch, holder=(self.node_id, info.node_revision))

    def request_rerendezvous(self, reason: str = "") -> None:
        """Ask for a new round in place of the current one (fenced: raises :class:`StaleEpoch` if the round
        is already over, and then nothing is written)."""
        fence = self.fence()
        req = RerendezvousRequest(epoch=fence.epoch, node_id=self.node_id, reason=reason)
        fence.put(self.rdzv.prefix + REQUEST, req.to_json_bytes())

    def close_rendezvous(self, reason: str = "") -> None:
        """Close the rendezvous for every node: no new round is sealed; spares and waiting nodes leave. Fenced
        by the round last returned by :meth:`join`: raises :class:`StaleEpoch` if that round is over (a newer
        one was sealed, or this node's key is gone), and then nothing is written, so a zombie of an older round
        cannot close the rendezvous of the live one."""
        self.fence().put(self.rdzv.prefix + CLOSED, ClosedRecord(reason=reason[:1024]).to_json_bytes())

    def torch_store(self, *, timeout: float = 300.0) -> EtcdTorchStore:
        """A torch.distributed Store for the round last returned by :meth:`join` (namespaced by its epoch,
        writes fenced by it and by this node's key)."""
        from stalwart.etcd.torch_store import EtcdTorchStore

        info = self.info
        if info is None:
            raise RendezvousError(f"node {self.node_id}: no round yet; join first")
        return EtcdTorchStore(self.rdzv.store, self.rdzv.keys, info.epoch,
                              holder=(self.node_id, info.node_revision), timeout=timeout)

    def leave(self) -> None:
        """Leave the rendezvous: revoke the lease, so the node key goes at once (ending its round for the
        others). Idempotent; the handle cannot join again."""
        if self._left:
            return
        self._left = True
        try:
            self._drop_lease()
        finally:
            self.rdzv._set_local(self.node_id, False)

    def _drop_lease(self) -> None:
        lease, self.lease, self.create_revision = self.lease, None, None
        if lease is not None:
            try:
                self.rdzv.store.lease_revoke(lease)
            except StoreError as e:
                log.warning("node %s: revoking lease failed (it expires by TTL): %s", self.node_id, e)

    def check(self) -> None:
        """Raise :class:`NodeLost` if this node's key is known to be gone."""
        if self.create_revision is not None and not self._own_entry_ok(self.rdzv.view()):
            raise NodeLost(f"node {self.node_id}: its key is gone")
