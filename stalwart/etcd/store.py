"""The one adapter between stalwart and etcd v3.

Every part of stalwart (operator, rendezvous, in-process restart, RPC membership) reaches etcd through
:class:`Store` and nothing else. It speaks the etcd v3 gRPC API directly, through the generated stubs of the
``etcd-sdk-python`` package, so that each call carries its own deadline and each failure maps onto one of a few
typed errors:

* :class:`StoreUnavailable` -- the server cannot be reached (it is down, restarting, or the network is gone).
  The gRPC channel reconnects by itself; the *call* that saw the failure is not retried here, because only the
  caller knows whether it is safe to repeat.
* :class:`StoreTimeout` -- the call's deadline passed.
* :class:`WatchCompacted` -- a watch asked to start at a revision etcd has already compacted away.
* :class:`StoreSecurityError` -- etcd refused who we are: a failed TLS handshake, no login where one is needed,
  a wrong user or password, a key outside the user's permissions (:class:`StorePermissionDenied`). Never
  transient: the message says what to fix (see :mod:`stalwart.etcd.auth`, which also renews the auth token).
* :class:`StoreError` -- anything else etcd refused (the base class of all of the above).

Values are bytes; callers store JSON documents of ``stalwart.api`` models and check the size with
:func:`check_value_size` before writing. Nothing here unpickles anything.
"""

from __future__ import annotations

import logging
import queue
import random
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import grpc
from pyetcd.etcdrpc import rpc_pb2 as rpc
from pyetcd.etcdrpc import rpc_pb2_grpc as rpc_grpc

from stalwart.etcd import auth as store_auth

log = logging.getLogger(__name__)

#: Largest value stalwart writes to etcd. etcd's own request limit is 1.5 MiB; our records are small JSON.
MAX_VALUE_BYTES = 256 * 1024
DEFAULT_TIMEOUT = 5.0
#: A watch that has delivered nothing for this many seconds asks etcd for a progress report; one that does not
#: answer within the store's timeout is silent (see :class:`Watch`).
WATCH_IDLE_CHECK = 10.0


class StoreError(Exception):
    """etcd refused or failed a request."""


class StoreUnavailable(StoreError):
    """The etcd server could not be reached; the channel keeps reconnecting in the background."""


class StoreTimeout(StoreError):
    """A call to etcd did not finish before its deadline."""


class StoreSecurityError(StoreError):
    """etcd refused this client's TLS handshake, login or permissions; retrying will not help."""


class StorePermissionDenied(StoreSecurityError):
    """The user may not read or write these keys."""


class WatchCompacted(StoreError):
    """A watch's start revision has been compacted; re-read the current state and watch from there."""

    def __init__(self, compact_revision: int) -> None:
        super().__init__(f"watch start revision was compacted; oldest available is {compact_revision}")
        self.compact_revision = compact_revision


class ValueTooLarge(StoreError):
    """A value is larger than :data:`MAX_VALUE_BYTES`."""


def check_value_size(key: str, value: bytes, limit: int = MAX_VALUE_BYTES) -> None:
    if len(value) > limit:
        raise ValueTooLarge(f"value for {key!r} is {len(value)} bytes; the limit is {limit}")


def prefix_range_end(prefix: bytes) -> bytes:
    """The exclusive end of the key range that holds every key starting with ``prefix``."""
    end = bytearray(prefix)
    for i in range(len(end) - 1, -1, -1):
        if end[i] < 0xFF:
            end[i] += 1
            return bytes(end[: i + 1])
    return b"\0"  # the prefix is all 0xff: the range runs to the end of the keyspace


def _b(key: str | bytes) -> bytes:
    return key.encode() if isinstance(key, str) else key


