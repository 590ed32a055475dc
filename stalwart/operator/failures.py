"""One failure record per fault, naming the culprit: pure functions from what was seen to ``status.lastFailure``.

Every observation of a fault is a :class:`Fact`: the operator's own (a pod failed, was deleted or vanished, its
node was lost), an agent's (a rank process ended on its own), the restart protocol's fault records in etcd (a
rank raised, timed out, or noticed that a peer's heartbeat lease ran out), or the absence of progress past
the soft timeout. One fault usually leaves several facts: a killed rank's peers see their connections reset,
a deleted pod's survivors lose their peers. The culprit is chosen by what causes what, not by who wrote first:

1. ``Pod``: the pod failed or went (the operator saw it) - its ranks' errors are consequences;
2. ``Process``: a rank process ended on its own (its agent saw it) - peers' connection resets follow from it;
3. ``Heartbeat``: a rank's heartbeat lease ran out (a frozen, dead or cut-off process) - blamed on that rank
   (reason ``PeerLost``), not on the peer that noticed;
4. ``Peer``: a survivor's collective error (a connection closed or reset by its peer, a timeout) points at a
   peer that is missing, silent or unreachable (:mod:`.culprits`) - blamed on that peer, the survivor's error
   kept as secondary;
5. ``Rank``: the first fault a rank reported: a fault seen at the faulty process (an exception of its own, its
   agent's record of its death or stop) before a symptom a peer noticed (a collective error, a timeout, a lost
   peer), then the lowest etcd revision (the order the restart protocol uses);
6. ``Progress``: nothing progressed past the soft timeout.

Within a class the earliest wins. The other facts of the same fault are kept as ``secondary`` detail.
"""

from __future__ import annotations

import ast
import re
import signal as signal_module
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from typing import Literal

from stalwart.api.exit_codes import ExitCode
from stalwart.api.restart import DIRECT_KINDS, FaultRecord, RankExit
from stalwart.api.status import MAX_SECONDARY, FailureRecord, Position, SecondaryFailure

__all__ = [
    "Detection",
    "Fact",
    "RankPlace",
    "compose",
    "exit_facts",
    "fact_of_record",
    "peer_error",
    "rank_facts",
    "reason_of_kind",
    "short_type",
    "signal_name",
    "split_exception",
    "symptom_of",
]

Detection = Literal["Pod", "Process", "Heartbeat", "Peer", "Rank", "Progress"]
_PRIORITY: dict[str, int] = {"Pod": 6, "Process": 5, "Heartbeat": 4, "Peer": 3, "Rank": 2, "Progress": 1}


@dataclass(frozen=True, slots=True)
class Fact:
    """One observation of a fault. ``order`` breaks ties within a class (the etcd revision of a rank's fault
    record); ``position`` is where training was (None: unknown)."""

    detected_by: Detection
    reason: str
    time: float
    position: Position | None = None
    order: int = 0
    rank: int | None = None
    pod: str | None = None
    slot: int | None = None
    message: str = ""
    exception_type: str | None = None
    exit_code: int | None = None
    signal: str | None = None
    #: A rank's report of what it suffered from a peer (a collective error, a timeout, a lost peer), not a
    #: fault seen at the faulty process itself.
    symptom: bool = False
    #: For a hang: the ``ip:port`` its rank's connections were retransmitting to unacknowledged, and the pod at
    #: that address once known (:func:`stalwart.operator.culprits.link_facts`): the fault is the link between.
    unreachable: tuple[str, ...] = ()
    peer: str | None = None

    def sort_key(self) -> tuple[int, bool, float, int]:
        """Lower is the likelier culprit."""
        return (-_PRIORITY[self.detected_by], self.symptom, self.time if self.detected_by != "Rank" else 0.0,
                self.order)

    def same_place(self, other: Fact) -> bool:
        return (self.rank, self.pod, self.reason) == (other.rank, other.pod, other.reason)


@dataclass(frozen=True, slots=True)
class RankPlace:
    """Where a slot's process runs in the current round: its rank and pod."""

    rank: int | None
    pod: str


# -- parsing ----------------------------------------------------------------------------------------------------

_REPR = re.compile(r"^(?P<type>[A-Za-z_][\w.]*)\((?P<args>.*)\)$", re.DOTALL)
_NON_RETRYABLE = "non-retryable: "


def split_exception(text: str) -> tuple[str | None, str]:
    """``("DrillFault", "boom")`` from an exception's repr such as ``DrillFault('boom')``; ``(None, text)`` when
    the text is not one. Only string literals are evaluated (``ast.literal_eval``), nothing else."""
    body = text[len(_NON_RETRYABLE):] if text.startswith(_NON_RETRYABLE) else text
    m = _REPR.match(body.strip())
    if m is None:
        return None, text
    args = m.group("args").strip()
    if not args:
        return m.group("type").rsplit(".", 1)[-1], ""
    try:
        value = ast.literal_eval(args)
    except (ValueError, SyntaxError, MemoryError, RecursionError):
        return m.group("type").rsplit(".", 1)[-1], args
    message = value if isinstance(value, str) else str(value)
    return m.group("type").rsplit(".", 1)[-1], message


