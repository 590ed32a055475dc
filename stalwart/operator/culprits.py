"""Whom a survivor's collective error is about: the peer that went, not the rank that noticed. Pure functions.

When a node is lost or a rank freezes, the first word about it comes from a survivor: its collective fails
("Connection closed by peer", "Connection reset by peer") or times out, and it records that as its fault.
That record is a *symptom* (:func:`.failures.symptom_of`). It never names the culprit while the peer it is
about is missing, silent or unreachable: from it this module derives a ``Peer`` fact about that peer, which
outranks the survivor's own (whose error becomes ``secondary``). The peer is, in this order:

1. the one the error names by address (gloo names its peer's ``[ip]:port``; on a cluster each pod has its IP).
   An address that is no pod's but a node's names the round's only member pod on that node: a connection made
   from a network namespace with several addresses (pods sharing their node's, as ``hostNetwork`` pods do, or
   the local cluster's) leaves from the node's primary address, so the accepting end sees that;
2. a member of the round that is unreachable (its node), gone (deleted, failed, missing from the API) or whose
   agent has been silent for :func:`silent_limit` (4 s where a live agent reports every second);
3. for a connection the peer closed or reset, the survivor's only peer pod (a two-pod world has no other);
4. for a timeout, the rank whose progress stopped first, when it is not the survivor's: a rank frozen in place
   stops at once, the survivor only when its next collective waits for it (a survivor that stopped first is
   the hung one itself, and its record stands).

Its reason is ``NodeLost`` when the peer's node is unreachable, ``Hang`` when the peer is the rank that
stopped first, else ``PeerLost``; the message names the peer's node. An iteration in which some rank spoke for
itself (a fault seen at the faulty process, a process that ended) needs none of this: that fact is the culprit.
When the loss is confirmed later (the node unreachable, the pod gone), the operator's ``Pod`` fact outranks
this one within the same incident.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, replace

from stalwart.api.pacing import progress_interval
from stalwart.operator.failures import Fact

__all__ = ["PEER_SILENT_SECONDS", "Peer", "at_address", "link_facts", "peer_facts", "silent_limit"]

#: How long a member's agent must have been silent to count as gone, in a round whose agents report every second
#: (the margin absorbs a loaded node and clock skew); a larger round's agents report less often
#: (:func:`silent_limit`).
PEER_SILENT_SECONDS = 4.0


def silent_limit(nodes: int, soft_timeout: float | None) -> float:
    """How long a member's agent of a round of ``nodes`` pods must have been silent to count as gone: the same
    margin beyond the interval its agent writes at (:func:`stalwart.api.pacing.progress_interval`, the agents'
    default setting of 1 s)."""
    return PEER_SILENT_SECONDS - 1.0 + progress_interval(max(nodes, 1), least=1.0, soft_timeout=soft_timeout)

_ADDRESS = re.compile(r"\[?(\d{1,3}(?:\.\d{1,3}){3})\]?:(\d+)")
_CLOSED = re.compile(r"closed by peer|reset by peer|broken pipe|connection refused", re.IGNORECASE)


@dataclass(frozen=True, slots=True)
class Peer:
    """A member pod of the current round as the operator sees it now. ``silent_for``: seconds since its agent
    last reported in this round (None: no report); ``ranks``: ``(global rank, last progress time)`` of its ranks
    in their training function (None: the time is unknown)."""

    pod: str
    node: str | None = None
    ip: str | None = None
    unreachable: bool = False
    #: The address of its node (status.hostIP), else None.
    host_ip: str | None = None
    gone: bool = False
    silent_for: float | None = None
    ranks: tuple[tuple[int | None, float | None], ...] = ()
    #: Silent this long, its agent counts as gone (:func:`silent_limit` of its round).
    silent_limit: float = PEER_SILENT_SECONDS

    def lost(self) -> bool:
        return self.unreachable or self.gone or (self.silent_for is not None
                                                 and self.silent_for >= self.silent_limit)

    def where(self) -> str:
        return f"pod {self.pod}" + (f" on node {self.node}" if self.node else "")

    def only_rank(self) -> int | None:
        return self.ranks[0][0] if len(self.ranks) == 1 else None


def _spoke_for_itself(facts: Sequence[Fact]) -> set[tuple[int, int] | None]:
    """Positions at which a fault was seen at the faulty process (or its process ended)."""
    return {f.position.key() if f.position else None for f in facts
            if f.detected_by == "Process" or (f.detected_by == "Rank" and not f.symptom)}


def at_address(ip: str, peers: Sequence[Peer]) -> Peer | None:
    """The member pod a connection's address ``ip`` is about: the pod with that IP, else the only member pod on
    the node with that address (see the module's note), else None (no member's, or several share the node)."""
    hits = [p for p in peers if p.ip == ip]
    if not hits:
        hits = [p for p in peers if p.host_ip == ip]
    return hits[0] if len(hits) == 1 else None


def _named(message: str, peers: Sequence[Peer], noticer: str | None) -> tuple[Peer, str] | None:
    """The member pod other than ``noticer`` that ``message`` names by address, and the address."""
    for m in _ADDRESS.finditer(message):
        hit = at_address(m.group(1), peers)
        if hit is not None and hit.pod != noticer:
            return hit, m.group(0)
    return None


def _stopped_first(peers: Sequence[Peer], symptom: Fact) -> tuple[Peer, int | None] | None:
    """The rank whose progress stopped first, with its pod, when it is another pod's than the survivor's."""
    timed = [(t, rank, p) for p in peers for rank, t in p.ranks if t is not None]
    if not timed:
        return None
    first, rank, peer = min(timed, key=lambda x: x[0])
    mine = [t for t, r, p in timed if p.pod == symptom.pod and (symptom.rank is None or r == symptom.rank)]
    if peer.pod == symptom.pod or (mine and min(mine) <= first):
        return None
    return peer, rank


def _suspect(symptom: Fact, peers: Sequence[Peer]) -> Fact | None:
    others = [p for p in peers if p.pod != symptom.pod]
    if not others:
        return None
    noticed = f"rank {symptom.rank} on pod {symptom.pod}" if symptom.rank is not None else f"pod {symptom.pod}"
    said = f": {symptom.message[:300]}" if symptom.message else ""
    rank: int | None = None
    hang = False
    named = _named(symptom.message, peers, symptom.pod)
    lost = sorted((p for p in others if p.lost()),
                  key=lambda p: (not p.unreachable, not p.gone, -(p.silent_for or 0.0), p.pod))
    if named is not None:
        peer, address = named
        why = f"the peer at {address}, {peer.where()}, broke the collective of {noticed}{said}"
    elif lost:
        peer = lost[0]
        if peer.unreachable:
            state = f"its node {peer.node} is unreachable"
        elif peer.gone:
            state = f"{peer.where()} is gone"
        else:
            state = f"{peer.where()}: its agent has been silent for {peer.silent_for:.0f}s"
        why = f"{state}; {noticed} lost it{said}"
    elif _CLOSED.search(symptom.message) and len(others) == 1:
        peer = others[0]
        why = f"the only peer of {noticed}, {peer.where()}, closed its connections{said}"
    elif symptom.reason == "Hang" or not _CLOSED.search(symptom.message):
        first = _stopped_first(peers, symptom)
        if first is None:
            return None
        peer, rank = first
        hang = True
        who = f"rank {rank} on {peer.where()}" if rank is not None else peer.where()
        why = f"{who} stopped progressing first; {noticed} timed out waiting for it{said}"
    else:
        return None
    reason = "NodeLost" if peer.unreachable else ("Hang" if hang else "PeerLost")
    return Fact("Peer", reason, symptom.time, symptom.position, symptom.order,
                rank if hang else peer.only_rank(), peer.pod, None, why)


def link_facts(facts: Sequence[Fact], peers: Sequence[Peer]) -> list[Fact]:
    """``facts`` with each hang whose rank was retransmitting to a member pod's address unacknowledged (its
    ``unreachable``, read by :func:`at_address`) given that pod as its ``peer``: the network between the two
    carries nothing. Neither end is more at fault than the other (a cut from one peer only leaves both agents
    and leases alive), so the status names the link, not a culprit pod. An address that names no member pod,
    or the rank's own, is left."""
    out = []
    for f in facts:
        if f.reason != "Hang" or not f.unreachable or f.peer is not None:
            out.append(f)
            continue
        hits = (at_address(address.rpartition(":")[0], peers) for address in f.unreachable)
        ends = sorted({p.pod for p in hits if p is not None and p.pod != f.pod})
        if not ends:
            out.append(f)
            continue
        link = f"the link between pod {f.pod} and {', '.join(ends)} carries nothing"
        out.append(replace(f, peer=ends[0], message=f"{link}: {f.message}" if f.message else link))
    return out


def peer_facts(facts: Sequence[Fact], peers: Sequence[Peer]) -> list[Fact]:
    """The ``Peer`` facts the survivors' symptoms among ``facts`` point at (one per position: the earliest
    symptom's), given the round's member pods as ``peers``. A lost peer that a heartbeat names already has its
    ``Heartbeat`` fact: those symptoms are left alone."""
    # Where a link was seen down (:func:`link_facts`), the stalls are its consequence: no peer is blamed.
    spoke = _spoke_for_itself(facts) | {f.position.key() if f.position else None for f in facts if f.peer}
    by_position: dict[tuple[int, int] | None, Fact] = {}
    for f in sorted(facts, key=lambda f: (f.order, f.time)):
        if f.detected_by != "Rank" or not f.symptom or f.reason == "PeerLost":
            continue
        at = f.position.key() if f.position else None
        if at not in spoke:
            by_position.setdefault(at, f)
    out = []
    for f in by_position.values():
        fact = _suspect(f, peers)
        if fact is not None:
            out.append(fact)
    return out