@dataclass(frozen=True, slots=True)
class KeyValue:
    key: str
    value: bytes
    create_revision: int
    mod_revision: int
    version: int
    lease: int

    @classmethod
    def _from_pb(cls, kv: Any) -> KeyValue:
        return cls(kv.key.decode(), bytes(kv.value), kv.create_revision, kv.mod_revision, kv.version, kv.lease)


@dataclass(frozen=True, slots=True)
class Compare:
    """One condition of a transaction. ``target`` picks which field of ``key`` is compared with ``value``.

    A key that does not exist has version, create and mod revision 0, so ``Compare(k, "create", "==", 0)``
    means "k is absent". With ``prefix=True`` the condition must hold for every key under ``key`` (etcd's
    compare over a range; no key under it means it holds).
    """

    key: str
    target: Literal["mod", "create", "version", "value", "lease"]
    op: Literal["==", "!=", "<", ">"]
    value: int | bytes
    prefix: bool = False

    def _to_pb(self) -> Any:
        result = {"==": rpc.Compare.EQUAL, "!=": rpc.Compare.NOT_EQUAL, "<": rpc.Compare.LESS,
                  ">": rpc.Compare.GREATER}[self.op]
        c = rpc.Compare(key=_b(self.key), result=result)
        if self.prefix:
            c.range_end = prefix_range_end(_b(self.key))
        if self.target == "mod":
            c.target, c.mod_revision = rpc.Compare.MOD, int(self.value)
        elif self.target == "create":
            c.target, c.create_revision = rpc.Compare.CREATE, int(self.value)
        elif self.target == "version":
            c.target, c.version = rpc.Compare.VERSION, int(self.value)
        elif self.target == "lease":
            c.target, c.lease = rpc.Compare.LEASE, int(self.value)
        else:
            if not isinstance(self.value, bytes):
                raise TypeError("Compare on 'value' needs bytes")
            c.target, c.value = rpc.Compare.VALUE, self.value
        return c


@dataclass(frozen=True, slots=True)
class Put:
    key: str
    value: bytes
    lease: int = 0


@dataclass(frozen=True, slots=True)
class Delete:
    key: str
    prefix: bool = False


@dataclass(frozen=True, slots=True)
class Get:
    key: str
    prefix: bool = False


Op = Put | Delete | Get


@dataclass(frozen=True, slots=True)
class TxnResult:
    succeeded: bool
    revision: int
    #: For each ``Get`` in the branch that ran, the key-values it read (in op order); other ops give ``[]``.
    responses: list[list[KeyValue]] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class WatchEvent:
    type: Literal["put", "delete"]
    kv: KeyValue


