"""The operator's plain data: what one reconcile observes, the actions it decides, and its settings.

Everything here is immutable and free of I/O, so :func:`stalwart.operator.reconcile.reconcile` is a pure
function of these values and can be tested table by table without any server.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from stalwart.api.base import positive_seconds
from stalwart.api.job_record import JobRecord
from stalwart.api.rendezvous import Manifest
from stalwart.api.restart import FaultRecord, ProgressRecord
from stalwart.api.spec import TrainingJobSpec
from stalwart.api.status import TrainingJobStatus
from stalwart.operator.pod_defaults import PodSecurity

PodPhase = Literal["Pending", "Running", "Succeeded", "Failed", "Unknown"]


@dataclass(frozen=True, slots=True)
class ReconcileSettings:
    """Operator-wide knobs (not per job). All durations are seconds."""

    #: At most one status patch per job per this many seconds, however fast agents report.
    status_interval: float = 1.0
    #: A pod still Terminating this long after its deletion grace period ended is force-deleted.
    terminating_grace_limit: float = 30.0
    #: Grace period given to pods the operator deletes (suspend, clean-up, scale-down, replacement).
    delete_grace_seconds: int = 30
    #: Longest sleep between two reconciles of a running job, even when nothing is reported.
    resync_interval: float = 10.0
    #: The Pod Security Standards level templates are held to (``restricted``, ``baseline`` or ``off``): a job
    #: whose pods would break it fails with InvalidSpec naming the field (``pod_defaults.pod_security_problems``).
    pod_security: PodSecurity = PodSecurity.RESTRICTED
    #: Seconds the pods the success policy names may stay alive after their ranks reported that every rank
    #: returned: past it they are lingering (an Event and the PodsLingering condition name them), the job
    #: succeeds on the ranks' reports, and cleanPodPolicy decides whether they are deleted (``.lingering``).
    #: Long enough for an agent to exit after its last report (well under a second when nothing hangs).
    linger_limit: float = 30.0

    def __post_init__(self) -> None:
        for name in ("status_interval", "terminating_grace_limit", "resync_interval", "linger_limit"):
            positive_seconds(name, getattr(self, name))
        if self.delete_grace_seconds < 0:
            raise ValueError(f"delete_grace_seconds: must be >= 0, got {self.delete_grace_seconds}")


@dataclass(frozen=True, slots=True)
class PodView:
    """One of the job's pods as the operator sees it (derived from the pod object by ``podview``)."""

    name: str
    role: str  # "worker" or "spare" (the label it was created with)
    index: int
    phase: PodPhase
    ready: bool = False
    #: Unix time the deletion was requested (metadata.deletionTimestamp minus the grace period), else None.
    deleting_since: float | None = None
    #: The grace period the deletion was given.
    deletion_grace: float = 30.0
    #: Exit code of the trainer container (the first) once it terminated.
    exit_code: int | None = None
    #: Why the pod or its trainer container ended: Evicted, OOMKilled, NodeLost, Error, Completed...
    reason: str | None = None
    message: str = ""
    #: The scheduler reported it cannot place the pod.
    unschedulable: bool = False
    #: The node the pod is bound to (spec.nodeName), else None.
    node: str | None = None
    #: Unix time the kubelet started the pod (status.startTime), else None.
    started_at: float | None = None
    #: The pod's IP (status.podIP), else None: a survivor's collective error may name its peer by it.
    ip: str | None = None
    #: Its node's address (status.hostIP), else None: a connection from a pod that shares its node's network
    #: namespace arrives from that address.
    host_ip: str | None = None
    #: Not seen in the watch yet: the operator created it and assumes it exists (see ``observe.overlay``).
    #: Such a pod is never tracked, so one whose creation the watch has not shown cannot count as vanished.
    assumed: bool = False
    #: The pod's uid (its incarnation), when known: what the fence record names.
    uid: str = ""

    @property
    def deleting(self) -> bool:
        return self.deleting_since is not None

    @property
    def finished(self) -> bool:
        return self.phase in ("Succeeded", "Failed")


@dataclass(frozen=True, slots=True)
class EtcdView:
    """The job's records in etcd, as read at one revision. ``reachable`` is False when etcd did not answer;
    then every other field is empty and the reconcile takes no step that needs etcd (fencing)."""

    reachable: bool = True
    record: JobRecord | None = None
    expected: tuple[str, ...] | None = None
    manifest: Manifest | None = None
    #: mod_revision of the manifest: the round's fencing token.
    epoch: int = 0
    #: node id -> id of the lease its rendezvous node key is bound to.
    leases: dict[str, int] = field(default_factory=dict)
    progress: tuple[ProgressRecord, ...] = ()
    closed: bool = False
    #: The restart protocol's fault records of the current round, as ``(mod_revision, record)``.
    faults: tuple[tuple[int, FaultRecord], ...] = ()
    #: The uids of the pods whose fence record exists (``JobKeys.fenced``): each is written once.
    fenced: frozenset[str] = frozenset()


