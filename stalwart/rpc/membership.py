"""Who the RPC workers are: names, ranks, addresses and the round epoch, and news of a peer's death.

The agent reads membership through the small :class:`Membership` interface:

* :meth:`Membership.view` -- the current :class:`MembershipView` (epoch + members);
* :meth:`Membership.subscribe` -- be told of a :class:`ViewChanged` (a new round, or a worker registered) and
  of a :class:`WorkerLeft` (its lease expired or it left).

Implementations: :class:`StaticMembership` (a fixed world given in code, as ``init_rpc`` with a world size)
and :class:`EtcdMembership` (each worker registers a lease-bound :class:`~stalwart.api.rpc.RpcWorkerRecord`
under ``JobKeys.rpc``; peers learn of a death from the record's deletion when the lease expires). The
rendezvous supplies the epoch (its sealed manifest's ``mod_revision``); :meth:`EtcdMembership.advance` moves
a worker to a new round, and workers that do not follow are excluded from the view. Both take plain values
(an epoch, node ids), so whoever watches the rendezvous drives them: RPC runs in the rank processes and
knows nothing of the agent's rendezvous.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from stalwart.api.rpc import RpcWorkerRecord, check_worker_name
from stalwart.etcd.keys import JobKeys
from stalwart.etcd.outage import Backoff, Outage
from stalwart.etcd.store import Compare, Delete, Put, Store, StoreError, WatchCompacted

log = logging.getLogger(__name__)


class Fenced(StoreError):
    """A worker of an older round tried to change the records of a newer one; nothing was written."""


def registration_refused(record: RpcWorkerRecord, current: RpcWorkerRecord | None, round_epoch: int) -> str | None:
    """Why ``record`` may not be registered now (``None``: it may), ``current`` being the record under its name
    and ``round_epoch`` the round the manifest names (its ``mod_revision``; 0 while none is sealed). A
    registration belongs to that round and no other: a worker of an older round is a zombie, one claiming a
    later round claims one never sealed. A record held under the name claiming an epoch past the manifest's
    holds no round, and is replaced."""
    if record.epoch < round_epoch:
        return (f"RPC worker {record.name!r} of the round of epoch {record.epoch} is fenced: the manifest names "
                f"the round of epoch {round_epoch}")
    if record.epoch > round_epoch:
        return (f"RPC worker {record.name!r} claims the round of epoch {record.epoch}, which is not sealed (the "
                f"manifest names epoch {round_epoch}): refused")
    if not record.may_replace(current, round_epoch):
        assert current is not None
        return (f"RPC worker {record.name!r} of the round of epoch {record.epoch} is fenced: a worker of the "
                f"newer round of epoch {current.epoch} holds the name")
    return None


@dataclass(frozen=True, slots=True)
class WorkerInfo:
    """A worker as user code sees it (what ``RRef.owner()`` returns)."""

    name: str
    rank: int


@dataclass(frozen=True, slots=True)
class Worker:
    """A worker of the current round and where its RPC server listens."""

    name: str
    rank: int
    address: str
    incarnation: str = ""

    def __post_init__(self) -> None:
        check_worker_name(self.name)
        if self.rank < 0:
            raise ValueError(f"rank: must be >= 0, got {self.rank}")
        host, sep, port = self.address.rpartition(":")
        if not sep or not host or not port.isdigit():
            raise ValueError(f"address: expected 'host:port', got {self.address!r}")

    @property
    def info(self) -> WorkerInfo:
        return WorkerInfo(self.name, self.rank)


@dataclass(frozen=True, slots=True)
class MembershipView:
    """The members of one round (epoch), by name."""

    epoch: int
    members: Mapping[str, Worker] = field(default_factory=lambda: MappingProxyType({}))

    @staticmethod
    def of(epoch: int, members: list[Worker]) -> MembershipView:
        by_name: dict[str, Worker] = {}
        for m in members:
            if m.name in by_name:
                raise ValueError(f"members: worker name {m.name!r} appears more than once")
            by_name[m.name] = m
        return MembershipView(epoch, MappingProxyType(by_name))

    def by_rank(self, rank: int) -> Worker | None:
        for m in self.members.values():
            if m.rank == rank:
                return m
        return None


@dataclass(frozen=True, slots=True)
class ViewChanged:
    """A new view: a new round (higher epoch), or members joined or left within the round."""

    view: MembershipView


@dataclass(frozen=True, slots=True)
class WorkerLeft:
    """A worker is gone (lease expired, or it left); everything it owned or held is to be given up.
    ``incarnation`` is the one that went (``""``: unknown): a process respawned under the same name is a new
    incarnation, and the name lives on with it."""

    name: str
    reason: str
    incarnation: str = ""


MembershipEvent = ViewChanged | WorkerLeft
Listener = Callable[[MembershipEvent], None]


class Membership:
    """Base of the membership sources: holds the view and fans events out to subscribers."""

    def __init__(self, view: MembershipView) -> None:
        self._view = view
        self._listeners: list[Listener] = []
        self._lock = threading.Lock()

    def view(self) -> MembershipView:
        return self._view

    def subscribe(self, listener: Listener) -> Callable[[], None]:
        """Call ``listener`` for every later event (from the source's thread); returns the unsubscriber."""
        with self._lock:
            self._listeners.append(listener)

        def unsubscribe() -> None:
            with self._lock:
                if listener in self._listeners:
                    self._listeners.remove(listener)

        return unsubscribe

    def _emit(self, event: MembershipEvent) -> None:
        if isinstance(event, ViewChanged):
            self._view = event.view
        with self._lock:
            listeners = list(self._listeners)
        for listener in listeners:
            try:
                listener(event)
            except Exception:
                log.exception("membership listener failed on %s", event)

    def close(self) -> None:
        """Stop watching (nothing to do for a static world)."""


class StaticMembership(Membership):
    """A world given in code. :meth:`set_view` and :meth:`worker_left` let a supervisor report changes."""

    def set_view(self, view: MembershipView) -> None:
        if view.epoch < self._view.epoch:
            raise ValueError(f"view: epoch {view.epoch} is older than the current {self._view.epoch}")
        self._emit(ViewChanged(view))

    def worker_left(self, name: str, reason: str = "left") -> None:
        gone = self._view.members.get(name)
        members = {k: v for k, v in self._view.members.items() if k != name}
        self._emit(WorkerLeft(name, reason, gone.incarnation if gone is not None else ""))
        self._emit(ViewChanged(MembershipView(self._view.epoch, MappingProxyType(members))))


class EtcdMembership(Membership):
    """Membership from lease-bound worker records in etcd (one key per worker under ``JobKeys.rpc``).

    ``register`` puts this worker's record with ``lease`` (granted here with ``lease_ttl`` when not given);
    a watch thread keeps the view and reports as :class:`WorkerLeft` a deleted record and a record replaced by
    another incarnation of the same name (a respawned process), naming the incarnation that went, before
    the view that holds its successor. The view holds every live
    record not excluded by the rendezvous; its epoch is this worker's round. ``older_rounds=False`` leaves
    out the records of rounds older than ours: right where every round has processes of its own (ranks
    launched by ``stalwart agent``), whose predecessors' records linger until their lease expires; keep the
    default where workers move from round to round in place (:meth:`advance`), so that a peer not yet moved
    stays reachable.
    """

    def __init__(self, store: Store, keys: JobKeys, *, epoch: int, lease: int | None = None,
                 lease_ttl: int = 10, older_rounds: bool = True) -> None:
        super().__init__(MembershipView(epoch))
        self._store = store
        self._prefix = keys.rpc_workers
        self._manifest = keys.manifest
        self._own_lease = lease is None
        self._lease = store.lease_grant(lease_ttl) if lease is None else lease
        self._records: dict[str, RpcWorkerRecord] = {}
        self._me: RpcWorkerRecord | None = None
        self._stop = threading.Event()
        self._changed = threading.Condition()
        self._reregister = False
        self._excluded: set[str] = set()
        self._epoch = epoch
        self._round_ranks: frozenset[int] = frozenset()  # ranks registered in our round (see wait_for_ranks)
        self._older_rounds = older_rounds
        self._outage = Outage("etcd (RPC membership watch)", logger=log, backoff=Backoff(initial=0.5, cap=5.0))
        kvs, revision = store.get_prefix(self._prefix)
        for kv in kvs:
            self._absorb_put(kv.key, kv.value)
        self._publish()
        self._thread = threading.Thread(target=self._watch_loop, args=(revision + 1,),
                                        name="stalwart-rpc-membership", daemon=True)
        self._thread.start()

    @property
    def lease(self) -> int:
        return self._lease

    def register(self, member: Worker, node: str = "") -> None:
        """Publish this worker's record (bound to the lease) in the current epoch; ``node`` is the
        rendezvous node it runs on (see :meth:`exclude_nodes`)."""
        record = RpcWorkerRecord(name=member.name, rank=member.rank, address=member.address,
                                 epoch=self._epoch, incarnation=member.incarnation, node=node)
        self._me = record
        self._put_fenced(record)

    def _put_fenced(self, record: RpcWorkerRecord) -> None:
        """Write our record only in the round the manifest names now, and unless a worker of that round holds
        the name (else :class:`Fenced`, nothing written): read the record and the manifest, decide
        (:func:`registration_refused`), then write on condition that the record is unchanged and the
        manifest's ``mod_revision`` is our epoch, in one transaction (epoch 0: no round is sealed yet)."""
        key = self._prefix + record.name
        for _ in range(8):  # bounded: each lost race means another worker of the name wrote in between
            kv = self._store.get(key)
            manifest = self._store.get(self._manifest)
            current = None
            if kv is not None:
                try:
                    current = RpcWorkerRecord.from_json_bytes(kv.value)
                except ValueError:
                    current = None  # a corrupt record holds no round: ours replaces it
            why = registration_refused(record, current, manifest.mod_revision if manifest is not None else 0)
            if why is not None:
                raise Fenced(why)
            unchanged = Compare(key, "mod", "==", kv.mod_revision) if kv is not None else \
                Compare(key, "create", "==", 0)
            in_round = Compare(self._manifest, "mod", "==", record.epoch)
            if self._store.txn([unchanged, in_round],
                               [Put(key, record.to_json_bytes(), lease=self._lease)]).succeeded:
                return
        raise StoreError(f"RPC worker {record.name!r}: the record kept changing while it registered")

    def advance(self, epoch: int, keep_nodes: set[str] | None = None) -> None:
        """Move to the round ``epoch`` (from the rendezvous). Workers on nodes outside ``keep_nodes`` (the
        round's members) are reported gone. Does no I/O, so it may run in another component's watch
        thread: our record is re-registered in the new epoch by our own watch thread."""
        if epoch < self._epoch:
            raise ValueError(f"epoch: {epoch} is older than the current {self._epoch}")
        if keep_nodes is not None:
            self.exclude_nodes({r.node for r in self._records.values() if r.node and r.node not in keep_nodes},
                               f"not a member of the round of epoch {epoch}")
        with self._changed:
            self._epoch = epoch
            self._reregister = True
        self._publish()

    def exclude_nodes(self, nodes: set[str] | tuple[str, ...], reason: str) -> None:
        """Report every worker on ``nodes`` gone (the rendezvous lost those nodes). No I/O."""
        for record in list(self._records.values()):
            if record.node and record.node in nodes and record.name not in self._excluded:
                self._excluded.add(record.name)
                self._emit(WorkerLeft(record.name, reason, record.incarnation))

    def _reregister_if_needed(self) -> None:
        with self._changed:
            if not self._reregister or self._me is None:
                return
            self._reregister = False
            self._me = self._me.model_copy(update={"epoch": self._epoch})
            me = self._me
        try:
            self._put_fenced(me)
        except Fenced as e:
            log.error("%s; this worker stays out of the round", e)

    def wait_for(self, count: int, timeout: float) -> MembershipView:
        """Block until ``count`` workers are in the view; raises TimeoutError after ``timeout`` seconds."""
        with self._changed:
            if not self._changed.wait_for(lambda: len(self._view.members) >= count, timeout):
                raise TimeoutError(f"only {len(self._view.members)} of {count} RPC workers registered "
                                   f"within {timeout}s: {sorted(self._view.members)}")
            return self._view

    def wait_for_ranks(self, world_size: int, timeout: float) -> MembershipView:
        """Block until a worker of every rank ``0 .. world_size-1`` is registered in this round or a newer
        one; raises TimeoutError naming the missing ranks after ``timeout`` seconds.

        Unlike :meth:`wait_for`, records an older round's processes left behind (they expire with their
        lease) do not count, nor do workers beyond the world (in-process spares)."""
        if world_size < 1:
            raise ValueError(f"world_size: must be >= 1, got {world_size}")
        wanted = frozenset(range(world_size))
        with self._changed:
            if not self._changed.wait_for(lambda: wanted <= self._round_ranks, timeout):
                missing = sorted(wanted - self._round_ranks)
                raise TimeoutError(f"RPC workers of rank(s) {missing} did not register in the round of epoch "
                                   f"{self._epoch} within {timeout}s (world size {world_size})")
            return self._view

    def _absorb_put(self, key: str, value: bytes) -> RpcWorkerRecord | None:
        """Take a record in; returns the record it replaced when that was another incarnation of the name."""
        try:
            record = RpcWorkerRecord.from_json_bytes(value)
        except ValueError as e:
            log.warning("ignoring invalid RPC worker record at %s: %s", key, e)
            return None
        old = self._records.get(record.name)
        self._records[record.name] = record
        if old is not None and old.incarnation != record.incarnation and record.name not in self._excluded:
            return old
        return None

    def _publish(self) -> None:
        epoch = self._epoch
        # every live record, of any epoch: a peer not yet moved to our round is still reachable (its
        # messages are fenced by epoch); the excluded ones are not
        members = [Worker(r.name, r.rank, r.address, r.incarnation)
                   for r in self._records.values()
                   if r.name not in self._excluded and (self._older_rounds or r.epoch >= epoch)]
        view = MembershipView.of(epoch, members)
        round_ranks = frozenset(r.rank for r in self._records.values()
                                if r.name not in self._excluded and r.epoch >= epoch)
        if view.epoch != self._view.epoch or dict(view.members) != dict(self._view.members):
            self._emit(ViewChanged(view))
        with self._changed:
            self._round_ranks = round_ranks
            self._changed.notify_all()

    def _watch_loop(self, start_revision: int) -> None:
        while not self._stop.is_set():
            try:
                with self._store.watch(self._prefix, prefix=True, start_revision=start_revision) as watch:
                    self._outage.ok()
                    while not self._stop.is_set():
                        self._reregister_if_needed()
                        event = watch.next(timeout=0.2)
                        if event is None:
                            continue
                        start_revision = event.kv.mod_revision + 1
                        name = event.kv.key[len(self._prefix):]
                        if event.type == "put":
                            old = self._absorb_put(event.kv.key, event.kv.value)
                            if old is not None:
                                self._emit(WorkerLeft(name, f"restarted: its incarnation {old.incarnation or '?'} "
                                                            "was replaced", old.incarnation))
                        elif (gone := self._records.pop(name, None)) is not None and name not in self._excluded:
                            self._emit(WorkerLeft(name, "its lease expired or it left", gone.incarnation))
                        self._publish()
            except WatchCompacted:
                kvs, revision = self._store.get_prefix(self._prefix)
                before = dict(self._records)
                self._records.clear()
                for kv in kvs:
                    self._absorb_put(kv.key, kv.value)
                for name, record in before.items():
                    now = self._records.get(name)
                    if now is None or now.incarnation != record.incarnation:
                        self._emit(WorkerLeft(name, "its lease expired or it left", record.incarnation))
                self._publish()
                start_revision = revision + 1
            except StoreError as e:
                if self._stop.wait(self._outage.failed(e)):  # logs once per outage, backs off
                    return

    def close(self) -> None:
        """Stop the watch; delete our record (revoking the lease if we granted it)."""
        self._stop.set()
        self._thread.join(timeout=10)
        try:
            if self._own_lease:
                self._store.lease_revoke(self._lease)
            elif self._me is not None:  # only our own record: a newer worker of the name keeps its own
                key = self._prefix + self._me.name
                self._store.txn([Compare(key, "lease", "==", self._lease)], [Delete(key)])
        except StoreError as e:
            log.warning("could not remove our RPC worker record: %s", e)