class Watch:
    """A stream of events for a key or prefix, from a start revision.

    Iterate with :meth:`next` (which takes a timeout, so no wait is unbounded) or as an iterator. Cancel with
    :meth:`cancel` (also done by ``with``). Errors on the stream surface as :class:`StoreError` from ``next``.

    A stream can go silent without breaking: etcd stops delivering to a watcher that falls behind (an
    "unsynced" watcher) and a proxy can stall while the connection lives, so gRPC keepalives see nothing
    wrong. Whenever :meth:`next` has seen no response for :data:`WATCH_IDLE_CHECK` seconds it asks etcd for a
    progress report on the stream (answered at once by a synced watcher); if nothing at all arrives within the
    store's timeout after that, ``next`` raises :class:`StoreTimeout` and the caller re-reads and watches anew,
    as after any broken stream. A silent watch is thus noticed within ``WATCH_IDLE_CHECK`` + timeout seconds.
    """

    _END = object()

    def __init__(self, store: Store, key: bytes, range_end: bytes, start_revision: int) -> None:
        self._queue: queue.Queue[Any] = queue.Queue()
        self._requests: queue.Queue[Any] = queue.Queue()
        self._cancelled = threading.Event()
        self._created = threading.Event()
        self._create_error: StoreError | None = None
        self._answer_within = store.timeout
        self._last_response = time.monotonic()
        self._progress_asked: float | None = None
        create = rpc.WatchCreateRequest(key=key, range_end=range_end, start_revision=start_revision)
        self._requests.put(rpc.WatchRequest(create_request=create))
        self._call = store._watch_stub.Watch(self._request_iter(), metadata=store._auth_metadata())
        self._thread = threading.Thread(target=self._pump, args=(key,), name=f"etcd-watch:{key[:40]!r}",
                                        daemon=True)
        self._thread.start()
        if not self._created.wait(store.timeout):
            self.cancel()
            raise StoreTimeout(f"watch on {key!r} was not created within {store.timeout}s")
        if self._create_error is not None:
            self.cancel()
            raise self._create_error

    def _request_iter(self) -> Iterator[Any]:
        while True:
            req = self._requests.get()
            if req is None:
                return
            yield req

    def _pump(self, key: bytes) -> None:
        try:
            for resp in self._call:
                self._last_response = time.monotonic()
                if resp.compact_revision:
                    err: StoreError = WatchCompacted(resp.compact_revision)
                    if not self._created.is_set():
                        self._create_error = err
                        self._created.set()
                    self._queue.put(err)
                    return
                if resp.created and not resp.canceled:
                    self._created.set()
                if resp.canceled:
                    reason = resp.cancel_reason
                    err = StorePermissionDenied(f"watch on {key!r}: {store_auth.EXPLAIN['permission']}") \
                        if "permission denied" in reason else StoreError(f"watch canceled by server: {reason}")
                    if not self._created.is_set():
                        self._create_error = err
                        self._created.set()
                    self._queue.put(err)
                    return
                for ev in resp.events:
                    kind: Literal["put", "delete"] = "put" if ev.type == 0 else "delete"
                    self._queue.put(WatchEvent(kind, KeyValue._from_pb(ev.kv)))
        except grpc.RpcError as e:
            if not self._cancelled.is_set():
                failure = _map_error(e, "watch")
                if not self._created.is_set():
                    self._create_error = failure
                    self._created.set()
                self._queue.put(failure)
        finally:
            self._queue.put(self._END)

    def next(self, timeout: float | None) -> WatchEvent | None:
        """The next event, or ``None`` when ``timeout`` passes first. Raises on a broken or silent stream."""
        try:
            item = self._queue.get(timeout=timeout)
        except queue.Empty:
            self._check_silence()
            return None
        if item is self._END:
            self._queue.put(item)
            raise StoreError("watch has ended")
        if isinstance(item, StoreError):
            self._queue.put(self._END)
            raise item
        assert isinstance(item, WatchEvent)
        return item

    def _check_silence(self) -> None:
        now = time.monotonic()
        asked = self._progress_asked
        if asked is not None and self._last_response >= asked:
            self._progress_asked = asked = None
        if asked is None:
            if now - self._last_response >= WATCH_IDLE_CHECK and not self._cancelled.is_set():
                self._progress_asked = now
                self._requests.put(rpc.WatchRequest(progress_request=rpc.WatchProgressRequest()))
            return
        if now - asked > self._answer_within:
            raise StoreTimeout(f"watch silent: no answer to a progress request within {self._answer_within:g}s")

    def __iter__(self) -> Iterator[WatchEvent]:
        while True:
            ev = self.next(timeout=WATCH_IDLE_CHECK / 2)
            if ev is not None:
                yield ev

    def cancel(self) -> None:
        if self._cancelled.is_set():
            return
        self._cancelled.set()
        self._requests.put(None)
        self._call.cancel()
        self._thread.join(timeout=5)

    def __enter__(self) -> Watch:
        return self

    def __exit__(self, *exc: object) -> None:
        self.cancel()


