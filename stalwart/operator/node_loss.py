"""Which of a job's pods are lost although the API still shows them alive. Pure functions.

On a real cluster a lost node's pods stay ``Running`` (with condition Ready=False) until they are evicted, by
default 300 s after the node is tainted, and then stay Terminating until someone force-deletes them; their
processes may live on behind a partition. So the operator reads loss from what the cluster does show, and acts
on whichever comes first:

- **the node**: the pod's node is unreachable: its Ready condition is ``Unknown`` or it carries the
  ``node.kubernetes.io/unreachable`` taint (the node lifecycle controller sets both once the node-monitor grace
  period passes without a heartbeat). Nobody can confirm a graceful deletion there, so such a pod is
  force-deleted;
- **the agent's lease**: the pod's agent has no rendezvous key in etcd (its lease expired or was revoked), and
  its progress record, written by this pod's agent (after the pod started), says it was still at work but has
  not been rewritten for :data:`AGENT_SILENT_SECONDS` (a live agent rewrites it at least every 10 s). Its node
  may be fine, so such a pod is deleted gracefully.

A lost pod is fenced (its lease revoked) once; its processes may still come back, e.g. when a partition heals
towards etcd before the kubelet there hears that the pod is gone, and register again under a new lease. So the
fence is kept: a rendezvous key held for a node id that is none of the job's pods (:func:`strangers`) is
revoked whenever it is seen, and such a zombie never becomes a member of a later round.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from stalwart.operator.model import Observation, PodView

UNREACHABLE_TAINT = "node.kubernetes.io/unreachable"
#: How long an agent without a lease must also have been silent (no progress record) to count as lost. A live
#: agent rewrites its record at least every 10 s; the margin absorbs clock skew between its node and here.
AGENT_SILENT_SECONDS = 15.0


def node_unreachable(node: Mapping[str, Any]) -> bool:
    """Whether a Node object shows its kubelet gone: Ready ``Unknown`` or the unreachable taint."""
    conditions = (node.get("status") or {}).get("conditions") or []
    ready = next((c for c in conditions if isinstance(c, Mapping) and c.get("type") == "Ready"), None)
    if ready is not None and ready.get("status") == "Unknown":
        return True
    return any(isinstance(t, Mapping) and t.get("key") == UNREACHABLE_TAINT
               for t in (node.get("spec") or {}).get("taints") or [])


def agent_silent_for(pod: PodView, obs: Observation) -> float | None:
    """For a pod whose agent holds no lease but reported at work: how long its agent has been silent (seconds);
    None for every other pod (the lease path of the module docstring does not apply)."""
    etcd = obs.etcd
    if not etcd.reachable or etcd.closed or pod.phase != "Running" or pod.deleting or pod.assumed:
        return None
    if pod.name in etcd.leases or pod.started_at is None:
        return None
    record = next((p for p in etcd.progress if p.node_id == pod.name), None)
    # startTime has whole seconds, so a record of this pod's agent is never older; one of a predecessor of the
    # same name (a refilled worker slot) is, unless both fell into one second.
    if record is None or record.state in ("succeeded", "failed") or record.updated < pod.started_at:
        return None
    return obs.now - record.updated


def agent_lost(pod: PodView, obs: Observation) -> bool:
    """The lease path of the module docstring, for one pod."""
    silent = agent_silent_for(pod, obs)
    return silent is not None and silent >= AGENT_SILENT_SECONDS


def recheck_in(obs: Observation) -> float | None:
    """Seconds until a pod whose agent lost its lease has been silent long enough to count as lost, if any."""
    waits = [AGENT_SILENT_SECONDS - silent for pod in obs.pods
             if (silent := agent_silent_for(pod, obs)) is not None and silent < AGENT_SILENT_SECONDS]
    return min(waits) if waits else None


def lost_pods(obs: Observation) -> dict[str, str]:
    """The job's pods that are lost though not finished, each with why (for the failure record and Event)."""
    out: dict[str, str] = {}
    for pod in obs.pods:
        if pod.finished:
            continue
        if pod.node is not None and pod.node in obs.unreachable_nodes:
            out[pod.name] = f"its node {pod.node} is unreachable"
        elif agent_lost(pod, obs):
            out[pod.name] = "its agent's etcd lease is gone and it stopped reporting"
    return out


def on_unreachable_node(pod: PodView, obs: Observation) -> bool:
    """Whether ``pod`` sits on an unreachable node (no kubelet there can confirm its graceful deletion)."""
    return pod.node is not None and pod.node in obs.unreachable_nodes


def strangers(obs: Observation) -> list[str]:
    """Node ids holding a rendezvous key that are none of the job's pods (zombies of pods already gone)."""
    known = {p.name for p in obs.pods}
    return sorted(node for node in obs.etcd.leases if node not in known)
