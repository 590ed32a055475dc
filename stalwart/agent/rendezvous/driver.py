"""The thin etcd driver of the rendezvous: one watch and one thread per process and job, many nodes.

:class:`Rendezvous` keeps the protocol state (:mod:`.protocol`) of one job up to date from a single prefix
watch, feeds it to :func:`~.protocol.step`, and carries out the seal it asks for. :class:`NodeHandle` is one
node's side: register (a lease and a lease-bound node key, created only if absent), wait for a round, watch
for its end, ask for a new one, leave. A process that simulates many nodes shares one Store (one gRPC
channel), one watch and one driver thread among all of them.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from stalwart.agent.rendezvous.errors import (
    DuplicateNode,
    NodeLost,
    RendezvousCancelled,
    RendezvousClosed,
    RendezvousError,
    RendezvousTimeout,
)
from stalwart.agent.rendezvous.protocol import (
    Event,
    KeyDeleted,
    KeyEvent,
    KeyPut,
    LocalNode,
    Observed,
    Reloaded,
    Role,
    Seal,
    SealFailed,
    State,
    Tick,
    View,
    WakeAt,
    apply,
    role_of,
    round_status,
    step,
    waiting_nodes,
)
from stalwart.agent.rendezvous.sealing import seal_txn
from stalwart.agent.rendezvous.settings import RendezvousSettings
from stalwart.api.rendezvous import (
    ClosedRecord,
    ExpectedNodes,
    Manifest,
    Member,
    NodeRecord,
    RerendezvousRequest,
)
from stalwart.etcd.fence import Fence
from stalwart.etcd.keys import CLOSED, EXPECTED, NODES, REQUEST, JobKeys
from stalwart.etcd.outage import Backoff, Outage
from stalwart.etcd.store import Compare, Get, Put, Store, StoreError, StoreUnavailable, WatchEvent

if TYPE_CHECKING:
    from stalwart.etcd.torch_store import EtcdTorchStore

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class RoundInfo:
    """A node's place in a sealed round.

    ``role`` is ``"member"`` (it runs ranks), ``"spare"`` (present beyond ``max_nodes``; waits for a later
    round) or ``"waiting"`` (it arrived after the round was sealed; it is in the next one).
    ``node_revision`` is the ``create_revision`` of the node's key, used to fence its writes.
    """

    node_id: str
    epoch: int
    role: Role
    manifest: Manifest
    node_revision: int
    #: This node's member entry, ``None`` unless ``role == "member"``.
    member: Member | None = None

    @property
    def round(self) -> int:
        return self.manifest.round

    @property
    def world_size(self) -> int:
        return self.manifest.world_size


@dataclass(frozen=True, slots=True)
class RoundEnd:
    """Why the round of ``epoch`` is over for a node."""

    epoch: int
    reason: str
    #: Members whose keys went (lease expiry or leave), if that is why.
    lost: tuple[str, ...] = ()
    #: The rendezvous was closed (no further round will come).
    closed: bool = False
    #: This node's own key is gone (it must join again).
    self_lost: bool = False


@dataclass(frozen=True, slots=True)
class RoundSealed:
    """Listener event: a new round was sealed."""

    epoch: int
    manifest: Manifest


@dataclass(frozen=True, slots=True)
class RoundEnded:
    """Listener event: the round of ``epoch`` ended (a member was lost or a re-rendezvous was requested)."""

    epoch: int
    reason: str
    lost: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class Closed:
    """Listener event: the rendezvous was closed."""


RoundEvent = RoundSealed | RoundEnded | Closed


def _to_event(prefix: str, ev: WatchEvent) -> KeyEvent:
    key = ev.kv.key[len(prefix):]
    if ev.type == "delete":
        return KeyDeleted(key, ev.kv.mod_revision)
    return KeyPut(key, ev.kv.value, ev.kv.create_revision, ev.kv.mod_revision, ev.kv.lease)


class Rendezvous:
    """The rendezvous of one job as seen from one process (any number of local nodes).

    Starts one daemon thread and one etcd watch on first use; :meth:`shutdown` stops them. Thread-safe.
    """

    def __init__(self, store: Store, keys: JobKeys, settings: RendezvousSettings) -> None:
        self.store = store
        self.keys = keys
        self.settings = settings
        self.prefix = keys.rendezvous
        self._lock = threading.Lock()
        self._state = State()
        self._loaded = threading.Event()
        self._handles: dict[str, NodeHandle] = {}
        self._listeners: list[Callable[[RoundEvent], None]] = []
        self._wake_at: float | None = None
        self._seal_retry_at: float | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.last_error: StoreError | None = None
        self._outage = Outage(f"etcd (rendezvous watch {self.prefix})", logger=log)

    # -- public -----------------------------------------------------------------------------------------

    def node(self, record: NodeRecord) -> NodeHandle:
        """A handle for the local node ``record`` (nothing is written until :meth:`NodeHandle.join`)."""
        with self._lock:
            if record.node_id in self._handles:
                raise DuplicateNode(f"node {record.node_id!r} already has a handle in this process")
            handle = NodeHandle(self, record)
            self._handles[record.node_id] = handle
        self.start()
        return handle

    def start(self) -> None:
        """Start the watch thread (idempotent)."""
        with self._lock:
            if self._thread is not None or self._stop.is_set():
                return
            self._thread = threading.Thread(target=self._run, name=f"rdzv:{self.keys.uid}", daemon=True)
            self._thread.start()

    def view(self) -> View:
        """The latest view of the rendezvous prefix (an immutable snapshot)."""
        with self._lock:
            return self._state.view

    def wait_loaded(self, timeout: float) -> bool:
        """Wait until the prefix was read once; ``False`` if ``timeout`` passed first."""
        self.start()
        return self._loaded.wait(timeout)

    def close(self, reason: str = "") -> None:
        """Close the rendezvous for every node: no new round is sealed; spares and waiting nodes leave."""
        self.store.put(self.prefix + CLOSED, ClosedRecord(reason=reason).to_json_bytes())

    def set_expected(self, node_ids: list[str]) -> None:
        """Record the node ids expected in a round (the operator does this), so it seals once they are in."""
        self.store.put(self.prefix + EXPECTED, ExpectedNodes(node_ids=node_ids).to_json_bytes())

    def subscribe(self, callback: Callable[[RoundEvent], None]) -> Callable[[], None]:
        """Call ``callback`` from the watch thread on every :class:`RoundSealed`, :class:`RoundEnded` and
        :class:`Closed`; it must return quickly and not block. Returns a function that unsubscribes."""
        with self._lock:
            self._listeners.append(callback)

        def unsubscribe() -> None:
            with self._lock:
                if callback in self._listeners:
                    self._listeners.remove(callback)
        return unsubscribe

    def shutdown(self) -> None:
        """Stop the watch thread. Leases of nodes that did not leave expire by their TTL."""
        self._stop.set()
        with self._lock:
            handles = list(self._handles.values())
            thread = self._thread
        for h in handles:
            h._wake.set()
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=10)

    # -- the driver thread ---------------------------------------------------------------------------------

    def _set_local(self, node_id: str, present: bool) -> None:
        if not present:
            with self._lock:
                self._handles.pop(node_id, None)
        self._feed(LocalNode(node_id, present, time.monotonic()))

    def _run(self) -> None:
        backoff = 0.1
        while not self._stop.is_set():
            watch = None
            try:
                kvs, revision = self.store.get_prefix(self.prefix)
                view = apply(View(), [KeyPut(kv.key[len(self.prefix):], kv.value, kv.create_revision,
                                             kv.mod_revision, kv.lease) for kv in kvs])
                view = replace(view, revision=revision, memo={})
                watch = self.store.watch(self.prefix, prefix=True, start_revision=revision + 1)
                self._feed(Reloaded(view, time.monotonic()))
                self._loaded.set()
                self.last_error = None
                self._outage.ok()
                backoff = 0.1
                while not self._stop.is_set():
                    now = time.monotonic()
                    wake = min((t for t in (self._wake_at, self._seal_retry_at) if t is not None), default=None)
                    timeout = 0.5 if wake is None else min(0.5, max(0.0, wake - now))
                    first = watch.next(timeout)
                    if first is None:
                        now = time.monotonic()
                        if self._seal_retry_at is not None and now >= self._seal_retry_at:
                            self._seal_retry_at = None
                            self._feed(SealFailed(now))
                        else:
                            self._feed(Tick(now))
                        continue
                    batch = [_to_event(self.prefix, first)]
                    while len(batch) < 4096 and (more := watch.next(0)) is not None:
                        batch.append(_to_event(self.prefix, more))
                    self._feed(Observed(tuple(batch), time.monotonic()))
            except StoreError as e:
                if self._stop.is_set():
                    break
                self.last_error = e
                self._outage.failed(e)  # logs once per outage
                self._wake_handles(all_=True)
                self._stop.wait(backoff * (0.5 + random.random()))
                backoff = min(2.0, backoff * 2)
            except Exception:
                log.exception("rendezvous %s: driver failed; restarting it", self.prefix)
                self._stop.wait(backoff * (0.5 + random.random()))
                backoff = min(2.0, backoff * 2)
            finally:
                if watch is not None:
                    watch.cancel()

    def _feed(self, event: Event) -> None:
        with self._lock:
            old = self._state
            new, actions = step(old, event, self.settings)
            self._state = new
            listeners = list(self._listeners)
        self._wake_at = None
        for action in actions:
            if isinstance(action, WakeAt):
                self._wake_at = action.deadline if self._wake_at is None else min(self._wake_at, action.deadline)
            elif isinstance(action, Seal):
                self._seal(action)
        self._notify(old.view, new.view, event, listeners)

    def _seal(self, seal: Seal) -> None:
        try:
            res = self.store.txn(*seal_txn(self.prefix, seal))
        except (StoreError, ValueError) as e:
            log.warning("rendezvous %s: sealing round %d failed: %s", self.prefix, seal.manifest.round, e)
            self._seal_retry_at = time.monotonic() + 0.2 + 0.3 * random.random()
            return
        if res.succeeded:
            m = seal.manifest
            log.info("rendezvous %s: sealed round %d at epoch %d: %d members, world %d, %d spares (%s)",
                     self.prefix, m.round, res.revision, len(m.members), m.world_size, len(m.spares),
                     m.reason)
        else:
            # Another view of etcd is newer than ours; the watch will bring it. Retry only if it does not.
            self._seal_retry_at = time.monotonic() + 0.2 + 0.3 * random.random()

    def _notify(self, old: View, new: View, event: Event,
                listeners: list[Callable[[RoundEvent], None]]) -> None:
        if old is new:
            return
        round_changed = (old.sealed is not new.sealed or old.request is not new.request
                         or old.closed != new.closed or isinstance(event, Reloaded))
        if not round_changed and new.sealed is not None and old.nodes is not new.nodes:
            round_changed = round_status(old).live != round_status(new).live
        if round_changed:
            self._wake_handles(all_=True)
        elif isinstance(event, Observed):
            with self._lock:
                for ev in event.events:
                    if ev.key.startswith(NODES):
                        h = self._handles.get(ev.key[len(NODES):])
                        if h is not None:
                            h._wake.set()
        if not listeners or not round_changed:
            return
        events: list[RoundEvent] = []
        was, now = round_status(old), round_status(new)
        if old.sealed is not None and was.live and (not now.live or new.epoch != old.epoch):
            events.append(RoundEnded(old.epoch, now.reason if not now.live else "a new round was sealed",
                                     now.lost))
        if new.sealed is not None and new.epoch != old.epoch:
            events.append(RoundSealed(new.epoch, new.sealed.manifest))
        if new.closed and not old.closed:
            events.append(Closed())
        for rev in events:
            for cb in listeners:
                try:
                    cb(rev)
                except Exception:
                    log.exception("rendezvous listener failed on %s", rev)

    def _wake_handles(self, *, all_: bool) -> None:
        with self._lock:
            handles = list(self._handles.values())
        for h in handles:
            h._wake.set()


#: Between re-registrations of a node whose key keeps being lost without a round in between.
KEY_LOSS_BACKOFF = Backoff(initial=0.5, cap=10.0)


class NodeHandle:
    """One node's side of the rendezvous. Get it from :meth:`Rendezvous.node`.

    Methods may be called from any thread, but one node should be driven by one thread at a time.
    """

    def __init__(self, rdzv: Rendezvous, record: NodeRecord) -> None:
        self.rdzv = rdzv
        self.record = record
        self.node_id = record.node_id
        self.key = rdzv.prefix + NODES + record.node_id
        self.lease: int | None = None
        self.create_revision: int | None = None
        self.info: RoundInfo | None = None
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
                res = store.txn([Compare(self.key, "create", "==", 0)], [Put(self.key, value, self.lease)],
                                [Get(self.key)])
                if res.succeeded:
                    self.create_revision = res.revision
                    self.rdzv._set_local(self.node_id, True)
                    return
                existing = res.responses[0]
                if existing and existing[0].lease == self.lease:
                    # Our own earlier attempt landed although its answer was lost.
                    self.create_revision = existing[0].create_revision
                    self.rdzv._set_local(self.node_id, True)
                    return
                holder = existing[0].lease if existing else 0
                if not self._wait_key_released(holder, deadline):
                    store.lease_revoke(self.lease)
                    self.lease = None
                    raise DuplicateNode(f"node id {self.node_id!r} is held by another live node (lease "
                                        f"{holder:x}) and was not released before the join deadline")
            except StoreUnavailable as e:
                if time.monotonic() + backoff >= deadline:
                    raise RendezvousTimeout(f"node {self.node_id}: etcd unreachable while joining: {e}") from e
                self.rdzv._outage.failed(f"node {self.node_id} joining: {e}")  # logs once per outage
                self._pause(backoff * (0.5 + random.random()))
                backoff = min(2.0, backoff * 2)

    def _wait_key_released(self, holder: int, deadline: float) -> bool:
        """Wait (on the watch) until the node key held under lease ``holder`` is gone: a restarted node's
        previous incarnation keeps its key until its lease expires. ``False`` if the deadline comes first."""
        log.info("node %s: id still held by lease %x (a previous incarnation?); waiting for it to go",
                 self.node_id, holder)
        while True:
            self._wake.clear()
            entry = self.rdzv.view().nodes.get(self.node_id)
            if entry is None or entry.lease != holder:
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
        if view.revision < self.create_revision:
            return True  # the watch has not caught up with our own write yet
        e = view.nodes.get(self.node_id)
        return e is not None and e.create_revision == self.create_revision

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
                    delay = min(KEY_LOSS_BACKOFF.delay(self._key_losses, random.random()),
                                max(0.0, deadline - time.monotonic()))
                    log.warning("node %s: key lost (lease expired or revoked, %d in a row); registering again "
                                "in %.1fs", self.node_id, self._key_losses, delay)
                    self._drop_lease()
                    self._pause(delay)
                self._register(deadline)
                continue
            self._wake.clear()
            view = self.rdzv.view()
            if self.create_revision is not None and view.revision >= self.create_revision:
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
        return RoundInfo(self.node_id, sealed.epoch, role, sealed.manifest, self.create_revision,
                         sealed.members.get(self.node_id) if role == "member" else None)

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
        """Why the round last returned by :meth:`join` is over, or ``None`` while it is live (no waiting)."""
        info = self.info
        if info is None:
            return None
        view = self.rdzv.view()
        if not self._own_entry_ok(view) or (self.lease is not None and self.lease in self.rdzv.store.lost_leases()):
            return RoundEnd(info.epoch, f"node {self.node_id}'s key is gone", (self.node_id,), view.closed, True)
        if view.epoch != info.epoch:
            why = f"round {view.sealed.manifest.round} was sealed" if view.sealed else "the manifest was deleted"
            if view.sealed is not None and view.sealed.manifest.reason:
                why += f" ({view.sealed.manifest.reason})"
            return RoundEnd(info.epoch, why, (), view.closed)
        status = round_status(view)
        if not status.live:
            return RoundEnd(info.epoch, status.reason, status.lost, view.closed)
        if view.closed and info.role != "member":
            return RoundEnd(info.epoch, "the rendezvous is closed", (), True)
        return None

    def waiting_nodes(self) -> list[str]:
        """Ids of present nodes outside the current round (late arrivals a new round would take in)."""
        return waiting_nodes(self.rdzv.view())

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

