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
import threading
from collections.abc import Callable, Sequence
from typing import Any

import grpc
from pyetcd.etcdrpc import rpc_pb2 as rpc

from stalwart import exits
from stalwart.etcd.errors import (
    MAX_VALUE_BYTES,
    LeaseNotFound,
    StoreError,
    StorePermissionDenied,
    StoreSecurityError,
    StoreTimeout,
    StoreUnavailable,
    ValueTooLarge,
    WatchCompacted,
    check_value_size,
    map_error,
)
from stalwart.etcd.leases import KeepAlive
from stalwart.etcd.members import Member, Members
from stalwart.etcd.records import (
    Compare,
    Delete,
    Get,
    KeyValue,
    Op,
    Put,
    Txn,
    TxnResult,
    WatchEvent,
    WatchRange,
    as_bytes,
    prefix_range_end,
)
from stalwart.etcd.watch import Watch

log = logging.getLogger(__name__)

# The adapter's public face: callers import the records and errors from here.
__all__ = [
    "DEFAULT_TIMEOUT", "MAX_VALUE_BYTES", "Compare", "Delete", "Get", "KeyValue", "LeaseNotFound", "Op", "Put", "Store",
    "StoreError", "StorePermissionDenied", "StoreSecurityError", "StoreTimeout", "StoreUnavailable", "Txn", "TxnResult",
    "ValueTooLarge", "Watch", "WatchCompacted", "WatchEvent", "WatchRange", "check_value_size", "prefix_range_end",
]

DEFAULT_TIMEOUT = 5.0