@dataclass(frozen=True, slots=True)
class JobView:
    """The TrainingJob. ``spec`` is None when the stored spec does not validate; ``spec_problem`` then names
    the field and what was expected (a spec that slipped past the CRD's validation)."""

    name: str
    namespace: str
    uid: str
    generation: int
    spec: TrainingJobSpec | None
    status: TrainingJobStatus
    spec_problem: tuple[str, str] | None = None
    deleting: bool = False
    #: The Kueue queue the job's label names (``kueue.x-k8s.io/queue-name``): its pods are queued as a group.
    queue_name: str | None = None


@dataclass(frozen=True, slots=True)
class EtcdProblem:
    """Why the operator cannot use the job's etcd with the credentials it has (a Secret without a key TLS
    needs, a missing Secret, etcd refusing the login or the keys): retrying does not help until the Secret or
    etcd changes. ``reason`` is CamelCase; ``message`` names the key or etcd's refusal."""

    reason: str
    message: str


@dataclass(frozen=True, slots=True)
class Conflict:
    """An object with a name the job needs (its Secret, Service or a pod) that exists and is not the job's:
    ``owner`` says whose it is (``"no owner"``, ``"TrainingJob other"``...). The operator leaves it alone."""

    kind: str
    name: str
    owner: str

    def __str__(self) -> str:
        return f"{self.kind} {self.name} ({self.owner})"


@dataclass(frozen=True, slots=True)
class Observation:
    """Everything one reconcile looks at. ``now`` is Unix seconds; ``last_status_patch`` is when this
    operator last patched the job's status (None if never).

    ``job.status`` is the status the previous reconcile *decided* (events and counters are relative to it, so
    each fires once); ``written_status`` is the one last patched to the API, when that differs (a patch held
    back by the rate limit). None means the two are the same."""

    job: JobView
    pods: tuple[PodView, ...]
    etcd: EtcdView
    now: float
    last_status_patch: float | None = None
    written_status: TrainingJobStatus | None = None
    #: The job's headless Service and Secret were created (or found) by this operator already.
    owned_objects_ready: bool = False
    #: Nodes whose kubelet is gone (Ready=Unknown or the unreachable taint; see ``node_loss``).
    unreachable_nodes: frozenset[str] = frozenset()
    #: Set when the job's etcd cannot be used with the credentials at hand (``etcd.reachable`` is then False).
    etcd_problem: EtcdProblem | None = None
    #: Objects the job needs whose names are taken by objects that are not the job's.
    conflicts: tuple[Conflict, ...] = ()
    #: The operator runs with a gang scheduler (``--gang-scheduler``): each job has a PodGroup to keep.
    gang_scheduled: bool = False
    #: The job's PodGroup's ``minMember`` as this operator last wrote it (None: not written yet).
    pod_group_min_member: int | None = None


# -- actions -------------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class EnsureOwnedObjects:
    """Create the headless Service and the Secret with a random RPC token, unless they exist (and check that
    existing ones are the job's: one that is not becomes a :class:`Conflict`)."""


@dataclass(frozen=True, slots=True)
class SyncPodGroup:
    """Make the job's PodGroup's ``minMember`` the job's minimum (create the group, or patch the one there):
    the gang scheduler then binds a pod only once that many of the job's pods fit (spares are not counted:
    a job runs without them)."""

    min_member: int


@dataclass(frozen=True, slots=True)
class CreatePod:
    name: str
    role: str
    index: int


@dataclass(frozen=True, slots=True)
class DeletePod:
    """Delete a pod with ``grace`` seconds (0 = force: the pod's node is gone or it is stuck terminating)."""

    name: str
    grace: int
    reason: str


@dataclass(frozen=True, slots=True)
class RevokeLease:
    """Fence a lost node: revoking its lease deletes its rendezvous key, so it cannot act in a new round."""

    node_id: str
    lease_id: int


@dataclass(frozen=True, slots=True)
class WriteFence:
    """Fence a pod for good: its fence record (``JobKeys.fenced``) makes every later registration of its agent
    fail, so a zombie of the pod back from a partition can neither register nor join a round, and says so."""

    node_id: str
    pod_uid: str
    reason: str


@dataclass(frozen=True, slots=True)
class WriteJobRecord:
    """Write the JobRecord (from the spec, these members/spares) and the rendezvous' expected nodes."""

    members: tuple[str, ...]
    spares: tuple[str, ...]
    expected: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class CloseRendezvous:
    """The job finished: no new rounds; agents outside the current round leave."""

    reason: str


@dataclass(frozen=True, slots=True)
class PatchStatus:
    status: TrainingJobStatus


@dataclass(frozen=True, slots=True)
class EmitEvent:
    type: Literal["Normal", "Warning"]
    reason: str
    message: str


@dataclass(frozen=True, slots=True)
class DeleteJob:
    """ttlSecondsAfterFinished passed: delete the TrainingJob (its pods go by owner reference)."""


Action = (EnsureOwnedObjects | SyncPodGroup | CreatePod | DeletePod | WriteFence | RevokeLease | WriteJobRecord
          | CloseRendezvous | PatchStatus | EmitEvent | DeleteJob)


@dataclass(frozen=True, slots=True)
class Decision:
    """The result of one reconcile: actions to apply in order, the status the job should have (patched only
    when ``PatchStatus`` is among the actions: status patches are rate-limited), and when to look again
    (``requeue_after`` seconds; None = only when something changes or at the resync interval)."""

    actions: tuple[Action, ...]
    status: TrainingJobStatus
    requeue_after: float | None = None
