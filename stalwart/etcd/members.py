"""One gRPC channel per etcd endpoint, and which member a :class:`~stalwart.etcd.store.Store` speaks to now.

Why not one channel over every endpoint: gRPC's only target for several addresses (``ipv4:a:p,b:p``) takes IP
literals, not host names, and over TLS it checks every member's certificate against that one target's name. A
cluster's members are named (a StatefulSet's pods behind a headless Service: ``etcd-0.etcd.ns.svc``) and hold
certificates for those names, so the chart's three-member etcd could not be reached at all. etcd's own clients
also speak to one member at a time and move on when it fails.

A Store speaks to one member until a call to it fails for a reason another member may not share (unreachable,
or its deadline passed: a member cut off from the raft majority answers nothing in time); the next call then goes
to the next member, round the list. Which member is next is :func:`next_member`, a pure function. With etcd's
``simple`` tokens each member knows only the tokens it issued, so each member has its own login, made the first
time that member is spoken to.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from typing import Any

import grpc
from pyetcd.etcdrpc import rpc_pb2_grpc as rpc_grpc

from stalwart.etcd import auth as store_auth
from stalwart.etcd.errors import StoreError, StoreTimeout, StoreUnavailable, map_error

log = logging.getLogger(__name__)

__all__ = ["AuthedCalls", "Member", "Members", "moves_on", "next_member"]


def next_member(current: int, failed: int, count: int) -> int:
    """The member to speak to after member ``failed`` failed a call, while ``current`` is the one in use: the
    one after it, round the list; unchanged when another thread has already moved past ``failed``."""
    if count < 1:
        raise ValueError(f"count: expected at least one member, got {count}")
    if failed != current:
        return current
    return (current + 1) % count


def moves_on(error: StoreError) -> bool:
    """Whether a call that failed with ``error`` makes the Store try another member next: a member that cannot
    be reached or does not answer in time may be alone in that; a refusal (security, a bad request, a lost
    lease) would be the same from every member."""
    return isinstance(error, StoreUnavailable | StoreTimeout)


class AuthedCalls:
    """Unary calls to one member with its login's token; a call refused for a stale token logs in again and is
    made once more (etcd refuses it unapplied, so the retry cannot apply it twice). Thread-safe."""

    def __init__(self, login: store_auth.Login | None) -> None:
        self._login = login

    @property
    def renewals(self) -> int:
        return 0 if self._login is None else self._login.renewals

    def call(self, fn: Any, req: Any, what: str, timeout: float) -> Any:
        metadata = self.metadata(what)
        try:
            return fn(req, timeout=timeout, metadata=metadata)
        except grpc.RpcError as e:
            if not self.renewed(e, metadata, what):
                raise map_error(e, what) from e
        try:
            return fn(req, timeout=timeout, metadata=self.metadata(what))
        except grpc.RpcError as e:
            raise map_error(e, what) from e

    def metadata(self, what: str) -> list[tuple[str, str]] | None:
        """The token to send, logging in to this member first if it has not been yet."""
        if self._login is None:
            return None
        try:
            self._login.ensure()
        except grpc.RpcError as e:
            raise map_error(e, f"{what} (logging in as {self._login.user!r})") from e
        return self._login.metadata()

    def renew(self, what: str) -> bool:
        """Log in again (etcd reports a stale token on a watch as a plain denial); False without a login."""
        if self._login is None:
            return False
        try:
            self._login.renew(None)
        except grpc.RpcError as e:
            raise map_error(e, f"{what} (renewing the login of {self._login.user!r})") from e
        return True

    def renewed(self, e: grpc.RpcError, stale: list[tuple[str, str]] | None, what: str) -> bool:
        """Log in again when ``e`` says the token went stale; False when it did not (or there is no login)."""
        if self._login is None or not store_auth.token_is_stale(e):
            return False
        try:
            self._login.renew(stale)
        except grpc.RpcError as err:
            raise map_error(err, f"{what} (renewing the login of {self._login.user!r})") from err
        log.info("etcd auth token of %r renewed (%s)", self._login.user, what)
        return True


class Member:
    """One etcd endpoint: its channel, the stubs of the services stalwart calls, and its login."""

    def __init__(self, endpoint: str, channel: grpc.Channel, login: store_auth.Login | None) -> None:
        self.endpoint = endpoint
        self.channel = channel
        self.kv = rpc_grpc.KVStub(channel)
        self.lease = rpc_grpc.LeaseStub(channel)
        self.watch = rpc_grpc.WatchStub(channel)
        self.maint = rpc_grpc.MaintenanceStub(channel)
        self.calls = AuthedCalls(login)

    def auth_stub(self) -> Any:
        return rpc_grpc.AuthStub(self.channel)


class Members:
    """Every endpoint's :class:`Member` and the one in use. Thread-safe."""

    def __init__(self, endpoints: Sequence[str], *, options: list[tuple[str, Any]],
                 credentials: grpc.ChannelCredentials | None, user: str | None, password: str | None,
                 timeout: float) -> None:
        self._lock = threading.Lock()
        self._index = 0
        self.members: list[Member] = []
        for endpoint in endpoints:
            channel = grpc.secure_channel(endpoint, credentials, options=options) if credentials is not None \
                else grpc.insecure_channel(endpoint, options=options)
            login = store_auth.Login(channel, user, password or "", timeout) if user is not None else None
            self.members.append(Member(endpoint, channel, login))

    def current(self) -> Member:
        with self._lock:
            return self.members[self._index]

    def failed(self, member: Member, error: StoreError) -> None:
        """``member`` failed a call with ``error``: the next call goes to the next member when the failure is
        one another member may not share (:func:`moves_on`)."""
        if len(self.members) == 1 or not moves_on(error):
            return
        with self._lock:
            before = self._index
            self._index = next_member(before, self.members.index(member), len(self.members))
            after = self.members[self._index].endpoint
        if self._index != before:
            log.warning("etcd member %s failed (%s); speaking to %s next", member.endpoint, error, after)

    def login(self) -> None:
        """Log in through the first member that answers, so that a wrong user or password is refused at once;
        raises the refusal, or the last member's failure when none could be reached."""
        last: StoreError | None = None
        for _ in self.members:
            member = self.current()
            try:
                member.calls.metadata("login")
                return
            except StoreError as e:
                if not moves_on(e):
                    raise
                last = e
                self.failed(member, e)
        assert last is not None
        raise last

    @property
    def renewals(self) -> int:
        return sum(m.calls.renewals for m in self.members)

    def close(self) -> None:
        for m in self.members:
            m.channel.close()