class Store:
    """A connection to an etcd v3 cluster.

    ``endpoints`` are ``host:port`` strings, the members of one etcd cluster: the Store speaks to one of them
    at a time and moves to the next when it fails (:mod:`stalwart.etcd.members`); each channel reconnects by
    itself.
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
        options = [
            ("grpc.keepalive_time_ms", 10_000),
            ("grpc.keepalive_timeout_ms", 5_000),
            ("grpc.keepalive_permit_without_calls", 1),
            # Reconnect quickly after an etcd restart instead of backing off for up to two minutes.
            ("grpc.initial_reconnect_backoff_ms", 100),
            ("grpc.max_reconnect_backoff_ms", 1_000),
            # A job's prefix outgrows gRPC's default 4 MiB answer at about 10,000 nodes or ranks (a round's
            # restart records are about 300 bytes per rank); etcd itself sends answers of any size.
            ("grpc.max_receive_message_length", 64 * 1024 * 1024),
        ]
        creds = grpc.ssl_channel_credentials(ca_cert, client_key, client_cert) \
            if ca_cert is not None or client_cert is not None else None
        self._members = Members(endpoints, options=options, credentials=creds, user=user, password=password,
                                timeout=timeout)
        self._closed = False
        self._keepalive: KeepAlive | None = None
        self._keepalive_lock = threading.Lock()
        #: The watches open on this store: :meth:`close` cancels them, so no stream outlives the Store.
        self._watches: set[Watch] = set()
        if user is not None:
            try:
                self._members.login()
            except BaseException:
                self._members.close()
                raise
        exits.track(self)

    # -- plumbing ---------------------------------------------------------------------------------------

    def _call(self, method: Callable[[Member], Any], req: Any, what: str, timeout: float | None, *,
              repeatable: bool = False) -> Any:
        """One unary call to the member in use. A member that cannot be reached or does not answer in time is
        left for the next; a ``repeatable`` call (a read) that found it unreachable is made once more there,
        since nothing was applied. Other calls raise, as the caller alone knows whether they are safe to
        repeat."""
        if self._closed:
            raise StoreError("store is closed")
        member = self._members.current()
        try:
            return member.calls.call(method(member), req, what, timeout or self.timeout)
        except StoreError as e:
            self._members.failed(member, e)
            if not (repeatable and isinstance(e, StoreUnavailable)) or self._members.current() is member:
                raise
        member = self._members.current()
        try:
            return member.calls.call(method(member), req, what, timeout or self.timeout)
        except StoreError as e:
            self._members.failed(member, e)
            raise

    def _metadata(self, member: Member, what: str) -> list[tuple[str, str]] | None:
        """The login token for a stream to ``member``; a member that cannot log us in is left for the next."""
        try:
            return member.calls.metadata(what)
        except StoreError as e:
            self._members.failed(member, e)
            raise

    def _stream_failed(self, member: Member, error: StoreError) -> None:
        """A watch stream to ``member`` broke or fell silent: the next one goes to another member."""
        self._members.failed(member, error)

    @property
    def token_renewals(self) -> int:
        """How often this store logged in again after its auth token went stale."""
        return self._members.renewals

    def auth(self, method: str, request: Any, *, timeout: float | None = None) -> Any:
        """Call one method of etcd's Auth service (``UserAdd``, ``RoleGrantPermission``, ...) with this
        store's login; for :mod:`stalwart.etcd.admin`."""
        return self._call(lambda m: getattr(m.auth_stub(), method), request, f"auth {method}", timeout)

    # -- key-value ------------------------------------------------------------------------------------

    def get(self, key: str, *, timeout: float | None = None) -> KeyValue | None:
        resp = self._call(lambda m: m.kv.Range, rpc.RangeRequest(key=as_bytes(key)), f"get {key}", timeout,
                          repeatable=True)
        return KeyValue._from_pb(resp.kvs[0]) if resp.kvs else None

    def get_prefix(self, prefix: str, *, keys_only: bool = False,
                   timeout: float | None = None) -> tuple[list[KeyValue], int]:
        """Every key under ``prefix`` (sorted by key) and the store revision they were read at."""
        p = as_bytes(prefix)
        req = rpc.RangeRequest(key=p, range_end=prefix_range_end(p), keys_only=keys_only)
        resp = self._call(lambda m: m.kv.Range, req, f"get prefix {prefix}", timeout, repeatable=True)
        return [KeyValue._from_pb(kv) for kv in resp.kvs], resp.header.revision

    def count_prefix(self, prefix: str, *, timeout: float | None = None) -> int:
        p = as_bytes(prefix)
        req = rpc.RangeRequest(key=p, range_end=prefix_range_end(p), count_only=True)
        return int(self._call(lambda m: m.kv.Range, req, f"count prefix {prefix}", timeout, repeatable=True).count)

    def put(self, key: str, value: bytes, *, lease: int = 0, timeout: float | None = None) -> int:
        """Write ``value`` and return the new store revision (which is the key's mod_revision)."""
        check_value_size(key, value)
        resp = self._call(lambda m: m.kv.Put, rpc.PutRequest(key=as_bytes(key), value=value, lease=lease),
                          f"put {key}", timeout)
        return int(resp.header.revision)

    def delete(self, key: str, *, timeout: float | None = None) -> bool:
        resp = self._call(lambda m: m.kv.DeleteRange, rpc.DeleteRangeRequest(key=as_bytes(key)), f"delete {key}",
                          timeout)
        return bool(resp.deleted)

    def delete_prefix(self, prefix: str, *, timeout: float | None = None) -> int:
        if not prefix:
            raise ValueError("prefix: refusing to delete the whole keyspace")
        p = as_bytes(prefix)
        req = rpc.DeleteRangeRequest(key=p, range_end=prefix_range_end(p))
        return int(self._call(lambda m: m.kv.DeleteRange, req, f"delete prefix {prefix}", timeout).deleted)

    def txn(self, compare: Sequence[Compare], success: Sequence[Op], failure: Sequence[Op] = (),
            *, timeout: float | None = None) -> TxnResult:
        """Run ``success`` if every comparison holds, else ``failure``, atomically, in one round trip."""
        req = rpc.TxnRequest(compare=[c._to_pb() for c in compare],
                             success=[self._op(o) for o in success],
                             failure=[self._op(o) for o in failure])
        resp = self._call(lambda m: m.kv.Txn, req, "txn", timeout)
        reads: list[list[KeyValue]] = []
        counts: list[int] = []
        for r in resp.responses:
            if r.HasField("response_range"):
                reads.append([KeyValue._from_pb(kv) for kv in r.response_range.kvs])
                counts.append(int(r.response_range.count))
            else:
                reads.append([])
                counts.append(0)
        return TxnResult(bool(resp.succeeded), int(resp.header.revision), reads, counts)

    @staticmethod
    def _op(op: Op) -> Any:
        if isinstance(op, Txn):
            return rpc.RequestOp(request_txn=rpc.TxnRequest(compare=[c._to_pb() for c in op.compare],
                                                            success=[Store._op(o) for o in op.success],
                                                            failure=[Store._op(o) for o in op.failure]))
        if isinstance(op, Put):
            check_value_size(op.key, op.value)
            return rpc.RequestOp(request_put=rpc.PutRequest(key=as_bytes(op.key), value=op.value, lease=op.lease))
        k = as_bytes(op.key)
        end = prefix_range_end(k) if op.prefix else b""
        if isinstance(op, Delete):
            return rpc.RequestOp(request_delete_range=rpc.DeleteRangeRequest(key=k, range_end=end))
        return rpc.RequestOp(request_range=rpc.RangeRequest(key=k, range_end=end, count_only=op.count_only,
                                                            keys_only=op.keys_only))

    def revision(self, *, timeout: float | None = None) -> int:
        """The store's current revision."""
        resp = self._call(lambda m: m.kv.Range, rpc.RangeRequest(key=b"\0", limit=1), "revision", timeout,
                          repeatable=True)
        return int(resp.header.revision)

    def compact(self, revision: int, *, timeout: float | None = None) -> None:
        self._call(lambda m: m.kv.Compact, rpc.CompactionRequest(revision=revision, physical=True), "compact",
                   timeout)

    def status(self, *, timeout: float | None = None) -> str:
        """The server's version string; raises when no member answers."""
        resp = self._call(lambda m: m.maint.Status, rpc.StatusRequest(), "status", timeout, repeatable=True)
        return str(resp.version)

    # -- watches ------------------------------------------------------------------------------------------

    def watch(self, key: str, *, prefix: bool = False, start_revision: int = 0) -> Watch:
        """Watch ``key`` (or every key under it with ``prefix``) from ``start_revision`` (0 = from now)."""
        return self.watch_ranges([WatchRange(key, prefix=prefix)], start_revision=start_revision)

    def watch_ranges(self, ranges: Sequence[WatchRange], *, start_revision: int = 0) -> Watch:
        """One watch over several keys or prefixes (one gRPC stream, their events in revision order), from
        ``start_revision`` (0 = from now): a process that needs a few narrow parts of a prefix is not sent the
        rest of it."""
        if not ranges:
            raise ValueError("ranges: expected at least one WatchRange")
        wanted = [(as_bytes(r.key), r.prefix, r.no_put) for r in ranges]
        specs = [(k, prefix_range_end(k) if prefix else b"", no_put) for k, prefix, no_put in wanted]
        try:
            return Watch(self, specs, start_revision)
        except StorePermissionDenied:
            # etcd reports a stale token on a watch as a plain denial: log in again once and see.
            if not self._members.current().calls.renew(f"watch {ranges[0].key}"):
                raise
            return Watch(self, specs, start_revision)

    # -- leases -------------------------------------------------------------------------------------------

    def lease_grant(self, ttl: int, *, keepalive: bool = True, timeout: float | None = None) -> int:
        """Grant a lease of ``ttl`` seconds and, unless told not to, keep it alive until revoked or closed."""
        if ttl < 1:
            raise ValueError(f"ttl: a lease needs at least 1 second, got {ttl}")
        resp = self._call(lambda m: m.lease.LeaseGrant, rpc.LeaseGrantRequest(TTL=ttl), "lease grant", timeout)
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
            self._call(lambda m: m.lease.LeaseRevoke, rpc.LeaseRevokeRequest(ID=lease_id), "lease revoke", timeout)
        except StoreError as e:
            if "requested lease not found" not in str(e):
                raise

    def lease_ttl(self, lease_id: int, *, timeout: float | None = None) -> int:
        """Seconds left on a lease; -1 once it has expired or was revoked."""
        resp = self._call(lambda m: m.lease.LeaseTimeToLive, rpc.LeaseTimeToLiveRequest(ID=lease_id), "lease ttl",
                          timeout, repeatable=True)
        return int(resp.TTL)

    def lease_refresh(self, lease_id: int, *, timeout: float | None = None) -> int:
        """Send one keep-alive for a lease; returns the TTL granted (0 or less if the lease is gone)."""
        member = self._members.current()
        for attempt in (0, 1):
            metadata = self._metadata(member, "lease keep-alive")
            call = member.lease.LeaseKeepAlive(iter([rpc.LeaseKeepAliveRequest(ID=lease_id)]),
                                               timeout=timeout or self.timeout, metadata=metadata)
            try:
                for resp in call:
                    return int(resp.TTL)
            except grpc.RpcError as e:
                if attempt or not member.calls.renewed(e, metadata, "lease keep-alive"):
                    failure = map_error(e, "lease keep-alive")
                    self._members.failed(member, failure)
                    raise failure from e
            finally:
                # The stream has given its one answer; ended here, not whenever the collector gets to it
                # (at interpreter exit that is where it can deadlock: see stalwart.exits).
                call.cancel()
        return 0

    def lost_leases(self) -> set[int]:
        """Leases kept alive by this store that etcd reported gone (expired while unreachable)."""
        return set() if self._keepalive is None else self._keepalive.lost()

    def _keepalives(self) -> KeepAlive:
        with self._keepalive_lock:
            if self._keepalive is None:
                self._keepalive = KeepAlive(self)
            return self._keepalive

    # -- lifecycle ------------------------------------------------------------------------------------------

    def close(self) -> None:
        """Cancel every open watch, stop keep-alives (leases then expire by TTL) and close the channel, so that
        no stream of this Store outlives it. Idempotent."""
        with self._keepalive_lock:
            if self._closed:
                return
            self._closed = True
            watches = list(self._watches)
        for watch in watches:
            watch.cancel()
        if self._keepalive is not None:
            self._keepalive.stop()
        self._members.close()
        exits.untrack(self)

    def _opened(self, watch: Watch) -> None:
        with self._keepalive_lock:
            if self._closed:
                raise StoreError("store is closed")
            self._watches.add(watch)

    def _ended(self, watch: Watch) -> None:
        with self._keepalive_lock:
            self._watches.discard(watch)

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