def _map_error(e: grpc.RpcError, what: str) -> StoreError:
    code = e.code() if hasattr(e, "code") else None
    details = e.details() if hasattr(e, "details") else str(e)
    refused = store_auth.refusal(e)
    if refused == "permission":
        return StorePermissionDenied(f"etcd {what}: {store_auth.EXPLAIN[refused]} ({details})")
    if refused is not None:
        return StoreSecurityError(f"etcd {what}: {store_auth.EXPLAIN[refused]} ({details})")
    if code == grpc.StatusCode.UNAVAILABLE:
        return StoreUnavailable(f"etcd unavailable during {what}: {details}")
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return StoreTimeout(f"etcd {what} timed out")
    if code == grpc.StatusCode.CANCELLED:
        return StoreUnavailable(f"etcd {what} was cancelled: {details}")
    return StoreError(f"etcd {what} failed ({code}): {details}")


class Store:
    """A connection to an etcd v3 cluster.

    ``endpoints`` are ``host:port`` strings; gRPC balances over them (round robin) and reconnects by itself.
    Every unary call has a deadline of ``timeout`` seconds unless the call names its own.
    Thread-safe: one Store may be shared by all threads of a process.
    """

    def __init__(
        self,
        endpoints: Sequence[str],
        *,
        timeout: float = DEFAULT_TIMEOUT,
        user: str | None = None,
        password: str | None = None,
        ca_cert: bytes | None = None,
        client_cert: bytes | None = None,
        client_key: bytes | None = None,
    ) -> None:
        if not endpoints:
            raise ValueError("endpoints: at least one etcd endpoint (host:port) is required")
        for ep in endpoints:
            host, sep, port = ep.rpartition(":")
            if not sep or not host or not port.isdigit():
                raise ValueError(f"endpoints: {ep!r} is not host:port")
        if timeout <= 0:
            raise ValueError(f"timeout: must be > 0 seconds, got {timeout}")
        self.endpoints = list(endpoints)
        self.timeout = timeout
        target = endpoints[0] if len(endpoints) == 1 else "ipv4:" + ",".join(endpoints)
        options = [
            ("grpc.lb_policy_name", "round_robin"),
            ("grpc.keepalive_time_ms", 10_000),
            ("grpc.keepalive_timeout_ms", 5_000),
            ("grpc.keepalive_permit_without_calls", 1),
            # Reconnect quickly after an etcd restart instead of backing off for up to two minutes.
            ("grpc.initial_reconnect_backoff_ms", 100),
            ("grpc.max_reconnect_backoff_ms", 1_000),
        ]
        if ca_cert is not None or client_cert is not None:
            creds = grpc.ssl_channel_credentials(ca_cert, client_key, client_cert)
            self._channel = grpc.secure_channel(target, creds, options=options)
        else:
            self._channel = grpc.insecure_channel(target, options=options)
        self._kv = rpc_grpc.KVStub(self._channel)
        self._lease = rpc_grpc.LeaseStub(self._channel)
        self._watch_stub = rpc_grpc.WatchStub(self._channel)
        self._maint = rpc_grpc.MaintenanceStub(self._channel)
        self._login: store_auth.Login | None = None
        self._closed = False
        self._keepalive: _KeepAlive | None = None
        self._keepalive_lock = threading.Lock()
        if user is not None:
            self._login = store_auth.Login(self._channel, user, password or "", self.timeout)
            try:
                self._login.login()
            except grpc.RpcError as e:
                self._channel.close()
                raise _map_error(e, f"login as {user!r}") from e

    # -- plumbing ---------------------------------------------------------------------------------------

    def _call(self, fn: Any, req: Any, what: str, timeout: float | None) -> Any:
        if self._closed:
            raise StoreError("store is closed")
        metadata = self._auth_metadata()
        try:
            return fn(req, timeout=timeout or self.timeout, metadata=metadata)
        except grpc.RpcError as e:
            if not self._renewed(e, metadata, what):
                raise _map_error(e, what) from e
        try:  # refused unapplied for a stale token (store_auth): once more with the new one
            return fn(req, timeout=timeout or self.timeout, metadata=self._auth_metadata())
        except grpc.RpcError as e:
            raise _map_error(e, what) from e

    def _auth_metadata(self) -> list[tuple[str, str]] | None:
        return None if self._login is None else self._login.metadata()

    def _renewed(self, e: grpc.RpcError, stale: list[tuple[str, str]] | None, what: str) -> bool:
        """Log in again when ``e`` says the token went stale; False when it did not (or there is no login)."""
        if self._login is None or not store_auth.token_is_stale(e):
            return False
        try:
            self._login.renew(stale)
        except grpc.RpcError as err:
            raise _map_error(err, f"{what} (renewing the login of {self._login.user!r})") from err
        log.info("etcd auth token of %r renewed (%s)", self._login.user, what)
        return True

    @property
    def token_renewals(self) -> int:
        """How often this store logged in again after its auth token went stale."""
        return 0 if self._login is None else self._login.renewals

    def auth(self, method: str, request: Any, *, timeout: float | None = None) -> Any:
        """Call one method of etcd's Auth service (``UserAdd``, ``RoleGrantPermission``, ...) with this
        store's login; for :mod:`stalwart.etcd.admin`."""
        return self._call(getattr(rpc_grpc.AuthStub(self._channel), method), request, f"auth {method}", timeout)

    # -- key-value ------------------------------------------------------------------------------------

    def get(self, key: str, *, timeout: float | None = None) -> KeyValue | None:
        resp = self._call(self._kv.Range, rpc.RangeRequest(key=_b(key)), f"get {key}", timeout)
        return KeyValue._from_pb(resp.kvs[0]) if resp.kvs else None

    def get_prefix(self, prefix: str, *, keys_only: bool = False,
                   timeout: float | None = None) -> tuple[list[KeyValue], int]:
        """Every key under ``prefix`` (sorted by key) and the store revision they were read at."""
        p = _b(prefix)
        req = rpc.RangeRequest(key=p, range_end=prefix_range_end(p), keys_only=keys_only)
        resp = self._call(self._kv.Range, req, f"get prefix {prefix}", timeout)
        return [KeyValue._from_pb(kv) for kv in resp.kvs], resp.header.revision

    def count_prefix(self, prefix: str, *, timeout: float | None = None) -> int:
        p = _b(prefix)
        req = rpc.RangeRequest(key=p, range_end=prefix_range_end(p), count_only=True)
        return int(self._call(self._kv.Range, req, f"count prefix {prefix}", timeout).count)

    def put(self, key: str, value: bytes, *, lease: int = 0, timeout: float | None = None) -> int:
        """Write ``value`` and return the new store revision (which is the key's mod_revision)."""
        check_value_size(key, value)
        resp = self._call(self._kv.Put, rpc.PutRequest(key=_b(key), value=value, lease=lease),
                          f"put {key}", timeout)
        return int(resp.header.revision)

    def delete(self, key: str, *, timeout: float | None = None) -> bool:
        resp = self._call(self._kv.DeleteRange, rpc.DeleteRangeRequest(key=_b(key)), f"delete {key}", timeout)
        return bool(resp.deleted)

    def delete_prefix(self, prefix: str, *, timeout: float | None = None) -> int:
        if not prefix:
            raise ValueError("prefix: refusing to delete the whole keyspace")
        p = _b(prefix)
        req = rpc.DeleteRangeRequest(key=p, range_end=prefix_range_end(p))
        return int(self._call(self._kv.DeleteRange, req, f"delete prefix {prefix}", timeout).deleted)

    def txn(self, compare: Sequence[Compare], success: Sequence[Op], failure: Sequence[Op] = (),
            *, timeout: float | None = None) -> TxnResult:
        """Run ``success`` if every comparison holds, else ``failure``, atomically, in one round trip."""
        req = rpc.TxnRequest(compare=[c._to_pb() for c in compare],
                             success=[self._op(o) for o in success],
                             failure=[self._op(o) for o in failure])
        resp = self._call(self._kv.Txn, req, "txn", timeout)
        reads: list[list[KeyValue]] = []
        for r in resp.responses:
            if r.HasField("response_range"):
                reads.append([KeyValue._from_pb(kv) for kv in r.response_range.kvs])
            else:
                reads.append([])
        return TxnResult(bool(resp.succeeded), int(resp.header.revision), reads)

    @staticmethod
    def _op(op: Op) -> Any:
        if isinstance(op, Put):
            check_value_size(op.key, op.value)
            return rpc.RequestOp(request_put=rpc.PutRequest(key=_b(op.key), value=op.value, lease=op.lease))
        k = _b(op.key)
        end = prefix_range_end(k) if op.prefix else b""
        if isinstance(op, Delete):
            return rpc.RequestOp(request_delete_range=rpc.DeleteRangeRequest(key=k, range_end=end))
        return rpc.RequestOp(request_range=rpc.RangeRequest(key=k, range_end=end))

    def revision(self, *, timeout: float | None = None) -> int:
        """The store's current revision."""
        resp = self._call(self._kv.Range, rpc.RangeRequest(key=b"\0", limit=1), "revision", timeout)
        return int(resp.header.revision)

    def compact(self, revision: int, *, timeout: float | None = None) -> None:
        self._call(self._kv.Compact, rpc.CompactionRequest(revision=revision, physical=True), "compact",
                   timeout)

    def status(self, *, timeout: float | None = None) -> str:
        """The server's version string; raises when no member answers."""
        resp = self._call(self._maint.Status, rpc.StatusRequest(), "status", timeout)
        return str(resp.version)

    # -- watches ------------------------------------------------------------------------------------------

    def watch(self, key: str, *, prefix: bool = False, start_revision: int = 0) -> Watch:
        """Watch ``key`` (or every key under it with ``prefix``) from ``start_revision`` (0 = from now)."""
        k = _b(key)
        try:
            return Watch(self, k, prefix_range_end(k) if prefix else b"", start_revision)
        except StorePermissionDenied:
            # etcd reports a stale token on a watch as a plain denial: log in again once and see.
            if self._login is None:
                raise
            try:
                self._login.renew(None)
            except grpc.RpcError as e:
                raise _map_error(e, f"watch {key} (renewing the login of {self._login.user!r})") from e
            return Watch(self, k, prefix_range_end(k) if prefix else b"", start_revision)

    # -- leases -------------------------------------------------------------------------------------------

    def lease_grant(self, ttl: int, *, keepalive: bool = True, timeout: float | None = None) -> int:
        """Grant a lease of ``ttl`` seconds and, unless told not to, keep it alive until revoked or closed."""
        if ttl < 1:
            raise ValueError(f"ttl: a lease needs at least 1 second, got {ttl}")
        resp = self._call(self._lease.LeaseGrant, rpc.LeaseGrantRequest(TTL=ttl), "lease grant", timeout)
        if resp.error:
            raise StoreError(f"lease grant failed: {resp.error}")
        lease_id = int(resp.ID)
        if keepalive:
            self._keepalives().add(lease_id, ttl)
        return lease_id

    def lease_revoke(self, lease_id: int, *, timeout: float | None = None) -> None:
        """Revoke a lease: every key bound to it is deleted at once. Revoking an expired lease is not an error."""
        if self._keepalive is not None:
            self._keepalive.remove(lease_id)
        try:
            self._call(self._lease.LeaseRevoke, rpc.LeaseRevokeRequest(ID=lease_id), "lease revoke", timeout)
        except StoreError as e:
            if "requested lease not found" not in str(e):
                raise

    def lease_ttl(self, lease_id: int, *, timeout: float | None = None) -> int:
        """Seconds left on a lease; -1 once it has expired or was revoked."""
        resp = self._call(self._lease.LeaseTimeToLive, rpc.LeaseTimeToLiveRequest(ID=lease_id), "lease ttl",
                          timeout)
        return int(resp.TTL)

    def lease_refresh(self, lease_id: int, *, timeout: float | None = None) -> int:
        """Send one keep-alive for a lease; returns the TTL granted (0 or less if the lease is gone)."""
        for attempt in (0, 1):
            metadata = self._auth_metadata()
            call = self._lease.LeaseKeepAlive(iter([rpc.LeaseKeepAliveRequest(ID=lease_id)]),
                                              timeout=timeout or self.timeout, metadata=metadata)
            try:
                for resp in call:
                    return int(resp.TTL)
            except grpc.RpcError as e:
                if attempt or not self._renewed(e, metadata, "lease keep-alive"):
                    raise _map_error(e, "lease keep-alive") from e
        return 0

    def lost_leases(self) -> set[int]:
        """Leases kept alive by this store that etcd reported gone (expired while unreachable)."""
        return set() if self._keepalive is None else self._keepalive.lost()

    def _keepalives(self) -> _KeepAlive:
        with self._keepalive_lock:
            if self._keepalive is None:
                self._keepalive = _KeepAlive(self)
            return self._keepalive

    # -- lifecycle ------------------------------------------------------------------------------------------

    def close(self) -> None:
        """Stop keep-alives (leases then expire by TTL) and close the channel. Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._keepalive is not None:
            self._keepalive.stop()
        self._channel.close()

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class _KeepAlive:
    """One thread per Store that refreshes every kept lease at a third of its TTL, with jitter.

    A lease etcd reports as gone (TTL <= 0) is dropped and remembered in :meth:`lost`, so its owner can
    notice it was fenced out. Transient failures are retried at the next tick; the lease survives as long as
    a refresh lands within its TTL.
    """

    def __init__(self, store: Store) -> None:
        self._store = store
        self._leases: dict[int, tuple[int, float]] = {}  # id -> (ttl, next due monotonic time)
        self._lost: set[int] = set()
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="etcd-lease-keepalive", daemon=True)
        self._thread.start()

    def add(self, lease_id: int, ttl: int) -> None:
        with self._lock:
            self._leases[lease_id] = (ttl, time.monotonic() + ttl / 3)
        self._wake.set()

    def remove(self, lease_id: int) -> None:
        with self._lock:
            self._leases.pop(lease_id, None)

    def lost(self) -> set[int]:
        with self._lock:
            return set(self._lost)

    def _run(self) -> None:
        while not self._stop.is_set():
            now = time.monotonic()
            with self._lock:
                due = [(lid, ttl) for lid, (ttl, at) in self._leases.items() if at <= now]
                nxt = min((at for _, at in self._leases.values()), default=now + 1.0)
            for lid, ttl in due:
                if self._stop.is_set():
                    return
                try:
                    granted = self._store.lease_refresh(lid, timeout=max(0.5, ttl / 3))
                except StoreError as e:
                    log.warning("lease %x keep-alive failed, retrying: %s", lid, e)
                    retry = min(1.0, ttl / 6) * (0.5 + random.random())
                    with self._lock:
                        if lid in self._leases:
                            self._leases[lid] = (ttl, time.monotonic() + retry)
                    continue
                with self._lock:
                    if granted <= 0:
                        self._leases.pop(lid, None)
                        self._lost.add(lid)
                        log.warning("lease %x has expired; its keys are gone", lid)
                    elif lid in self._leases:
                        jitter = 0.9 + 0.2 * random.random()
                        self._leases[lid] = (ttl, time.monotonic() + ttl / 3 * jitter)
            with self._lock:
                nxt = min((at for _, at in self._leases.values()), default=time.monotonic() + 1.0)
            self._wake.wait(timeout=max(0.01, min(1.0, nxt - time.monotonic())))
            self._wake.clear()

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout=5)
