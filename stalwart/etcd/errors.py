"""The typed errors of the etcd layer (see :mod:`stalwart.etcd.store` for what each means) and how a gRPC failure
maps onto them."""

from __future__ import annotations

import grpc

from stalwart.etcd import auth as store_auth

__all__ = ["MAX_VALUE_BYTES", "LeaseNotFound", "StoreError", "StorePermissionDenied", "StoreSecurityError",
           "StoreTimeout", "StoreUnavailable", "ValueTooLarge", "WatchCompacted", "check_value_size", "map_error"]

#: Largest value stalwart writes to etcd. etcd's own request limit is 1.5 MiB; our records are small JSON.
MAX_VALUE_BYTES = 256 * 1024


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


class LeaseNotFound(StoreError):
    """A write was bound to a lease etcd no longer has (it expired or was revoked): nothing was written."""


class ValueTooLarge(StoreError):
    """A value is larger than :data:`MAX_VALUE_BYTES`."""


def check_value_size(key: str, value: bytes, limit: int = MAX_VALUE_BYTES) -> None:
    if len(value) > limit:
        raise ValueTooLarge(f"value for {key!r} is {len(value)} bytes; the limit is {limit}")


def map_error(e: grpc.RpcError, what: str) -> StoreError:
    code = e.code() if hasattr(e, "code") else None
    details = e.details() if hasattr(e, "details") else str(e)
    refused = store_auth.refusal(e)
    if refused == "permission":
        return StorePermissionDenied(f"etcd {what}: {store_auth.EXPLAIN[refused]} ({details})")
    if refused is not None:
        return StoreSecurityError(f"etcd {what}: {store_auth.EXPLAIN[refused]} ({details})")
    if code == grpc.StatusCode.NOT_FOUND and "lease not found" in str(details):
        return LeaseNotFound(f"etcd {what}: {details}")
    if code == grpc.StatusCode.UNAVAILABLE or (code == grpc.StatusCode.INTERNAL and "Stream removed" in str(details)):
        # gRPC reports a stream whose server went away mid-answer ("Stream removed") as INTERNAL: it is the
        # connection that failed, as with UNAVAILABLE, and another member may serve.
        return StoreUnavailable(f"etcd unavailable during {what}: {details}")
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return StoreTimeout(f"etcd {what} timed out")
    if code == grpc.StatusCode.CANCELLED:
        return StoreUnavailable(f"etcd {what} was cancelled: {details}")
    return StoreError(f"etcd {what} failed ({code}): {details}")
