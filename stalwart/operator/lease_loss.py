"""Members whose agent's lease ran out while their pod runs on: a pure function from the round's manifest, the
progress records and the live pods to the facts that name them.

A node cut off from etcd (or one whose keep-alives came too late) loses its rendezvous key when its lease runs
out. The survivors' agents end the round at once and seal the next one without it (or with it, when it was
back and registered again before the seal); the new manifest's ``lost`` lists it. Nothing else may ever name
it: its pod does not fail, the operator may not count it lost (the API server still hears from its node, or
the node came back within the grace period), and the survivors' ranks stop because their agents ended the
round, not because a collective broke. So the manifest's list is the fault's record, and this module turns it
into ``Heartbeat`` facts (reason ``PeerLost``): they outrank the survivors' symptoms, and the operator's own
``Pod`` fact (the node unreachable, the pod gone) outranks them when it comes (:mod:`.failures`).

A pod that is being deleted or is absent from the API left on purpose or is counted by the operator already
(a scale-down, a suspension, a vanished pod): it gives no fact here. :func:`.incidents.lost_members` places
each fact where the pod last ran and drops it once training has counted a step past that place, so a fact of
an old round never reopens an incident or replaces a later failure."""

from __future__ import annotations

from collections.abc import Collection, Sequence

from stalwart.api.rendezvous import Manifest
from stalwart.api.restart import ProgressRecord
from stalwart.operator.failures import Fact

__all__ = ["lease_facts"]


def lease_facts(manifest: Manifest | None, progress: Sequence[ProgressRecord], live: Collection[str],
                now: float) -> list[Fact]:
    """One fact per member the current round's manifest lists as lost whose pod is in ``live`` (present and
    not being deleted), timed at its agent's last report (``now`` when it never reported)."""
    if manifest is None or not manifest.lost:
        return []
    last = {r.node_id: r.updated for r in progress}
    out = []
    for pod in manifest.lost:
        if pod not in live:
            continue
        then = (f"it registered again and is a member of round {manifest.round}" if manifest.member(pod)
                else f"it registered again and waits as a spare of round {manifest.round}"
                if pod in manifest.spares else f"round {manifest.round} went on without it")
        message = (f"pod {pod}: its agent's rendezvous lease ran out (no keep-alive reached etcd within the "
                   f"lease TTL) while the pod ran on, ending its round; {then}")
        out.append(Fact("Heartbeat", "PeerLost", last.get(pod, now), pod=pod, message=message))
    return out
