"""RRef handles: what user code holds. An :class:`OwnerRRef` lives on the value's owner, a :class:`UserRRef`
anywhere else; both count as references until released (explicitly with :meth:`RRef.release`, or when the
handle is garbage-collected)."""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any, Generic, Protocol, TypeVar

from stalwart.rpc.errors import RRefDeleted

if TYPE_CHECKING:
    from stalwart.rpc.membership import WorkerInfo

T = TypeVar("T")


class Runtime(Protocol):
    """What a handle needs from its worker's RRef runtime (:class:`stalwart.rref.runtime.RRefRuntime`)."""

    name: str

    def to_here(self, handle: RRef[Any], timeout: float | None) -> Any: ...

    def confirmed(self, handle: RRef[Any]) -> bool: ...

    def release(self, handle: RRef[Any]) -> None: ...

    def worker_info(self, name: str) -> WorkerInfo: ...


class RRef(Generic[T]):
    """A reference to a value owned by one worker (possibly this one)."""

    _is_stalwart_rref = True
    __slots__ = ("__weakref__", "_lock", "_released", "fork_id", "owner_name", "rref_id", "runtime")

    def __init__(self, runtime: Runtime, rref_id: str, fork_id: str | None, owner_name: str) -> None:
        self.runtime = runtime
        self.rref_id = rref_id
        self.fork_id = fork_id
        self.owner_name = owner_name
        self._released = False
        self._lock = threading.Lock()

    def owner(self) -> WorkerInfo:
        """The owner's name and rank."""
        return self.runtime.worker_info(self.owner_name)

    def is_owner(self) -> bool:
        return self.owner_name == self.runtime.name

    @property
    def confirmed(self) -> bool:
        """True once the owner is known to count this reference (always true on the owner)."""
        return self.runtime.confirmed(self)

    @property
    def released(self) -> bool:
        return self._released

    def to_here(self, timeout: float | None = None) -> T:
        """The value, fetched from the owner (a copy; tensors included).

        Raises :class:`~stalwart.rpc.errors.OwnerDied` at once when the owner is dead,
        :class:`~stalwart.rpc.errors.RRefDeleted` when the handle was released,
        :class:`~stalwart.rpc.errors.RRefCreationFailed` when the creating function raised, and
        :class:`~stalwart.rpc.errors.RpcTimeout` after ``timeout`` seconds (default: the agent's).
        """
        if self._released:
            raise RRefDeleted(f"RRef {self.rref_id} was released on this worker")
        return self.runtime.to_here(self, timeout)  # type: ignore[no-any-return]

    def local_value(self, timeout: float | None = None) -> T:
        """The value itself (not a copy); only on the owner. Waits up to ``timeout`` while it is computed."""
        from stalwart.rpc.errors import NotOwner

        if not self.is_owner():
            raise NotOwner(f"local_value() on {self.runtime.name}, but RRef {self.rref_id} is owned by "
                           f"{self.owner_name}")
        return self.to_here(timeout)

    def release(self) -> None:
        """Drop this reference now (instead of at garbage collection). Idempotent."""
        with self._lock:
            if self._released:
                return
            self._released = True
        self.runtime.release(self)

    def __del__(self) -> None:
        try:
            if not self._released:
                self._released = True
                self.runtime.release(self)
        except Exception:  # interpreter shutdown: nothing left to tell
            pass

    def __repr__(self) -> str:
        role = "OwnerRRef" if self.is_owner() else "UserRRef"
        return f"{role}(rref={self.rref_id!r}, fork={self.fork_id!r}, owner={self.owner_name!r})"


class OwnerRRef(RRef[T]):
    """A handle on the owner of the value."""

    __slots__ = ()


class UserRRef(RRef[T]):
    """A handle on a worker that does not own the value (``fork_id`` is its fork in the owner's fork set)."""

    __slots__ = ()
