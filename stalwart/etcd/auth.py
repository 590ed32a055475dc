"""etcd's login for :class:`stalwart.etcd.store.Store`: the auth token, its renewal, and what a refusal means.

etcd (``--auth-token simple``, the default) hands out a token on ``Authenticate`` and forgets it after
``--auth-token-ttl`` seconds without use, or at once when the server restarts. A client must then log in again.
etcd also refuses a request whose token predates a change to its user/role tables ("revision of auth store is
old") -- as happens whenever the operator adds another job's user. Both refusals come before the request is
applied, so the one request that saw them is safe to send again with a fresh token; etcd's own Go client does
the same. :class:`Login` holds the token and renews it at most once per stale token, whichever thread notices
first.

The rest of this module reads a gRPC failure and says, in words a user can act on, what it was: no login where
etcd wants one, a wrong user or password, a key outside the user's permissions, or a TLS handshake that failed
(wrong CA, plaintext against TLS).
"""

from __future__ import annotations

import threading
from typing import Any, Literal

import grpc
from pyetcd.etcdrpc import rpc_pb2 as rpc
from pyetcd.etcdrpc import rpc_pb2_grpc as rpc_grpc

__all__ = ["Login", "Refusal", "refusal", "token_is_stale"]

#: What kind of refusal a failure was; None for everything else (down, slow, a bad request).
Refusal = Literal["tls", "login", "no-login", "auth-off", "permission"]

# etcd's messages (server/etcdserver/api/v3rpc/rpctypes), matched on the text gRPC carries.
_STALE_TOKEN = ("invalid auth token", "revision of auth store is old")
_TLS_WORDS = ("ssl", "handshake", "certificate", "tsi_", "wrong_version_number")


def _details(e: grpc.RpcError) -> str:
    return str(e.details()) if hasattr(e, "details") else str(e)


def _code(e: grpc.RpcError) -> Any:
    return e.code() if hasattr(e, "code") else None


def token_is_stale(e: grpc.RpcError) -> bool:
    """The request was refused, unapplied, because its token expired or predates an auth change."""
    details = _details(e).lower()
    return any(s in details for s in _STALE_TOKEN)


def refusal(e: grpc.RpcError) -> Refusal | None:
    """Whether ``e`` is a security refusal, and which."""
    details = _details(e).lower()
    code = _code(e)
    if code == grpc.StatusCode.UNAVAILABLE and any(w in details for w in _TLS_WORDS):
        return "tls"
    if "user name is empty" in details:
        return "no-login"
    if "authentication is not enabled" in details:
        return "auth-off"
    if "authentication failed" in details:
        return "login"
    if "permission denied" in details or code == grpc.StatusCode.PERMISSION_DENIED:
        return "permission"
    if code == grpc.StatusCode.UNAUTHENTICATED:
        return "login"
    return None


#: What each refusal means, for the error a user reads.
EXPLAIN: dict[Refusal, str] = {
    "tls": ("the TLS handshake with etcd failed: check ca.crt (is it the CA that signed etcd's server "
            "certificate?), tls.crt/tls.key, and that the endpoint speaks TLS"),
    "no-login": ("etcd has authentication on and no user was given: set username/password in the etcd "
                 "credentials Secret"),
    "login": "etcd refused the login: the username or password is wrong",
    "auth-off": "etcd has authentication off, so it cannot log this user in (turn it on, or give no login)",
    "permission": "etcd refused the request: the user has no permission on these keys",
}


class Login:
    """A user's token for one gRPC channel. Thread-safe."""

    def __init__(self, channel: grpc.Channel, user: str, password: str, timeout: float) -> None:
        if not user:
            raise ValueError("user: an etcd user name must not be empty")
        self.user = user
        self._password = password
        self._timeout = timeout
        self._stub = rpc_grpc.AuthStub(channel)
        self._lock = threading.Lock()
        self._token = ""
        #: How many times the token was renewed after the first login.
        self.renewals = 0

    def login(self) -> None:
        """Authenticate; raises ``grpc.RpcError`` on failure."""
        resp = self._stub.Authenticate(rpc.AuthenticateRequest(name=self.user, password=self._password),
                                       timeout=self._timeout)
        with self._lock:
            self._token = str(resp.token)

    def ensure(self) -> None:
        """Log in unless this channel has a token already; raises ``grpc.RpcError`` on failure."""
        with self._lock:
            if self._token:
                return
            resp = self._stub.Authenticate(rpc.AuthenticateRequest(name=self.user, password=self._password),
                                           timeout=self._timeout)
            self._token = str(resp.token)

    def metadata(self) -> list[tuple[str, str]]:
        with self._lock:
            return [("token", self._token)]

    def renew(self, stale: list[tuple[str, str]] | None) -> None:
        """Log in again, unless another thread already replaced the ``stale`` token."""
        with self._lock:
            if stale is not None and stale != [("token", self._token)]:
                return
            resp = self._stub.Authenticate(rpc.AuthenticateRequest(name=self.user, password=self._password),
                                           timeout=self._timeout)
            self._token = str(resp.token)
            self.renewals += 1
