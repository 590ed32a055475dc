"""The torch.distributed Store of one restart iteration, on etcd.

ADAPTER: the rendezvous part of stalwart owns the general etcd torch Store; this is the small one the
in-process restart needs to bootstrap each iteration's process group, namespaced by epoch and iteration
(``JobKeys.torch_store(epoch) + "<iteration>/"``) and fenced by the epoch, so a zombie of an older round
cannot publish an address into a newer one. Waits are etcd watches with the store's timeout. Values are
opaque bytes that only torch reads; nothing is unpickled.
"""

from __future__ import annotations

import datetime
import time
from typing import Any

import torch.distributed as dist

from stalwart.agent.rendezvous.fence import Fence
from stalwart.store import Compare, Get, Put, Store, StoreError

__all__ = ["IterationStore"]


def _to_bytes(value: Any) -> bytes:
    if isinstance(value, bytes):
        return value
    if isinstance(value, str):
        return value.encode()
    if isinstance(value, list | bytearray):
        return bytes(value)
    raise TypeError(f"store value: expected bytes or str, got {type(value).__name__}")


class IterationStore(dist.Store):  # type: ignore[misc,name-defined]
    """A ``torch.distributed.Store`` over the etcd keys under ``prefix``; writes fenced by ``fence``."""

    def __init__(self, store: Store, prefix: str, fence: Fence, timeout: float) -> None:
        super().__init__()
        self._store = store
        self._prefix = prefix
        self._fence = fence
        self._timeout = float(timeout)

    def _k(self, key: str) -> str:
        return self._prefix + key

    # torch calls these ------------------------------------------------------------------------------------

    def set(self, key: str, value: Any) -> None:
        self._fence.put(self._k(key), _to_bytes(value))

    def get(self, key: str) -> bytes:
        self.wait([key])
        kv = self._store.get(self._k(key))
        if kv is None:
            raise dist.DistStoreError(f"key {key!r} vanished from the iteration store")
        return kv.value

    def add(self, key: str, amount: int) -> int:
        k = self._k(key)
        deadline = time.monotonic() + self._timeout
        while True:
            kv = self._store.get(k)
            current = int(kv.value.decode()) if kv is not None else 0
            new = current + int(amount)
            cmp = Compare(k, "mod", "==", kv.mod_revision) if kv else Compare(k, "create", "==", 0)
            res = self._fence.txn([cmp], [Put(k, str(new).encode())], [Get(k)])
            if res.succeeded:
                return new
            if time.monotonic() > deadline:
                raise dist.DistStoreError(f"add on {key!r} kept conflicting for {self._timeout}s")

    def compare_set(self, key: str, expected: Any, desired: Any) -> bytes:
        k = self._k(key)
        exp, des = _to_bytes(expected), _to_bytes(desired)
        cmp = Compare(k, "value", "==", exp) if exp else Compare(k, "create", "==", 0)
        res = self._fence.txn([cmp], [Put(k, des)], [Get(k)])
        if res.succeeded:
            return des
        current = res.responses[0]
        return current[0].value if current else exp

    def check(self, keys: list[str]) -> bool:
        return all(self._store.get(self._k(k)) is not None for k in keys)

    def delete_key(self, key: str) -> bool:
        return self._fence.delete(self._k(key)) > 0

    def num_keys(self) -> int:
        return self._store.count_prefix(self._prefix)

    def set_timeout(self, timeout: datetime.timedelta) -> None:
        self._timeout = timeout.total_seconds()

    def wait(self, keys: list[str], timeout: datetime.timedelta | None = None) -> None:
        limit = self._timeout if timeout is None else timeout.total_seconds()
        deadline = time.monotonic() + limit
        wanted = {self._k(k) for k in keys}
        kvs, revision = self._store.get_prefix(self._prefix, keys_only=True)
        missing = wanted - {kv.key for kv in kvs}
        if not missing:
            return
        with self._store.watch(self._prefix, prefix=True, start_revision=revision + 1) as w:
            while missing:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise dist.DistStoreError(
                        f"wait timeout after {limit:.0f}s for keys {sorted(missing)}")
                try:
                    ev = w.next(timeout=min(left, 1.0))
                except StoreError as e:
                    raise dist.DistStoreError(f"iteration store watch failed: {e}") from e
                if ev is not None and ev.type == "put":
                    missing.discard(ev.kv.key)
