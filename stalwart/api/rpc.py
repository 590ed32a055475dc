"""The wire records of the RPC layer: the header of every RPC message and the worker record kept in etcd.

A message on the wire is one frame (see :mod:`stalwart.rpc.codec`): a 4-byte big-endian header length,
the :class:`Envelope` as compact JSON, then the raw bytes of the blobs (tensors and ``bytes`` values) that
the envelope's ``blobs`` describe, back to back. Nothing in a frame is ever unpickled.

Key layout (``P`` = ``JobKeys(ns, uid).rpc``):

``P + "workers/<name>"`` -> :class:`RpcWorkerRecord`
    One key per RPC worker (rank process), bound to that worker's lease: its deletion (lease expiry or an
    explicit leave) tells every peer the worker is gone.
"""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from stalwart.api.base import ApiModel

__all__ = [
    "MAX_HEADER_BYTES",
    "BlobMeta",
    "Envelope",
    "ErrorInfo",
    "ErrorKind",
    "MessageType",
    "RRefWire",
    "RpcWorkerRecord",
    "check_worker_name",
]

#: Largest JSON header of one message. Bulk data travels as blobs, not JSON.
MAX_HEADER_BYTES = 16 * 1024 * 1024

_WORKER_NAME = re.compile(r"^[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$")


def check_worker_name(name: str) -> str:
    """Return ``name`` if it is a valid worker name (1-128 letters, digits, ``-_.``; one etcd key segment)."""
    if len(name) > 128 or not _WORKER_NAME.fullmatch(name):
        raise ValueError(
            f"worker name {name!r} must be 1-128 letters, digits, '-', '_' or '.', starting and ending with "
            "a letter or digit")
    return name


#: What a message is for. User traffic is ``call`` and ``remote``; the rest is the RRef protocol and the
#: shutdown handshake, all idempotent and retried within their deadline.
MessageType = Literal["call", "remote", "fetch", "fork", "accept", "delete", "done"]

#: Why a request failed, as the callee (or the caller's agent) classifies it.
ErrorKind = Literal[
    "remote",  # the function raised; ``type`` and ``message`` describe the exception
    "unknown_function",  # no function of that name is registered on the callee
    "bad_request",  # the frame or payload could not be decoded or validated
    "stale_epoch",  # the sender's epoch is older than the callee's: the sender is a zombie of an old round
    "epoch_ahead",  # the sender's epoch is newer: the callee has not seen the new round yet (retryable)
    "rref_deleted",  # the RRef's value is gone on its owner
    "rref_failed",  # creating the RRef's value failed
    "owner_died",  # the RRef's owner is dead
    "shutdown",  # the callee is shutting down and takes no new work
    "expired",  # a duplicate of a request whose completion record was already collected
]


class _Wire(BaseModel):
    """Base of the per-message records: short field names (they go on every message), no unknown fields."""

    model_config = ConfigDict(extra="forbid", frozen=True)


class BlobMeta(_Wire):
    """One raw blob after the header: a tensor (``dtype``, ``shape``) or a ``bytes`` value (neither)."""

    nbytes: int = Field(ge=0, description="Length of the blob in bytes.")
    dtype: str | None = Field(default=None, max_length=32, description="torch dtype name, for tensors.")
    shape: list[int] | None = Field(default=None, max_length=64, description="Tensor shape, for tensors.")


class ErrorInfo(_Wire):
    """A failed request, as carried back in a reply."""

    kind: ErrorKind
    type: str = Field(default="", max_length=256, description="Exception class name, for kind 'remote'.")
    message: str = Field(default="", max_length=64 * 1024)
    traceback: str = Field(default="", max_length=256 * 1024, description="The callee's formatted traceback.")


class RRefWire(_Wire):
    """An RRef as passed in a payload: a new fork of it for the receiver, created by ``parent``."""

    owner: str = Field(description="Name of the worker that owns the value.")
    rref: str = Field(max_length=512, description="Globally unique id of the value.")
    fork: str = Field(max_length=512, description="Globally unique id of the receiver's new reference.")
    parent: str = Field(description="The worker that created this fork and holds it pending until accepted.")


class Envelope(_Wire):
    """The JSON header of every RPC message (request or reply)."""

    v: Literal[1] = 1
    kind: Literal["req", "rep"]
    type: MessageType
    id: int = Field(ge=0, description="Request id, unique per (src, inc); a reply echoes its request's id.")
    src: str = Field(max_length=128, description="Name of the sending worker.")
    inc: str = Field(max_length=64, description="Sending worker's incarnation (random per agent start).")
    epoch: int = Field(ge=0, description="Rendezvous epoch the sender is in; a mismatch is rejected.")
    ack: int = Field(default=0, ge=0,
                     description="Requests: every request id below this is finished at the sender.")
    fn: str | None = Field(default=None, max_length=256, description="Registered function name (call, remote).")
    rref: str | None = Field(default=None, max_length=512, description="RRef id (remote and RRef control).")
    fork: str | None = Field(default=None, max_length=512, description="Fork id (remote, fork, accept, delete).")
    err: ErrorInfo | None = None
    payload: Any = None
    blobs: list[BlobMeta] = Field(default_factory=list, max_length=1 << 16)


class RpcWorkerRecord(ApiModel):
    """What an RPC worker says about itself (the value of its lease-bound key under ``JobKeys.rpc``)."""

    name: str = Field(description="Unique worker name within the job.")
    rank: int = Field(ge=0, description="The worker's global rank in the round.")
    address: str = Field(min_length=3, max_length=300, description="host:port of the worker's RPC server.")
    epoch: int = Field(ge=0, description="The rendezvous epoch the worker registered in.")
    incarnation: str = Field(max_length=64, description="Random per agent start: tells restarts apart.")
    node: str = Field(default="", max_length=253,
                      description="Rendezvous node id (pod) the worker runs on; its loss ends the worker.")

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        return check_worker_name(v)

    def may_replace(self, current: RpcWorkerRecord | None, round_epoch: int | None = None) -> bool:
        """Whether this record may take the place of ``current`` (the record under the same name now): a
        worker of an older round never replaces one of a newer round (it is a zombie: its round is over). A
        worker of the same round may (a rank process respawned within the round is a new incarnation).
        ``round_epoch`` is the round the manifest names now (``None``: not known): a record claiming an epoch
        past it holds no round at all (no such round was ever sealed) and is replaced by the real worker."""
        if current is None or current.epoch <= self.epoch:
            return True
        return round_epoch is not None and current.epoch > round_epoch
