"""A ``torch.distributed.Store`` on etcd v3, namespaced and fenced by a rendezvous round's epoch.

Process groups bootstrap from it (``init_process_group(store=...)``) instead of from a TCPStore served by rank
0, so no single rank process is a point of failure of the bootstrap. Its keys live under
``JobKeys.torch_store(epoch)``; every write is a fenced transaction (:class:`~.fence.Fence`), so a rank still
holding an older epoch gets :class:`StaleEpoch` instead of joining the newer group. Values are the bytes torch
gives (never unpickled here), capped at the store adapter's :data:`~stalwart.etcd.store.MAX_VALUE_BYTES`.
"""

from __future__ import annotations

import builtins
import contextlib
import functools
import time
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any, Protocol, TypeVar

import torch.distributed as dist

from stalwart.etcd.fence import Fence, StaleEpoch
from stalwart.etcd.keys import JobKeys
from stalwart.etcd.store import (
    Compare,
    Delete,
    Get,
    Op,
    Put,
    Store,
    StoreError,
    StoreTimeout,
    StoreUnavailable,
    TxnResult,
)
from stalwart.jitter import RNG

#: How often a waiter re-checks that its round is still current while no key event arrives.
_EPOCH_CHECK_INTERVAL = 1.0
_CAS_ATTEMPTS = 1000
#: How often a wait looks whether an interrupt is waiting for it to end (with a :class:`Shield`).
_INTERRUPT_POLL = 0.05

F = TypeVar("F", bound=Callable[..., Any])


class Shield(Protocol):
    """Keeps asynchronous interrupts out of the etcd client (see :attr:`EtcdTorchStore.shield`).

    ``atomic()``: a section an interrupt is not raised inside; one requested meanwhile is raised at its end.
    ``pending()``: whether such an interrupt is waiting, so that a long wait gives up at once.
    """

    def atomic(self) -> contextlib.AbstractContextManager[None]: ...

    def pending(self) -> bool: ...


def _shielded(method: F) -> F:
    @functools.wraps(method)
    def call(self: EtcdTorchStore, *args: Any, **kwargs: Any) -> Any:
        shield = self.shield
        if shield is None:
            return method(self, *args, **kwargs)
        with shield.atomic():
            return method(self, *args, **kwargs)
    return call  # type: ignore[return-value]


def _bytes(value: str | bytes | bytearray | Sequence[int]) -> bytes:
    if isinstance(value, str):
        return value.encode()
    return bytes(value)


