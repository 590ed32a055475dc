"""The rendezvous protocol as a pure state machine: ``step(state, event) -> (state, actions)``.

Nothing here does I/O or reads a clock; the driver (:mod:`.driver`) feeds it what etcd said and the time, and
carries out the actions it returns. The state is what one process knows of one job's rendezvous prefix (the
:class:`View`, built only from etcd's own revisions) plus the sealer's last-call deadline.

The rules:

* A round is **live** while its manifest exists, no member's node key was deleted since the view the round was
  planned over (``Manifest.view_revision``: every member's key existed then, and none was created between it
  and the seal), and no re-rendezvous request names its epoch. Otherwise the round has **ended** (or none was
  ever sealed): a new one is due.
* Closing stops new rounds; a live round runs on.
* The **sealer** is the node holding the ``sealer`` key, created only if absent under the node's lease: the
  first present node to claim it (:class:`Claim`) holds it until its lease goes; then the others claim it
  again. Only the sealer writes a manifest, in one transaction. The transaction also refuses a manifest
  planned over a view that misses a node already registered, so a node left out of a round is always one
  that arrived after it.
* Only the sealer's process needs every node key (a **full** view, from a watch of the whole prefix). Every
  other process has a **light** view: the control keys (manifest, request, closed, expected, sealer), the
  deletions of node keys (etcd's NOPUT filter) and its own nodes' keys, which it learns when it registers.
  So a node's registration is sent to one watcher instead of to every node, and a member's loss, which is a
  deletion, still reaches everyone. The two views judge a round alike (table and interleaving tests).
* A new round is sealed when ``max_nodes`` are present (for the first round, ``max_nodes`` ordinary
  nodes: spares do not count), or the expected set is present (and at least ``min_nodes``), or at least
  ``min_nodes`` are present and the last call has run out.
* Membership (:func:`plan_round`): survivors of the previous round first, then ordinary nodes by age, then hot
  spares by age; the first ``max_nodes`` are members, the rest spares. A survivor keeps its group rank when it
  still fits; holes are filled in order, so a replacement takes over the ranks of the node it replaces.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Literal

from stalwart.agent.rendezvous.settings import RendezvousSettings
from stalwart.agent.rendezvous.view import (
    KeyDeleted,
    KeyEvent,
    KeyPut,
    NodeEntry,
    SealedRound,
    SealerClaim,
    View,
    apply,
    parse_record,
)
from stalwart.api.rendezvous import MAX_LOST, Manifest, Member

# The records and the view live in .view; they are part of the protocol's vocabulary, so they are named here too.
__all__ = [
    "Claim", "ClaimFailed", "EndRound", "Event", "KeyDeleted", "KeyEvent", "KeyPut", "LocalNode", "NodeEntry",
    "Observed", "Reloaded", "RendezvousAction", "Role", "RoundStatus", "Seal", "SealFailed", "SealedRound",
    "SealerClaim", "State", "Tick", "View", "WakeAt", "apply", "parse_record", "plan_round", "ready_to_seal",
    "role_of", "round_status", "step", "waiting_nodes",
]


# -- judgements over a view -----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class RoundStatus:
    """Whether the last sealed round is live, and if not, why a new one is due."""

    live: bool
    reason: str
    lost: tuple[str, ...] = ()


def round_status(view: View) -> RoundStatus:
    """Live while the manifest exists, all its members are present in the incarnation it sealed, and no
    request names its epoch."""
    cached = view.memo.get("status")
    if isinstance(cached, RoundStatus):
        return cached
    status = _round_status(view)
    view.memo["status"] = status
    return status


def _round_status(view: View) -> RoundStatus:
    if view.sealed is None:
        return RoundStatus(False, "first round")
    epoch, planned = view.epoch, view.sealed.header.view_revision
    # A full view sees the members' keys themselves; every view sees the deletions of the members it knows (a
    # light view of a large manifest knows its own buckets: the sealer ends the round for it, see EndRound).
    sealed = view.sealed
    members = sealed.manifest.members if sealed.manifest is not None else sorted(
        sealed.members.values(), key=lambda m: m.group_rank)
    lost = tuple(m.node_id for m in members
                 if view.gone.get(m.node_id, 0) > planned
                 or (view.full and ((e := view.nodes.get(m.node_id)) is None or e.create_revision > epoch)))
    if lost:
        return RoundStatus(False, f"member{'s' if len(lost) > 1 else ''} lost: {', '.join(lost[:8])}"
                           + (f" and {len(lost) - 8} more" if len(lost) > 8 else ""), lost)
    if view.request is not None and view.request.epoch == epoch:
        r = view.request
        return RoundStatus(False, f"re-rendezvous requested by {r.node_id}" + (f": {r.reason}" if r.reason else ""),
                           tuple(r.lost))
    return RoundStatus(True, "")


Role = Literal["member", "spare", "waiting"]


def role_of(view: View, node_id: str) -> Role | None:
    """This node's place in the last sealed round: member, spare, waiting (present but not in it), or
    ``None`` when its key is not present. A light view of a large manifest must hold the node's bucket
    (``view.sealed.knows``) for the answer to mean anything, unless the node arrived after the seal."""
    entry = view.nodes.get(node_id)
    if entry is None:
        return None
    if view.sealed is not None and entry.create_revision < view.sealed.epoch:
        if node_id in view.sealed.members:
            return "member"
        if node_id in view.sealed.spares:
            return "spare"
    return "waiting"


def waiting_nodes(view: View) -> list[str]:
    """Present nodes that are neither members nor spares of the last sealed round (late arrivals)."""
    if view.sealed is None:
        return sorted(view.nodes)
    listed = set(view.sealed.members) | set(view.sealed.spares)
    return sorted(n for n, e in view.nodes.items() if n not in listed or e.create_revision > view.sealed.epoch)


def ready_to_seal(view: View, settings: RendezvousSettings) -> Literal["now", "last-call", "no"]:
    """Whether enough nodes are present for a new round: at once, after the last call, or not yet.

    For the first round, spares do not count towards ``max_nodes`` (pods start together; a spare that
    registered first must not take an ordinary node's place). For later rounds they do: a spare replacing a
    lost member should bring the round back at once.
    """
    n = len(view.nodes)
    if n < settings.min_nodes:
        return "no"
    full = n if view.sealed is not None else sum(1 for e in view.nodes.values() if not e.record.spare)
    if full >= settings.max_nodes:
        return "now"
    if view.expected is not None and view.expected <= view.nodes.keys():
        return "now"
    return "last-call"


def plan_round(view: View, settings: RendezvousSettings, sealer: str, reason: str,
               lost: Sequence[str] = ()) -> Manifest:
    """The manifest of the next round over the present nodes (see the module's membership rules); ``lost``: the
    members of the last round whose keys went (the operator names them in the job's status)."""
    if not view.nodes:
        raise ValueError("plan_round: no node is present")
    prev: dict[str, int] = {}
    if view.sealed is not None:
        epoch = view.sealed.epoch
        prev = {m.node_id: m.group_rank for m in view.sealed.members.values()
                if (e := view.nodes.get(m.node_id)) is not None and e.create_revision < epoch}
    survivors = sorted(prev, key=lambda n: prev[n])
    others = sorted((n for n in view.nodes if n not in prev),
                    key=lambda n: (view.nodes[n].record.spare, view.nodes[n].create_revision, n))
    ordered = survivors + others
    count = min(settings.max_nodes, len(ordered))
    chosen, spares = ordered[:count], ordered[count:]
    slots: list[str | None] = [None] * count
    unplaced: list[str] = []
    for n in chosen:
        g = prev.get(n)
        if g is not None and g < count and slots[g] is None:
            slots[g] = n
        else:
            unplaced.append(n)
    it = iter(unplaced)
    members: list[Member] = []
    offset = 0
    for g in range(count):
        node_id = slots[g] if slots[g] is not None else next(it)
        assert node_id is not None
        rec = view.nodes[node_id].record
        members.append(Member(node_id=node_id, address=rec.address, group_rank=g, rank_offset=offset,
                              nproc=rec.nproc, rpc_port=rec.rpc_port))
        offset += rec.nproc
    first = view.nodes[members[0].node_id].record
    return Manifest(round=(view.sealed.header.round + 1) if view.sealed else 1, members=members,
                    spares=spares, world_size=offset, master_addr=first.address, master_port=first.master_port,
                    sealed_by=sealer, reason=reason, lost=list(lost[:MAX_LOST]), view_revision=view.revision)


# -- the state machine ---------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class State:
    """One process's protocol state for one job.

    ``local`` are the node ids this process runs (only a local sealer acts). ``last_call_deadline`` is the
    sealer's deadline for stragglers (monotonic seconds of this process). ``sealing_at`` and ``claiming_at``
    are the view revisions a seal and a claim of the sealer's key were last attempted at, so one view gives at
    most one attempt of each.
    """

    view: View = field(default_factory=View)
    local: frozenset[str] = frozenset()
    last_call_deadline: float | None = None
    sealing_at: int | None = None
    claiming_at: int | None = None
    #: The epoch whose end was last written for the light views (see :class:`EndRound`).
    ending: int | None = None


@dataclass(frozen=True, slots=True)
class Observed:
    """etcd reported these events (in revision order) at time ``now``."""

    events: tuple[KeyEvent, ...]
    now: float


@dataclass(frozen=True, slots=True)
class Reloaded:
    """The prefix was read again (start, a broken watch, a change between a full and a light view) at ``now``.

    ``covered`` are the local nodes whose keys a light read asked for (``None``: a full read, every key). A
    node registered while the read was on its way is not in it, and keeps the entry its registration gave."""

    view: View
    now: float
    covered: frozenset[str] | None = None


@dataclass(frozen=True, slots=True)
class Tick:
    """Time passed."""

    now: float


@dataclass(frozen=True, slots=True)
class LocalNode:
    """This process started (``present``) or stopped running node ``node_id``. ``entry`` is its key as its
    registration wrote it (a light view is never sent the puts of node keys, its own included), and ``sealer``
    the holder of the sealer's key that the registration found or became (see :class:`Claim`)."""

    node_id: str
    present: bool
    now: float
    entry: NodeEntry | None = None
    sealer: SealerClaim | None = None


@dataclass(frozen=True, slots=True)
class SealFailed:
    """The seal transaction was refused or failed; try again at the next event."""

    now: float


@dataclass(frozen=True, slots=True)
class ClaimFailed:
    """The claim of the sealer's key failed (etcd unreachable); try again at the next event."""

    now: float


Event = Observed | Reloaded | Tick | LocalNode | SealFailed | ClaimFailed


@dataclass(frozen=True, slots=True)
class Seal:
    """Write ``manifest`` in one transaction, only if the manifest's mod_revision is still ``over_epoch``
    (0: absent), the rendezvous is not closed, the sealer's node key still has ``sealer_revision``, and no
    node key was created after ``view_revision``: the manifest was planned over every node present when it is
    written, so a node left out of a round arrived after it and is rightly a late arrival."""

    manifest: Manifest
    over_epoch: int
    sealer: str
    sealer_revision: int
    view_revision: int


@dataclass(frozen=True, slots=True)
class Claim:
    """Create the sealer's key for ``node_id`` under its ``lease``, only if the key is absent and the node's
    key still has ``node_revision``. Refused when another node holds it: the watch then brings the holder.
    (A node's registration claims the key in its own transaction too; this is for when the holder has gone.)"""

    node_id: str
    node_revision: int
    lease: int


@dataclass(frozen=True, slots=True)
class WakeAt:
    """Deliver a :class:`Tick` no later than ``deadline``."""

    deadline: float


@dataclass(frozen=True, slots=True)
class EndRound:
    """Write a re-rendezvous request for ``epoch`` from the sealer ``node_id``, naming the ``lost`` members,
    only if the manifest is still that epoch's. The light views of a large round hold only their own buckets,
    so most cannot tell that a deleted key was a member's; the sealer tells them. It is not written when a
    seal follows at once: the new manifest tells them as well."""

    epoch: int
    node_id: str
    reason: str
    lost: tuple[str, ...]


RendezvousAction = Seal | Claim | EndRound | WakeAt


def _with_local(view: View, node_id: str, entry: NodeEntry | None) -> View:
    """A light ``view`` holding ``entry`` for the local node (unless it holds that incarnation or a newer one).
    A full view is sent the key's put: it waits for it, so that a seal is planned only over keys it was sent."""
    if entry is None or view.full:
        return view
    held = view.nodes.get(node_id)
    if held is not None and held.create_revision >= entry.create_revision:
        return view
    if view.gone.get(node_id, 0) > entry.create_revision:
        return view  # deleted already: the watch was faster than the registration's answer
    return replace(view, nodes={**view.nodes, node_id: entry}, memo={})


def _with_sealer(view: View, claim: SealerClaim | None) -> View:
    """``view`` knowing ``claim`` of the sealer's key, unless it knows a newer claim or the key's deletion."""
    if claim is None or view.sealer_gone > claim.create_revision:
        return view
    if view.sealer is not None and view.sealer.create_revision >= claim.create_revision:
        return view
    return replace(view, sealer=claim, memo={})


def _claim(state: State) -> Claim | None:
    """A claim of the sealer's key when nobody holds it and a local node is present: the oldest local node's."""
    view = state.view
    if view.sealer is not None or view.closed or state.claiming_at == view.revision:
        return None
    present = [(view.nodes[n].create_revision, n) for n in state.local if n in view.nodes]
    if not present:
        return None
    node_id = min(present)[1]
    entry = view.nodes[node_id]
    return Claim(node_id, entry.create_revision, entry.lease)


def step(state: State, event: Event, settings: RendezvousSettings) -> tuple[State, list[RendezvousAction]]:
    """The next state and the actions to carry out, for one event."""
    if isinstance(event, Observed):
        state = replace(state, view=apply(state.view, event.events))
    elif isinstance(event, Reloaded):
        view = event.view
        if event.covered is not None:
            for node_id in state.local - event.covered:
                view = _with_local(view, node_id, state.view.nodes.get(node_id))
        state = replace(state, view=view, sealing_at=None, claiming_at=None)
    elif isinstance(event, LocalNode):
        local = state.local | {event.node_id} if event.present else state.local - {event.node_id}
        view = state.view
        if event.present:
            view = _with_sealer(_with_local(view, event.node_id, event.entry), event.sealer)
        state = replace(state, local=local, view=view)
    elif isinstance(event, SealFailed):
        state = replace(state, sealing_at=None, ending=None)
    elif isinstance(event, ClaimFailed):
        state = replace(state, claiming_at=None)
    claim = _claim(state)
    if claim is not None:
        return replace(state, claiming_at=state.view.revision, last_call_deadline=None), [claim]
    now = event.now
    view = state.view
    status = round_status(view)
    sealer = None if view.sealer is None else view.sealer.node_id
    if (status.live or view.closed or sealer is None or sealer not in state.local or not view.full
            or sealer not in view.nodes):
        return replace(state, last_call_deadline=None), []
    readiness = ready_to_seal(view, settings)
    ending: list[RendezvousAction] = []
    if (readiness != "now" and status.lost and view.sealed is not None and view.sealed.bucketed
            and state.ending != view.epoch and not (view.request is not None and view.request.epoch == view.epoch)):
        ending = [EndRound(view.epoch, sealer, status.reason, status.lost)]
        state = replace(state, ending=view.epoch)
    if readiness == "no":
        return replace(state, last_call_deadline=None), ending
    if readiness == "last-call":
        deadline = state.last_call_deadline
        if deadline is None:
            deadline = now + settings.last_call_timeout
            state = replace(state, last_call_deadline=deadline)
        if now < deadline:
            return state, [*ending, WakeAt(deadline)]
    if state.sealing_at == view.revision:
        return state, []
    manifest = plan_round(view, settings, sealer, status.reason, status.lost)
    seal = Seal(manifest, view.epoch, sealer, view.nodes[sealer].create_revision, view.revision)
    return replace(state, sealing_at=view.revision), [seal]
