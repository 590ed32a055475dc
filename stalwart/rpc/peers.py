"""The agent's use of its membership: the view it routes by, the round epoch it fences by, the dead.

:class:`Peers` applies membership events on the agent's loop thread and decides what a departure means
(:meth:`Peers.left`); the agent carries that decision out on its calls, its server and its layers.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from stalwart.rpc import errors as E
from stalwart.rpc.membership import Membership, MembershipView, Worker, WorkerInfo

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Departure:
    """A worker that went: the incarnation that went (``""``: unknown), whether a newer incarnation of its
    name lives on (``replaced``), and its entry in our view when it had one."""

    name: str
    gone: str
    replaced: bool
    worker: Worker | None


class Peers:
    """The membership state of agent ``name`` (loop thread, except :meth:`resolve` and :meth:`info`)."""

    def __init__(self, name: str, rank: int) -> None:
        self.name = name
        self.rank = rank
        self.view = MembershipView(0)
        self.epoch = 0
        self.dead: dict[str, str] = {}  # name -> incarnation it died in ("" when unknown)
        self.membership: Membership | None = None

    def reachable(self, name: str) -> Worker | None:
        """``name`` in our view, or (unless known dead) in the membership's newer one until the loop applies it."""
        w = self.view.members.get(name)
        if w is None and name not in self.dead and self.membership is not None:
            w = self.membership.view().members.get(name)
        return w

    def info(self, name: str) -> WorkerInfo:
        w = self.view.members.get(name)
        if w is not None:
            return w.info
        if name == self.name:
            return WorkerInfo(self.name, self.rank)
        return WorkerInfo(name, -1)

    def resolve(self, to: str | int | WorkerInfo) -> Worker:
        view = self.view
        if isinstance(to, WorkerInfo):
            to = to.name
        if isinstance(to, int):
            w = view.by_rank(to)
            if w is None:
                raise E.UnknownWorker(f"to: no worker of rank {to} in round {view.epoch}")
            return w
        w = view.members.get(to)
        if w is None and self.membership is not None:
            w = self.membership.view().members.get(to)  # newer than ours until the loop applies it
        if w is None:
            if to in self.dead:
                raise E.WorkerDied(to)
            raise E.UnknownWorker(f"to: no worker named {to!r} in round {view.epoch}: {sorted(view.members)}")
        return w

    def apply_view(self, event_view: MembershipView) -> list[str] | None:
        """Take a new view in; returns the names that came back in a new incarnation after they died, or None
        when the view is older than ours (ignored)."""
        # the latest view, not the event's snapshot: events from several threads may arrive out of order
        view = self.membership.view() if self.membership is not None else event_view
        if view.epoch < self.epoch:
            return None
        back: list[str] = []
        for name, w in view.members.items():
            died_as = self.dead.get(name)
            if died_as is not None and w.incarnation and w.incarnation != died_as:
                del self.dead[name]  # a new incarnation of that name joined
                back.append(name)
        if view.epoch > self.epoch:
            log.info("%s: RPC epoch %d -> %d", self.name, self.epoch, view.epoch)
        self.view, self.epoch = view, view.epoch
        return back

    def left(self, name: str, reason: str, incarnation: str = "") -> Departure | None:
        """``name``'s incarnation ``incarnation`` (``""``: whichever it was) is gone. None when there is
        nothing to do (ourselves, or a death already known). When a newer incarnation of the name is in the
        membership already (events from several threads may come late), the name stays reachable: only what
        belonged to the one that went is given up."""
        if name == self.name:
            return None
        latest = self.membership.view().members.get(name) if self.membership is not None else None
        replaced = bool(incarnation) and latest is not None and latest.incarnation not in ("", incarnation)
        if not replaced and name in self.dead and self.dead[name] in ("", incarnation):
            return None
        worker = self.view.members.get(name)
        gone = incarnation or (worker.incarnation if worker is not None else "")
        log.warning("%s: worker %s%s is gone (%s); failing its calls and dropping its references", self.name,
                    name, f" (incarnation {gone})" if gone else "", reason)
        if not replaced:
            self.dead[name] = gone
        return Departure(name, gone, replaced, worker)

    def live_peers(self) -> list[Worker]:
        return [w for w in self.view.members.values() if w.name != self.name and w.name not in self.dead]
