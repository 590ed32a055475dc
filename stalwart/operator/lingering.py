"""Pods that outlive their training: every rank the success policy names returned, and a pod of theirs is alive.

Why this exists: an agent can see every one of its ranks return, report it, and then never exit (issue 29: a
gRPC stream's finaliser deadlocked at interpreter shutdown). Its pod stays ``Running``, so success from exited
pods (:func:`.pods.succeeded`) never comes, and without this the status says ``Running`` forever while the pod
holds its node. So the operator also decides success from what the ranks reported, once the pods had
``ReconcileSettings.linger_limit`` seconds to exit on their own.

What the operator can observe of a member's end (a member of the round sealed at the current epoch):

- its pod is ``Succeeded``: its agent exited 0, which it does only once every local rank returned;
- its agent's progress record of that epoch says ``succeeded``: written (forced) when every local rank
  returned, just before the agent exits; the record's ``updated`` is that moment, and nothing rewrites it;
- its record of that epoch lists its ranks, each ``done``: a rank writes ``done`` only after the completion
  barrier (every active process of the iteration returned), so its training is over even though its process
  has not exited. The agent is alive then and keeps rewriting the record, so ``updated`` says nothing of when.

Node states ``joining``/``running``/``restarting`` and ranks in any other state are no evidence of an end, and
a pod that failed is not one either unless its record says ``succeeded`` (its ranks returned before it went).

The clock counts from the latest ``updated`` of the required members' ``succeeded`` records: the last agent that
said its ranks returned (an agent's wall clock against the operator's, as the soft timeout's evidence is; the
bound is tens of seconds, well above a skew NTP allows). With no such record there is no moment to count
from, and nothing is decided: every required agent is then still alive and supervising its ranks, and a rank
stuck at its exit is the agent's to end (its hard timeout).

Which members are required follows ``spec.successPolicy``: every member for ``AllWorkers``, the member holding
rank 0 for ``RankZero``. Pods outside that set (spares, the other workers under ``RankZero``) are not
lingering: they are running pods of a finished job, which ``cleanPodPolicy`` decides about.

Pure: frozen records in, a frozen verdict out.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from stalwart.api.restart import ProgressRecord
from stalwart.api.spec import SuccessPolicy
from stalwart.operator.model import EtcdView, PodView

__all__ = ["Lingering", "RanksReturned", "ranks_returned"]


@dataclass(frozen=True, slots=True)
class Lingering:
    """A required member's pod still alive: ``evidence`` says what told the operator its ranks returned."""

    pod: str
    evidence: str


@dataclass(frozen=True, slots=True)
class RanksReturned:
    """Every rank of the required members of round ``round`` returned, the last report of it at
    ``returned_at``. ``alive``: their pods still alive (not finished, not being deleted); ``due_in``: seconds left
    of the linger limit (0 once it passed: then the pods in ``alive`` are lingering); ``exited``: the required
    members whose pods exited 0."""

    round: int
    returned_at: float
    due_in: float
    alive: tuple[Lingering, ...]
    exited: tuple[str, ...]

    @property
    def past_limit(self) -> bool:
        return self.due_in <= 0


def ranks_returned(pods: Sequence[PodView], etcd: EtcdView, *, policy: SuccessPolicy, now: float,
                   limit: float) -> RanksReturned | None:
    """The verdict of this module (see its docstring), or None while some required rank has not returned (or
    the operator cannot tell: etcd unread, no round, no moment to count from)."""
    manifest = etcd.manifest
    if not etcd.reachable or manifest is None or not manifest.members or not etcd.epoch:
        return None
    required = [manifest.members[0].node_id] if policy == SuccessPolicy.RANK_ZERO \
        else [m.node_id for m in manifest.members]
    records = {r.node_id: r for r in etcd.progress if r.epoch == etcd.epoch}
    by_name = {p.name: p for p in pods}
    ends: list[float] = []
    alive: list[Lingering] = []
    exited: list[str] = []
    for name in required:
        pod = by_name.get(name)
        record = records.get(name)
        evidence = _evidence(record)
        if record is not None and record.state == "succeeded":
            ends.append(record.updated)
        if pod is not None and pod.phase == "Succeeded":
            exited.append(name)
            continue
        if evidence is None:
            return None  # this member's ranks may still be training
        if pod is not None and not pod.finished and not pod.deleting:
            alive.append(Lingering(name, evidence))
    if not ends:
        return None
    returned_at = max(ends)
    return RanksReturned(round=manifest.round, returned_at=returned_at,
                         due_in=max(0.0, returned_at + limit - now), alive=tuple(alive), exited=tuple(exited))


def _evidence(record: ProgressRecord | None) -> str | None:
    """What the member's record of the current round says of its ranks' end (None: nothing)."""
    if record is None:
        return None
    if record.state == "succeeded":
        return "its agent reported that every rank returned"
    if record.ranks and all(r.state == "done" for r in record.ranks):
        return f"its {len(record.ranks)} rank(s) reported done"
    return None
