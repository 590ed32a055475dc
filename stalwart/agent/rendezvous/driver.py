"""The thin etcd driver of the rendezvous: one watch and one thread per process and job, many nodes.

:class:`Rendezvous` keeps the protocol state (:mod:`.protocol`) of one job up to date from a single watch,
feeds it to :func:`~.protocol.step`, and carries out the claims and seals it asks for. Its view is full (the
whole prefix) while one of its nodes holds the sealer's key and light otherwise (:mod:`.reading`); it reads
again and watches anew when that changes. A node's side is its :class:`~.node.NodeHandle`. A process that
simulates many nodes shares one Store (one gRPC channel), one watch and one driver thread among all of them.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from stalwart.agent.rendezvous.errors import DuplicateNode
from stalwart.agent.rendezvous.node import NodeHandle
from stalwart.agent.rendezvous.protocol import (
    Claim,
    ClaimFailed,
    EndRound,
    Event,
    KeyDeleted,
    KeyEvent,
    KeyPut,
    LocalNode,
    NodeEntry,
    Observed,
    Reloaded,
    Seal,
    SealerClaim,
    SealFailed,
    State,
    Tick,
    View,
    WakeAt,
    round_status,
    step,
)
from stalwart.agent.rendezvous.reading import (
    buckets_to_read,
    full_ranges,
    full_view,
    key_puts,
    light_ranges,
    light_read,
    light_view,
)
from stalwart.agent.rendezvous.rounds import Closed, RoundEnded, RoundEvent, RoundSealed
from stalwart.agent.rendezvous.sealing import seal_txn
from stalwart.agent.rendezvous.settings import RendezvousSettings
from stalwart.api.rendezvous import ExpectedNodes, NodeRecord, RerendezvousRequest, SealerRecord
from stalwart.etcd.fence import Fence, StaleEpoch
from stalwart.etcd.keys import EXPECTED, NODES, REQUEST, SEALER, JobKeys
from stalwart.etcd.outage import Outage
from stalwart.etcd.store import Compare, Get, Put, Store, StoreError, WatchEvent, WatchRange
from stalwart.jitter import RNG

log = logging.getLogger(__name__)

__all__ = ["NodeHandle", "Rendezvous"]


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
        # Nothing read yet: a light view, so that a registration before the first read keeps its entry.
        self._state = State(view=View(full=False))
        self._loaded = threading.Event()
        self._handles: dict[str, NodeHandle] = {}
        self._listeners: list[Callable[[RoundEvent], None]] = []
        self._wake_at: float | None = None
        self._seal_retry_at: float | None = None
        self._claim_retry_at: float | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.last_error: StoreError | None = None
        self._outage = Outage(f"etcd (rendezvous watch {self.prefix})", logger=log)

    # -- public -----------------------------------------------------------------------------------------

    def node(self, record: NodeRecord, incarnation: str | None = None) -> NodeHandle:
        """A handle for the local node ``record`` (nothing is written until :meth:`NodeHandle.join`);
        ``incarnation`` (the pod's uid) makes every registration refused once the operator fenced it."""
        with self._lock:
            if record.node_id in self._handles:
                raise DuplicateNode(f"node {record.node_id!r} already has a handle in this process")
            handle = NodeHandle(self, record, incarnation)
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

    def _set_local(self, node_id: str, present: bool, entry: NodeEntry | None = None,
                   sealer: SealerClaim | None = None) -> None:
        if not present:
            with self._lock:
                self._handles.pop(node_id, None)
        self._feed(LocalNode(node_id, present, time.monotonic(), entry, sealer))

    def wants_full(self) -> bool:
        """Whether this process should hold a full view: one of its nodes holds the sealer's key."""
        with self._lock:
            view, local = self._state.view, self._state.local
        return view.sealer is not None and view.sealer.node_id in local

    def load(self) -> tuple[Reloaded, tuple[WatchRange, ...]]:
        """Read the prefix for a full or a light view (:meth:`wants_full`): the event to feed and what to
        watch from the revision after the view's."""
        if self.wants_full():
            kvs, revision = self.store.get_prefix(self.prefix)
            return Reloaded(full_view(self.prefix, kvs, revision), time.monotonic()), full_ranges(self.prefix)
        with self._lock:
            local = self._state.local
        res = self.store.txn(*light_read(self.prefix, local))
        return Reloaded(light_view(self.prefix, res), time.monotonic(), local), light_ranges(self.prefix)

    def _run(self) -> None:
        backoff = 0.1
        while not self._stop.is_set():
            watch = None
            try:
                loaded, ranges = self.load()
                view = loaded.view
                watch = self.store.watch_ranges(ranges, start_revision=view.revision + 1)
                self._feed(loaded)
                self.read_buckets()
                self._loaded.set()
                self.last_error = None
                self._outage.ok()
                backoff = 0.1
                while not self._stop.is_set() and self.wants_full() == view.full:
                    now = time.monotonic()
                    retries = (self._seal_retry_at, self._claim_retry_at)
                    wake = min((t for t in (self._wake_at, *retries) if t is not None), default=None)
                    timeout = 0.5 if wake is None else min(0.5, max(0.0, wake - now))
                    first = watch.next(timeout)
                    if first is None:
                        now = time.monotonic()
                        if self._seal_retry_at is not None and now >= self._seal_retry_at:
                            self._seal_retry_at = None
                            self._feed(SealFailed(now))
                        elif self._claim_retry_at is not None and now >= self._claim_retry_at:
                            self._claim_retry_at = None
                            self._feed(ClaimFailed(now))
                        else:
                            self._feed(Tick(now))
                        continue
                    batch = [_to_event(self.prefix, first)]
                    while len(batch) < 4096 and (more := watch.next(0)) is not None:
                        batch.append(_to_event(self.prefix, more))
                    self._feed(Observed(tuple(batch), time.monotonic()))
                    self.read_buckets()
            except StoreError as e:
                if self._stop.is_set():
                    break
                self.last_error = e
                self._outage.failed(e)  # logs once per outage
                self._wake_handles(all_=True)
                self._stop.wait(backoff * (0.5 + RNG.random()))
                backoff = min(2.0, backoff * 2)
            except Exception:
                log.exception("rendezvous %s: driver failed; restarting it", self.prefix)
                self._stop.wait(backoff * (0.5 + RNG.random()))
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
            elif isinstance(action, Claim):
                self._claim(action)
            elif isinstance(action, EndRound):
                self._end_round(action)
        self._notify(old.view, new.view, event, listeners)

    def read_buckets(self) -> None:
        """Read the buckets of a large manifest that this light view needs (its own nodes'), in one request."""
        with self._lock:
            view, local = self._state.view, self._state.local
        keys = buckets_to_read(view, local)
        if not keys:
            return
        res = self.store.txn([], [Get(self.prefix + key) for key in keys])
        events = key_puts(self.prefix, (kv for read in res.responses for kv in read))
        if events:
            self._feed(Observed(tuple(events), time.monotonic()))

    def _end_round(self, end: EndRound) -> None:
        request = RerendezvousRequest(epoch=end.epoch, node_id=end.node_id, reason=end.reason[:1024],
                                      lost=list(end.lost[:1024]))
        with self._lock:
            entry = self._state.view.nodes.get(end.node_id)
        holder = None if entry is None else (end.node_id, entry.create_revision)
        try:
            Fence(self.store, self.keys, end.epoch, holder=holder).put(self.prefix + REQUEST, request.to_json_bytes())
        except StaleEpoch:
            pass  # the round is over already (a newer one was sealed, or this sealer's key is gone)
        except StoreError as e:
            log.warning("rendezvous %s: ending the round of epoch %d failed: %s", self.prefix, end.epoch, e)
            self._seal_retry_at = time.monotonic() + 0.2 + 0.3 * RNG.random()

    def _claim(self, claim: Claim) -> None:
        key = self.prefix + SEALER
        try:
            res = self.store.txn([Compare(key, "create", "==", 0),
                                  Compare(self.prefix + NODES + claim.node_id, "create", "==", claim.node_revision)],
                                 [Put(key, SealerRecord(node_id=claim.node_id).to_json_bytes(), claim.lease)])
        except StoreError as e:
            log.warning("rendezvous %s: claiming the sealer's key for %s failed: %s", self.prefix, claim.node_id, e)
            self._claim_retry_at = time.monotonic() + 0.2 + 0.3 * RNG.random()
            return
        if res.succeeded:
            log.info("rendezvous %s: node %s is the sealer", self.prefix, claim.node_id)

    def _seal(self, seal: Seal) -> None:
        try:
            res = self.store.txn(*seal_txn(self.prefix, seal))
        except (StoreError, ValueError) as e:
            log.warning("rendezvous %s: sealing round %d failed: %s", self.prefix, seal.manifest.round, e)
            self._seal_retry_at = time.monotonic() + 0.2 + 0.3 * RNG.random()
            return
        if res.succeeded:
            m = seal.manifest
            log.info("rendezvous %s: sealed round %d at epoch %d: %d members, world %d, %d spares (%s)",
                     self.prefix, m.round, res.revision, len(m.members), m.world_size, len(m.spares),
                     m.reason)
        else:
            # Another view of etcd is newer than ours; the watch will bring it. Retry only if it does not.
            self._seal_retry_at = time.monotonic() + 0.2 + 0.3 * RNG.random()

    def _notify(self, old: View, new: View, event: Event,
                listeners: list[Callable[[RoundEvent], None]]) -> None:
        if old is new:
            return
        round_changed = (old.sealed is not new.sealed or old.request is not new.request
                         or old.closed != new.closed or isinstance(event, Reloaded))
        if not round_changed and new.sealed is not None and (old.nodes is not new.nodes or old.gone is not new.gone):
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
            events.append(RoundSealed(new.epoch, new.sealed.header, new.sealed.manifest))
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