def short_type(name: str) -> str:
    """``DrillFault`` for ``stalwart.restart.drill.DrillFault``: ``exceptionType`` names the type as its repr
    does, whichever way a record spelt it."""
    return name.rsplit(".", 1)[-1]


def signal_name(number: int) -> str:
    """``SIGKILL`` for 9; ``signal 77`` for a number without a name."""
    try:
        return signal_module.Signals(number).name
    except ValueError:
        return f"signal {number}"


# -- facts from records -------------------------------------------------------------------------------------------

_KIND_REASON: dict[str, str] = {
    "exception": "Exception",
    "soft_timeout": "Hang",
    "hard_timeout": "Hang",
    "barrier_timeout": "Hang",
    "completion_timeout": "Hang",
    "peer_lost": "PeerLost",
    "unhealthy": "Unhealthy",
    "process_died": "ProcessExited",
    "stopped": "Hang",
    "init_timeout": "Hang",
    "non_retryable": "Exception",
    "link_down": "Hang",  # the other end of a hang's cut link: the status names the link (culprits.link_facts)
}


#: What a collective says when its peer went away or stopped answering: gloo's "Connection closed by peer" and
#: "Read error ...: Connection reset by peer", a broken pipe, a refused connection, a timeout.
_PEER_ERROR = re.compile(r"closed by peer|reset by peer|broken pipe|connection refused|timed? ?out|timeout",
                         re.IGNORECASE)


def peer_error(text: str) -> bool:
    """Whether an error's text is what a collective raises when a peer went away or stopped answering."""
    return _PEER_ERROR.search(text) is not None


def symptom_of(rec: FaultRecord) -> bool:
    """Whether a fault record is a symptom (see :attr:`Fact.symptom`): a kind a peer observes, or an exception
    that is a collective's error about its peer."""
    if rec.kind not in DIRECT_KINDS:
        return True
    return rec.kind == "exception" and peer_error(f"{rec.exception or ''} {rec.message or ''} {rec.reason}")


def reason_of_kind(kind: str | None) -> str:
    """The status reason (``lastFailure.reason``) of a restart fault kind (``stalwart.api.restart.FaultKind``)."""
    return _KIND_REASON.get(kind, kind) if kind is not None else "Exception"


def rank_facts(faults: Sequence[tuple[int, FaultRecord]], round_: int, places: Mapping[int, RankPlace],
               exited: Iterable[tuple[int, int]] = ()) -> list[Fact]:
    """Facts from the restart protocol's fault records of one round (``(revision, record)``). A peer_lost record
    gives a ``Heartbeat`` fact for each lost slot (unless that slot's process is known to have ended in the same
    iteration, ``exited`` holding ``(slot, iteration)``: then the agent's ``Process`` fact tells it better; an
    exit of the slot's process in an earlier iteration says nothing about this one) and a symptom ``Rank`` fact
    for the peer that noticed."""
    ended = set(exited)
    out: list[Fact] = []
    for revision, rec in faults:
        position = Position(round=round_, iteration=rec.iteration)
        reason = reason_of_kind(rec.kind)
        exception_type: str | None
        if rec.exception is not None:  # the rank said what it raised: no need to read it from the text
            exception_type, message = short_type(rec.exception), rec.message or ""
        elif rec.kind == "exception":
            exception_type, message = split_exception(rec.reason)
        else:
            exception_type, message = None, rec.reason
        out.append(Fact("Rank", reason, rec.time, position, revision, rec.rank, rec.node_id, rec.slot, message,
                        exception_type, symptom=symptom_of(rec), unreachable=tuple(rec.unreachable)))
        for slot in rec.lost_slots:
            if (slot, rec.iteration) in ended or slot == rec.slot:
                continue
            place = places.get(slot)
            # The lease ends alike for a frozen process, a dead one and one cut off: the lost peer is all it says.
            out.append(Fact("Heartbeat", "PeerLost", rec.time, position, revision,
                            place.rank if place else None, place.pod if place else None, slot,
                            f"the heartbeat lease of slot {slot} ended (noticed by rank {rec.rank} on {rec.node_id})"))
    return out


def exit_facts(exits: Iterable[tuple[str, RankExit]]) -> list[Fact]:
    """Facts from the agents' rank exits ``(node, exit)``: the process ended on its own, or it hung: killed by its
    agent for making no progress, or ended by itself because its main thread stayed blocked after its interrupt
    (exit code ABANDONED: the same hang, caught sooner by the process than by its agent's hard timeout)."""
    out: list[Fact] = []
    for node, ex in exits:
        if ex.hung:
            reason, message = "Hang", "no progress within its hard timeout: killed by its agent and respawned"
        elif ex.exit_code == ExitCode.ABANDONED:
            reason = "Hang"
            message = (f"blocked after its interrupt where no interrupt frees it: ended itself (exit code "
                       f"{ex.exit_code}) and was respawned")
        else:
            reason = "ProcessExited"
            message = f"killed by {ex.signal}" if ex.signal else f"exited with code {ex.exit_code}"
        out.append(Fact("Process", reason, ex.time, Position(round=ex.round, iteration=ex.iteration), 0, ex.rank,
                        node, ex.slot, message, None, ex.exit_code, ex.signal))
    return out


