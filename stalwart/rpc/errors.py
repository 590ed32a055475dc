"""The typed errors of the RPC layer and of RRefs.

Every error a caller can see is an :class:`RpcError`, but one: a message of a rendezvous round that is over
is refused with the package's one fencing error, :class:`stalwart.etcd.fence.StaleEpoch` (re-exported
here), exactly as a fenced etcd write of that round would be. Code that catches every RPC failure catches
``(RpcError, StaleEpoch)``.
"""

from __future__ import annotations

from stalwart.api.rpc import ErrorInfo
from stalwart.etcd.fence import StaleEpoch

__all__ = ["EpochAhead", "NotOwner", "OwnerDied", "PayloadError", "RRefCreationFailed", "RRefDeleted", "RRefError",
           "RemoteError", "RpcError", "RpcShutdown", "RpcTimeout", "StaleEpoch", "TransportError",
           "UnknownFunction", "UnknownWorker", "WorkerDied", "error_from_info"]


class RpcError(Exception):
    """Base of every error raised by ``stalwart.rpc`` and ``stalwart.rref``."""


class RemoteError(RpcError):
    """The remote function raised. ``type`` is the exception's class name, ``remote_traceback`` its trace."""

    def __init__(self, worker: str, type_name: str, message: str, remote_traceback: str = "") -> None:
        super().__init__(f"{type_name} on {worker}: {message}")
        self.worker = worker
        self.type = type_name
        self.remote_message = message
        self.remote_traceback = remote_traceback


class UnknownFunction(RpcError):
    """No function of that name is registered (on the caller when looked up by object, or on the callee)."""


class PayloadError(RpcError):
    """A value cannot be sent (unsupported type, too large) or a received frame is malformed."""


class RpcTimeout(RpcError, TimeoutError):
    """The call's deadline passed before a reply arrived (retries included)."""


class TransportError(RpcError):
    """The message could not be delivered (connection refused or broken). Retryable for idempotent calls."""


class WorkerDied(RpcError):
    """The peer died (its lease expired) or a new round excluded it, while or before the call was pending."""

    def __init__(self, worker: str, detail: str = "") -> None:
        super().__init__(f"worker {worker!r} is dead{': ' + detail if detail else ''}")
        self.worker = worker


class UnknownWorker(RpcError):
    """No worker of that name (or rank) is in the current membership view."""


class EpochAhead(RpcError):
    """The receiver has not caught up with the sender's (newer) round yet. Retried for control messages."""


class RpcShutdown(RpcError):
    """The agent is shut down (or shutting down) and takes no new calls."""


class RRefError(RpcError):
    """Base of the RRef errors."""


class OwnerDied(RRefError, WorkerDied):
    """The RRef's owner died or left the round: its value is lost (fate-sharing with the owner)."""


class RRefDeleted(RRefError):
    """The RRef's value was already deleted on its owner (or the handle was used after its release)."""


class RRefCreationFailed(RRefError):
    """The function that was to produce the RRef's value raised, or its creator died before sending it."""


class NotOwner(RRefError):
    """``local_value()`` was called on a worker that is not the RRef's owner."""


def error_from_info(worker: str, info: ErrorInfo, *, sent_epoch: int = 0,
                    current_epoch: int | None = None) -> RpcError | StaleEpoch:
    """The exception a caller raises for an error reply ``info`` from ``worker``; a request sent in
    ``sent_epoch`` that ``worker`` (in ``current_epoch``) refused as stale raises :class:`StaleEpoch`."""
    match info.kind:
        case "remote":
            return RemoteError(worker, info.type, info.message, info.traceback)
        case "unknown_function":
            return UnknownFunction(f"{worker}: {info.message}")
        case "stale_epoch":
            return StaleEpoch(sent_epoch, current_epoch, f"{worker}: {info.message}")
        case "epoch_ahead":
            return EpochAhead(f"{worker}: {info.message}")
        case "rref_deleted":
            return RRefDeleted(f"{worker}: {info.message}")
        case "rref_failed":
            return RRefCreationFailed(f"{worker}: {info.message}")
        case "owner_died":
            return OwnerDied(worker, info.message)
        case "shutdown":
            return RpcShutdown(f"{worker} is shutting down: {info.message}")
        case "expired":
            return RpcError(f"{worker}: {info.message}")
        case _:
            return PayloadError(f"{worker} rejected the request: {info.message}")
