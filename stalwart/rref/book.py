"""The RRef protocol's bookkeeping on one worker: a pure state machine, no I/O, no clock, no threads.

Terms (as in PyTorch's RRef design). The **owner** of a value keeps it in an owner record together with its
**fork set**: the ids of the user references (forks) other workers hold. Every user reference has a unique
**fork id**; a worker that passes a reference on creates the receiver's fork id and is the fork's **parent**.

Guarantees:

* **G1** -- the owner learns of every deletion: a dropped user reference sends ``delete`` (a retried,
  idempotent control message) to the owner.
* **G2** -- a parent keeps its own reference (a *pending child*) until the owner has confirmed the child's
  fork, so the fork set never empties while a fork is in flight. The child asks the owner with ``fork``,
  then tells the parent with ``accept``.
* A ``delete`` (or a ``fork``/``fetch``) that reaches the owner before the value's ``remote`` creation or
  before the fork's ``fork`` request is **parked**, not lost, and applied when they arrive.
* **Fate-sharing**: when a worker dies, owners drop the forks it held and the deletes it parked, its
  pending children are released, and every reference to a value it owned fails with ``OwnerDied``.

A value is freed when its owner record is created (the ``remote`` request arrived), its fork set is empty
and no handle on the owner itself refers to it. Methods return the control messages to send; the agent
sends them (retried) and feeds the replies back.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Literal

Kind = Literal["fork", "accept", "delete", "done"]


@dataclass(frozen=True, slots=True)
class Control:
    """A control message to send: ``kind`` about ``rref``/``fork`` to worker ``dst``."""

    dst: str
    kind: Kind
    rref: str
    fork: str


@dataclass(slots=True)
class OwnerRecord:
    rref: str
    creator: str
    created: bool = False  # the ``remote`` request (or local creation) has arrived
    forks: dict[str, str] = field(default_factory=dict)  # fork id -> holder
    handles: int = 0  # live handles on the owner itself
    state: Literal["pending", "ready", "failed"] = "pending"
    value: Any = None
    error: tuple[str, str] | None = None  # (kind, message) when state is "failed"


@dataclass(slots=True)
class UserRecord:
    fork: str
    rref: str
    owner: str
    parent: str
    confirmed: bool
    released: bool = False
    owner_dead: bool = False


@dataclass(slots=True)
class PendingChild:
    fork: str
    rref: str
    dst: str
    keep: Any  # the parent's own handle, held alive until the child is accepted (G2)
    parent_fork: str | None = None  # the parent's own fork id (None when the parent is the owner)


def creator_of(rref_id: str) -> str:
    """The worker that created ``rref_id`` (ids are ``creator:incarnation:counter``)."""
    return rref_id.rsplit(":", 2)[0]


class RRefBook:
    """The RRef state of worker ``me``. Every method is called from one thread (the agent's loop)."""

    def __init__(self, me: str, *, freed_memory: int = 100_000) -> None:
        self.me = me
        self.owners: dict[str, OwnerRecord] = {}
        self.parked: dict[str, dict[str, str]] = {}  # rref -> {fork id: holder} deleted before known
        self.users: dict[str, UserRecord] = {}
        self.children: dict[str, PendingChild] = {}
        self.deferred: dict[str, UserRecord] = {}  # released forks whose delete waits for their children
        self.dead: set[str] = set()
        self.freed: OrderedDict[str, None] = OrderedDict()  # recently freed ids, to answer late fetches
        self._freed_memory = freed_memory
        self.generation = 0  # number of values freed so far (tests compare it against live handles)
        self.freed_log: list[str] | None = None  # set to a list to record every freed id (tests)
        self.after_death: list[Control] = []  # deferred deletes that a death released (see worker_died)

    # -- owner side -------------------------------------------------------------------------------------

    def _record(self, rref: str, creator: str) -> OwnerRecord:
        rec = self.owners.get(rref)
        if rec is None:
            rec = self.owners[rref] = OwnerRecord(rref, creator)
        return rec

    def create(self, rref: str, fork: str | None, holder: str) -> list[str]:
        """The value ``rref`` is being created here for ``holder`` (``fork`` None: a local creation, whose
        handle must be added first). Returns ``[rref]`` if it is freed at once (its only fork was deleted
        before the creation arrived)."""
        rec = self._record(rref, holder)
        rec.created = True
        if fork is not None:
            self._add_fork(rec, fork, holder)
        return self._maybe_free(rec)

    def _add_fork(self, rec: OwnerRecord, fork: str, holder: str) -> None:
        parked = self.parked.get(rec.rref)
        if parked is not None and fork in parked:
            del parked[fork]  # the delete overtook this fork: it is already over
            if not parked:
                del self.parked[rec.rref]
            return
        if holder in self.dead:
            return
        rec.forks[fork] = holder

    def fork_request(self, rref: str, fork: str, holder: str) -> bool:
        """``holder`` asks to add ``fork``. False when ``rref`` was already freed (a protocol violation)."""
        parked = self.parked.get(rref)
        if parked is not None and fork in parked:
            del parked[fork]  # the fork's delete came first: it is already over
            if not parked:
                del self.parked[rref]
            return True
        if rref not in self.owners and rref in self.freed:
            return False
        self._add_fork(self._record(rref, creator_of(rref)), fork, holder)
        return True

    def delete_request(self, rref: str, fork: str, holder: str) -> list[str]:
        """``holder`` dropped ``fork``. Parks the delete if the fork is not known yet; returns freed ids."""
        rec = self.owners.get(rref)
        if rec is not None and fork in rec.forks:
            del rec.forks[fork]
            return self._maybe_free(rec)
        if holder not in self.dead and rref not in self.freed:
            self.parked.setdefault(rref, {})[fork] = holder
        return []

    def set_value(self, rref: str, value: Any) -> bool:
        """The value was computed; False if the record is gone (freed meanwhile: the value is dropped)."""
        rec = self.owners.get(rref)
        if rec is None:
            return False
        rec.state, rec.value = "ready", value
        return True

    def set_error(self, rref: str, kind: str, message: str) -> None:
        rec = self.owners.get(rref)
        if rec is not None:
            rec.state, rec.error = "failed", (kind, message)

    def handle_added(self, rref: str) -> OwnerRecord:
        rec = self._record(rref, creator_of(rref))
        rec.handles += 1
        return rec

    def handle_dropped(self, rref: str) -> list[str]:
        rec = self.owners.get(rref)
        if rec is None:
            return []
        rec.handles -= 1
        return self._maybe_free(rec)

    def _maybe_free(self, rec: OwnerRecord) -> list[str]:
        if (rec.created and not rec.forks and rec.handles <= 0
                and not any(c.rref == rec.rref for c in self.children.values())):
            del self.owners[rec.rref]
            rec.value = None
            self.generation += 1
            self.freed[rec.rref] = None
            if len(self.freed) > self._freed_memory:
                self.freed.popitem(last=False)
            if self.freed_log is not None:
                self.freed_log.append(rec.rref)
            return [rec.rref]
        return []

    # -- user side --------------------------------------------------------------------------------------

    def new_user(self, fork: str, rref: str, owner: str, parent: str, *, confirmed: bool) -> UserRecord:
        rec = UserRecord(fork, rref, owner, parent, confirmed, owner_dead=owner in self.dead)
        self.users[fork] = rec
        return rec

    def received(self, rref: str, fork: str, owner: str, parent: str) -> tuple[UserRecord | None, list[Control]]:
        """A reference arrived in a payload. Returns the new user record (None when we own the value) and
        the control messages to send."""
        if owner == self.me:
            self.handle_added(rref)
            return None, self.accepted_by_child(fork, parent, rref)
        if parent == owner:  # the owner forked it to us and already counts the fork
            return self.new_user(fork, rref, owner, parent, confirmed=True), []
        rec = self.new_user(fork, rref, owner, parent, confirmed=False)
        if rec.owner_dead:
            return rec, []
        return rec, [Control(owner, "fork", rref, fork)]

    def fork_confirmed(self, fork: str, rref: str, parent: str) -> list[Control]:
        """The owner acknowledged our ``fork``: the reference is confirmed; tell the parent."""
        rec = self.users.get(fork)
        if rec is not None:
            rec.confirmed = True
        return self.accepted_by_child(fork, parent, rref)

    def accepted_by_child(self, fork: str, parent: str, rref: str) -> list[Control]:
        """We (the child of ``fork``) are settled with the owner: release the parent's pending child."""
        if parent == self.me:
            child = self.children.pop(fork, None)
            # our own handle may have been released meanwhile: its deferred delete goes out now
            return self._child_gone(child)[0] if child is not None else []
        if parent in self.dead:
            return []
        return [Control(parent, "accept", rref, fork)]

    def child_accepted(self, fork: str) -> tuple[list[Control], list[str]]:
        """The child of ``fork`` is confirmed by the owner: stop keeping our own reference for it.

        Returns the deferred delete of our own fork, if the user released it while children were pending,
        and the ids freed here (when we are the owner)."""
        child = self.children.pop(fork, None)
        if child is None:
            return [], []
        return self._child_gone(child)

    def _child_gone(self, child: PendingChild) -> tuple[list[Control], list[str]]:
        if child.parent_fork is None:
            rec = self.owners.get(child.rref)
            return [], (self._maybe_free(rec) if rec is not None else [])
        pf = child.parent_fork
        if pf in self.deferred and not any(c.parent_fork == pf for c in self.children.values()):
            user = self.deferred.pop(pf)
            if not (user.owner_dead or user.owner in self.dead):
                return [Control(user.owner, "delete", user.rref, pf)], []
        return [], []

    def fork_for(self, dst: str, rref: str, owner: str, new_fork: str, keep: Any, *,
                 own_fork: str | None = None) -> str:
        """Pass our reference to ``rref`` (our fork ``own_fork``; None on the owner) on to ``dst`` as
        ``new_fork``; returns the wire parent."""
        if owner == self.me:
            if dst != self.me:
                self._add_fork(self._record(rref, creator_of(rref)), new_fork, dst)
                return self.me
            # to ourselves: keep the value alive until the new handle exists
            self.children[new_fork] = PendingChild(new_fork, rref, dst, keep)
            return self.me
        self.children[new_fork] = PendingChild(new_fork, rref, dst, keep, own_fork)
        return self.me

    def fork_abandoned(self, fork: str) -> tuple[list[Control], list[str]]:
        """A fork we created was never delivered (its call failed before sending): undo it. Returns the
        deferred delete it releases and the ids freed."""
        child = self.children.pop(fork, None)
        controls, freed = self._child_gone(child) if child is not None else ([], [])
        for rec in list(self.owners.values()):
            if rec.forks.pop(fork, None) is not None:
                freed += self._maybe_free(rec)
        return controls, freed

    def released(self, fork: str) -> list[Control]:
        """The user handle of ``fork`` was dropped: tell the owner (G1) -- once no child forked from it is
        still waiting for the owner's confirmation (G2), even when the user released the handle explicitly."""
        rec = self.users.pop(fork, None)
        if rec is None or rec.released:
            return []
        rec.released = True
        if rec.owner_dead or rec.owner in self.dead:
            return []
        if any(c.parent_fork == fork for c in self.children.values()):
            self.deferred[fork] = rec
            return []
        return [Control(rec.owner, "delete", rec.rref, fork)]

    # -- fate-sharing -----------------------------------------------------------------------------------

    def worker_died(self, name: str) -> list[str]:
        """``name`` is dead: drop its forks and parked deletes, its pending children and creations; mark the
        references to its values. Returns the ids freed here as a result; deletes that waited for children
        sent to ``name`` are left in :attr:`after_death` for the caller to send."""
        if name == self.me:
            return []
        self.dead.add(name)
        freed: list[str] = []
        for rref in list(self.parked):
            forks = self.parked[rref]
            for f in [f for f, h in forks.items() if h == name]:
                del forks[f]
            if not forks:
                del self.parked[rref]
        for rec in list(self.owners.values()):
            for f in [f for f, h in rec.forks.items() if h == name]:
                del rec.forks[f]
            if not rec.created and rec.creator == name:
                rec.created = True  # it will never arrive
                rec.state, rec.error = "failed", ("rref_failed", f"its creator {name} died before creating it")
            freed += self._maybe_free(rec)
        controls: list[Control] = []
        for fork in [f for f, c in self.children.items() if c.dst == name]:
            more, also_freed = self._child_gone(self.children.pop(fork))
            controls += more
            freed += also_freed
        for fork in [f for f, u in self.deferred.items() if u.owner == name]:
            del self.deferred[fork]
        self.after_death = controls
        for user in self.users.values():
            if user.owner == name:
                user.owner_dead = True
        return freed

    def is_quiescent(self) -> bool:
        """No owned value, parked delete, pending child or live user reference remains."""
        return not (self.owners or self.parked or self.children or self.users or self.deferred)

    def summary(self) -> dict[str, Any]:
        """Plain-data state for leak reports and tests."""
        return {
            "owners": {r: sorted(rec.forks.values()) + (["<handles>"] * rec.handles)
                       for r, rec in self.owners.items()},
            "parked": {r: sorted(f) for r, f in self.parked.items()},
            "children": sorted(self.children),
            "deferred": sorted(self.deferred),
            "users": sorted(self.users),
            "generation": self.generation,
        }