class EtcdTorchStore(dist.Store):  # type: ignore[misc,name-defined]
    """torch's Store API over etcd for the round of ``epoch``.

    ``holder`` (``(node_id, create_revision)`` of the writer's node key) additionally fences writes to that
    node's registration. ``timeout`` (seconds) is the default for :meth:`get` and :meth:`wait`. ``scope``
    (e.g. ``"3/"`` for a restart iteration) is a sub-prefix under the epoch's, for several groups per round.

    Semantics follow TCPStore: ``get`` waits for the key; ``add`` keeps a decimal integer and creates it at
    0; ``compare_set`` sets ``desired`` when the key holds ``expected`` (or is absent and ``expected`` is
    empty) and returns the value now stored (``expected`` when absent and not set); ``wait`` raises
    ``DistStoreError`` on timeout. Every method raises :class:`StaleEpoch` once the round is over.

    ``deadline`` (a ``time.monotonic()`` instant, or ``None``) caps every wait whatever timeout torch passes:
    the restart wrapper sets it while it builds an iteration's process group, so that a group whose peers
    never arrive fails within the wrapper's deadline instead of the collective timeout (``deadline_hit``
    then tells that this was why).

    ``shield``: set by the restart wrapper, whose process group is built (through this store) while a peer's
    fault may interrupt the thread asynchronously. Such an exception raised inside gRPC's Python code can
    land between one of its locks' acquire and the ``with`` that releases it, and every later call on the
    channel then deadlocks. Each method runs inside ``shield.atomic()`` and a wait gives up with
    ``DistStoreError`` as soon as ``shield.pending()``, so the interrupt is raised at the section's end,
    between etcd calls.
    """

    deadline: float | None = None
    deadline_hit: bool = False
    shield: Shield | None = None

    def __init__(self, store: Store, keys: JobKeys, epoch: int, *, holder: tuple[str, int] | None = None,
                 timeout: float = 300.0, scope: str = "") -> None:
        super().__init__()
        if scope and not scope.endswith("/"):
            raise ValueError(f"scope: must be empty or end with '/', got {scope!r}")
        self._setup(store, keys.torch_store(epoch) + scope, Fence(store, keys, epoch, holder=holder), timeout)
        self.epoch: int | None = epoch

    @classmethod
    def unfenced(cls, store: Store, prefix: str, *, timeout: float = 300.0) -> EtcdTorchStore:
        """A store over ``prefix`` whose writes are not bound to any round (for torchrun's own rendezvous,
        which has no stalwart epoch)."""
        if not prefix.endswith("/"):
            raise ValueError(f"prefix: must end with '/', got {prefix!r}")
        self = cls.__new__(cls)
        dist.Store.__init__(self)  # type: ignore[attr-defined]
        self._setup(store, prefix, None, timeout)
        self.epoch = None
        return self

    def _setup(self, store: Store, prefix: str, fence: Fence | None, timeout: float) -> None:
        if timeout <= 0:
            raise ValueError(f"timeout: must be > 0 seconds, got {timeout}")
        self.etcd = store
        self.fence = fence
        self.prefix = prefix
        self._timeout = timeout

    def _txn(self, compare: Sequence[Compare] = (), success: Sequence[Op] = (),
             failure: Sequence[Get] = ()) -> TxnResult:
        if self.fence is not None:
            return self.fence.txn(compare, success, failure)
        return self.etcd.txn(compare, success, failure)

    def _check_epoch(self) -> None:
        if self.fence is not None:
            self.fence.check()

    def _key(self, key: str) -> str:
        return self.prefix + key

    # -- writes (fenced) -----------------------------------------------------------------------------------

    @_shielded
    def set(self, key: str, value: str | bytes) -> None:
        self._txn(success=[Put(self._key(key), _bytes(value))])

    @_shielded
    def add(self, key: str, amount: int) -> int:
        k = self._key(key)
        for attempt in range(_CAS_ATTEMPTS):
            kv = self.etcd.get(k)
            try:
                current = 0 if kv is None else int(kv.value.decode())
            except (UnicodeDecodeError, ValueError):
                raise ValueError(f"add: key {key!r} does not hold a decimal integer") from None
            new = current + int(amount)
            guard = Compare(k, "mod", "==", 0 if kv is None else kv.mod_revision)
            if self._txn([guard], [Put(k, str(new).encode())]).succeeded:
                return new
            time.sleep(min(0.05, 0.001 * (attempt + 1)) * RNG.random())
        raise StoreError(f"add: key {key!r} changed under {_CAS_ATTEMPTS} attempts in a row")

    @_shielded
    def compare_set(self, key: str, expected: str | bytes, desired: str | bytes) -> bytes:
        k = self._key(key)
        exp, want = _bytes(expected), _bytes(desired)
        guard = Compare(k, "create", "==", 0) if not exp else Compare(k, "value", "==", exp)
        res = self._txn([guard], [Put(k, want)], [Get(k)])
        if res.succeeded:
            return want
        current = res.responses[0]
        return current[0].value if current else exp

    @_shielded
    def delete_key(self, key: str) -> bool:
        k = self._key(key)
        return self._txn([Compare(k, "create", "!=", 0)], [Delete(k)]).succeeded

    @_shielded
    def append(self, key: str, value: str | bytes) -> None:
        k = self._key(key)
        for attempt in range(_CAS_ATTEMPTS):
            kv = self.etcd.get(k)
            guard = Compare(k, "mod", "==", 0 if kv is None else kv.mod_revision)
            new = (b"" if kv is None else kv.value) + _bytes(value)
            if self._txn([guard], [Put(k, new)]).succeeded:
                return
            time.sleep(min(0.05, 0.001 * (attempt + 1)) * RNG.random())
        raise StoreError(f"append: key {key!r} changed under {_CAS_ATTEMPTS} attempts in a row")

    @_shielded
    def multi_set(self, keys: list[str], values: list[str | bytes]) -> None:
        if len(keys) != len(values):
            raise ValueError(f"multi_set: {len(keys)} keys but {len(values)} values")
        puts = [Put(self._key(k), _bytes(v)) for k, v in zip(keys, values, strict=True)]
        # etcd refuses transactions of more than 128 operations (its default --max-txn-ops).
        for start in range(0, len(puts), 100):
            self._txn(success=puts[start:start + 100])

    # -- reads ---------------------------------------------------------------------------------------------

    @_shielded
    def get(self, key: str) -> bytes:
        self.wait([key])
        kv = self.etcd.get(self._key(key))
        if kv is None:  # deleted between the wait and the read
            self.wait([key])
            kv = self.etcd.get(self._key(key))
            if kv is None:
                raise dist.DistStoreError(f"key {key!r} vanished while being read")
        return kv.value

    @_shielded
    def multi_get(self, keys: list[str]) -> list[bytes]:
        return [self.get(k) for k in keys]

    @_shielded
    def check(self, keys: list[str]) -> bool:
        self._check_epoch()
        return all(self.etcd.get(self._key(k)) is not None for k in keys)

    @_shielded
    def num_keys(self) -> int:
        return self.etcd.count_prefix(self.prefix)

    def set_timeout(self, timeout: timedelta) -> None:
        seconds = timeout.total_seconds()
        if seconds <= 0:
            raise ValueError(f"timeout: must be > 0, got {timeout}")
        self._timeout = seconds

    @property
    def timeout(self) -> timedelta:
        return timedelta(seconds=self._timeout)

    @_shielded
    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        """Block until every key exists (watch, not polling); ``DistStoreError`` after the timeout,
        :class:`StaleEpoch` as soon as the round is seen to be over."""
        limit = self._timeout if timeout is None else timeout.total_seconds()
        start = time.monotonic()
        deadline = start + limit
        capped = self.deadline is not None and self.deadline < deadline
        if capped:
            deadline = self.deadline  # type: ignore[assignment]
        self._check_epoch()
        missing, revision = self._absent([self._key(k) for k in keys])
        while missing:
            try:
                self._wait_watching(missing, revision, deadline)
            except (StoreTimeout, StoreUnavailable):
                # The watch broke or went silent: read again, watch again (until the deadline).
                missing, revision = self._absent(sorted(missing))
                if time.monotonic() < deadline:
                    continue
            if missing:
                names = sorted(k[len(self.prefix):] for k in missing)
                if capped:
                    self.deadline_hit = True
                    raise dist.DistStoreError(
                        f"keys {names} did not appear within the deadline for building the process group "
                        f"({time.monotonic() - start:.1f}s; epoch {self.epoch})")
                raise dist.DistStoreError(f"wait timed out after {limit:.1f}s for keys {names} (epoch {self.epoch})")

    def _wait_watching(self, missing: builtins.set[str], revision: int, deadline: float) -> None:
        """Discard keys from ``missing`` as they are put, until none is left or ``deadline`` passes."""
        # Watching from just after the reads' revision: a key set in between is not missed.
        with self.etcd.watch(self.prefix, prefix=True, start_revision=revision + 1) as w:
            next_check = time.monotonic() + _EPOCH_CHECK_INTERVAL
            while missing:
                now = time.monotonic()
                if now >= deadline:
                    return
                if now >= next_check:
                    self._check_epoch()
                    next_check = now + _EPOCH_CHECK_INTERVAL
                until = min(deadline, next_check)
                if self.shield is not None:
                    if self.shield.pending():
                        raise dist.DistStoreError("wait given up: the iteration is being interrupted")
                    until = min(until, now + _INTERRUPT_POLL)
                ev = w.next(until - now)
                if ev is not None and ev.type == "put":
                    missing.discard(ev.kv.key)

    def _absent(self, keys: list[str]) -> tuple[builtins.set[str], int]:
        """The keys that do not exist, and the lowest revision they were read at (reads batched in
        transactions within etcd's default limit of 128 operations)."""
        absent: builtins.set[str] = builtins.set()
        revision: int | None = None
        for start in range(0, len(keys), 100):
            chunk = keys[start:start + 100]
            res = self.etcd.txn([], [Get(k) for k in chunk])
            revision = res.revision if revision is None else min(revision, res.revision)
            absent.update(k for k, found in zip(chunk, res.responses, strict=True) if not found)
        return absent, revision or 0


__all__ = ["EtcdTorchStore", "Shield", "StaleEpoch"]