def _to_time(t: float) -> datetime:
    return datetime.fromtimestamp(int(t), UTC)


_DETECTIONS: tuple[Detection, ...] = ("Pod", "Process", "Heartbeat", "Peer", "Rank", "Progress")


def fact_of_record(record: FailureRecord) -> Fact | None:
    """The culprit a written record names, as a fact (so that a later composition never loses it)."""
    if record.reason is None or record.detected_by not in _DETECTIONS:
        return None
    position = None if record.round is None else Position(round=record.round, iteration=record.iteration or 0)
    detected: Detection = next(d for d in _DETECTIONS if d == record.detected_by)
    # A written rank's record keeps its standing against a fault seen at the faulty process that arrives later
    # (an agent's record of a stopped rank after the survivor's timeout) only when it was no symptom itself.
    symptom = detected == "Rank" and (record.reason in ("PeerLost", "Hang") or peer_error(record.message or ""))
    return Fact(detected, record.reason, record.time.timestamp() if record.time else 0.0, position, 0,
                record.rank, record.pod, None, record.message or "", record.exception_type, record.exit_code,
                record.signal, symptom, peer=record.peer)


def _link_peer(culprit: Fact, facts: Sequence[Fact]) -> str | None:
    """The other end of the culprit's link: the pod its own connections could not reach, else a pod whose hang at
    the same place could not reach the culprit's (a link cut is seen from whichever end had bytes in flight)."""
    if culprit.peer is not None or culprit.reason != "Hang":
        return culprit.peer
    at = culprit.position.key() if culprit.position else None
    return next((f.pod for f in facts if f.peer is not None and f.peer == culprit.pod and f.pod != culprit.pod
                 and (f.position.key() if f.position else None) == at), None)


def compose(facts: Sequence[Fact], existing: FailureRecord | None = None) -> FailureRecord | None:
    """The failure record of one fault: its culprit (see the module docstring) with the other facts as
    ``secondary``. ``existing`` is the record written so far for the same fault: its culprit stays a candidate,
    so that facts which have since gone (a round's fault records) are not forgotten."""
    candidates = list(facts)
    kept = fact_of_record(existing) if existing is not None else None
    if kept is not None:
        candidates.append(kept)
    if not candidates:
        return existing
    ordered = sorted(candidates, key=Fact.sort_key)
    culprit = ordered[0]
    secondary: list[SecondaryFailure] = []
    seen = [culprit]
    for f in sorted(ordered[1:], key=lambda f: (f.time, f.order)):
        # What was said about the culprit's pod before its loss was confirmed is the culprit, not a second error.
        if any(f.same_place(s) for s in seen) or (f.detected_by == "Peer" and f.pod == culprit.pod):
            continue
        seen.append(f)
        secondary.append(SecondaryFailure(rank=f.rank, pod=f.pod, reason=f.reason, message=f.message[:2048] or None))
    # The errors written for this fault stay its detail when a better culprit comes (a loss confirmed after a
    # survivor's error pointed at it) as when the culprit stays, though their facts may be gone.
    if kept is not None and existing is not None and existing.secondary:
        for s in existing.secondary:
            if (s.rank, s.pod, s.reason) != (culprit.rank, culprit.pod, culprit.reason) and not any(
                    (s.rank, s.pod, s.reason) == (x.rank, x.pod, x.reason) for x in secondary):
                secondary.append(s)
    peer = _link_peer(culprit, candidates)
    message = culprit.message
    if peer is not None and culprit.peer is None:  # the link was seen from its other end
        message = f"the link between pod {culprit.pod} and {peer} carries nothing: {message}".rstrip(": ")
    return FailureRecord(
        rank=culprit.rank, pod=culprit.pod, peer=peer, reason=culprit.reason, message=message or None,
        exception_type=culprit.exception_type, exit_code=culprit.exit_code, signal=culprit.signal,
        detected_by=culprit.detected_by,
        round=culprit.position.round if culprit.position else None,
        iteration=culprit.position.iteration if culprit.position else None,
        time=_to_time(culprit.time), secondary=secondary[:MAX_SECONDARY] or None)


def at_or_after(facts: Iterable[Fact], position: Position | None) -> list[Fact]:
    """The facts of a fault that happened at ``position`` or later (facts without a position always count)."""
    if position is None:
        return list(facts)
    return [f for f in facts if f.position is None or f.position.key() >= position.key()]


def with_position(fact: Fact, position: Position | None) -> Fact:
    return fact if fact.position is not None or position is None else replace(fact, position=position)
