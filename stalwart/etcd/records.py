"""The values the etcd adapter speaks in: key-values, the comparisons and operations of a transaction, its
result, watch events. Frozen records, converted to and from the gRPC stubs' messages here."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from pyetcd.etcdrpc import rpc_pb2 as rpc

__all__ = ["Compare", "Delete", "Get", "KeyValue", "Op", "Put", "Txn", "TxnResult", "WatchEvent", "as_bytes",
           "prefix_range_end"]


def prefix_range_end(prefix: bytes) -> bytes:
    """The exclusive end of the key range that holds every key starting with ``prefix``."""
    end = bytearray(prefix)
    for i in range(len(end) - 1, -1, -1):
        if end[i] < 0xFF:
            end[i] += 1
            return bytes(end[: i + 1])
    return b"\0"  # the prefix is all 0xff: the range runs to the end of the keyspace


def as_bytes(key: str | bytes) -> bytes:
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
        c = rpc.Compare(key=as_bytes(self.key), result=result)
        if self.prefix:
            c.range_end = prefix_range_end(as_bytes(self.key))
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
    """Read ``key`` (or every key under it with ``prefix``); with ``count_only``, only how many there are (in
    :attr:`TxnResult.counts`; its ``responses`` entry is then empty); with ``keys_only``, the keys and their
    revisions without their values."""

    key: str
    prefix: bool = False
    count_only: bool = False
    keys_only: bool = False


@dataclass(frozen=True, slots=True)
class Txn:
    """A transaction inside a transaction's branch (etcd 3.3 and later). Its compares are judged, with the outer
    ones, on the store as it was before the outer transaction; its writes share the outer revision and
    proposal. Its reads are not returned (its entry in :attr:`TxnResult.responses` is empty)."""

    compare: tuple[Compare, ...]
    success: tuple[Put | Delete | Get, ...] = ()
    failure: tuple[Put | Delete | Get, ...] = ()


Op = Put | Delete | Get | Txn


@dataclass(frozen=True, slots=True)
class TxnResult:
    succeeded: bool
    revision: int
    #: For each ``Get`` in the branch that ran, the key-values it read (in op order); other ops give ``[]``.
    responses: list[list[KeyValue]] = field(default_factory=list)
    #: For each op of the branch that ran, how many keys its read found (0 for a write).
    counts: list[int] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class WatchRange:
    """One key (or, with ``prefix``, every key under it) that a watch follows; ``no_put`` leaves out the key's
    puts (etcd's NOPUT filter: only deletions come)."""

    key: str
    prefix: bool = False
    no_put: bool = False


@dataclass(frozen=True, slots=True)
class WatchEvent:
    type: Literal["put", "delete"]
    kv: KeyValue
