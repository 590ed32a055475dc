"""The TrainingJob spec: what the user asks for.

Defaults live here and only here: as field defaults (which also become the CRD's ``default``s, so the API
server and the Python models fill in the same values), plus the two derived ones, ``minReplicas`` and
``maxReplicas``, which default to ``replicas`` and are filled in by :meth:`TrainingJobSpec._defaults_and_rules`
(and read by the operator through :attr:`TrainingJobSpec.min_nodes` / :attr:`TrainingJobSpec.max_nodes`).
"""

from __future__ import annotations

import ipaddress
import re
from enum import StrEnum
from typing import Annotated, Any, ClassVar

from pydantic import ConfigDict, Field, field_validator, model_validator

from stalwart.api.base import ApiModel, Rule, RuleViolation, check_rules
from stalwart.api.failure_rules import (
    FailureRule,
)
from stalwart.api.naming import (
    DNS1123_LABEL,
    DNS1123_SUBDOMAIN,
    MAX_LABEL_LENGTH,
    MAX_SUBDOMAIN_LENGTH,
)
from stalwart.api.restart_settings import order_rules

#: Upper bound of ``replicas``/``maxReplicas``/``spares``, and of ``maxReplicas + spares``: far below
#: naming.MAX_POD_INDEX, so replacement pods have indices to spare.
MAX_REPLICAS = 10_000
MAX_ETCD_ENDPOINTS = 16
MAX_RULES = 32
MAX_NPROC_PER_NODE = 1024
#: One day: no single wait of stalwart's is meant to be longer.
MAX_TIMEOUT_SECONDS = 86_400
#: A Kubernetes quantity of bytes: a number with an optional binary (Ki..Ei) or decimal (k..E) suffix.
QUANTITY_PATTERN = r"^[0-9]+(\.[0-9]+)?(Ki|Mi|Gi|Ti|Pi|Ei|k|M|G|T|P|E)?$"
_QUANTITY = re.compile(QUANTITY_PATTERN)
_SUFFIX_BYTES = {"": 1, "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12, "P": 10**15, "E": 10**18,
                 "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50, "Ei": 2**60}
#: The memory-backed /dev/shm every worker pod gets unless its template mounts one itself.
DEFAULT_SHM_SIZE = "1Gi"
#: Below this a /dev/shm is no better than a container runtime's 64 MiB default.
MIN_SHM_BYTES = 64 * 2**20
#: ``spec.managedBy`` of a job this operator reconciles (the value, or the field left out), as Kubernetes' batch
#: APIs name their own controller; any other value hands the job to that controller (e.g. Kueue's MultiKueue).
MANAGED_BY_STALWART = "stalwart.dev/trainingjob-controller"
#: A domain-prefixed path, as ``Job.spec.managedBy`` requires (e.g. ``kueue.x-k8s.io/multikueue``).
MANAGED_BY_PATTERN = (r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*"
                      r"/[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$")


def managed_here(managed_by: object) -> bool:
    """Whether stalwart's operator reconciles a job whose ``spec.managedBy`` is this (raw, as stored)."""
    return managed_by is None or managed_by == MANAGED_BY_STALWART


def quantity_bytes(text: str) -> int:
    """The bytes of a Kubernetes quantity such as ``1Gi``, ``512Mi`` or ``2G``; ValueError naming what was
    expected otherwise."""
    match = _QUANTITY.fullmatch(text)
    if match is None:
        raise ValueError(f"expected a quantity of bytes such as 1Gi, 512Mi or 2G, got {text!r}")
    suffix = match.group(2) or ""
    return int(float(text[: len(text) - len(suffix)]) * _SUFFIX_BYTES[suffix])


# ---------------------------------------------------------------------------------------------------------
# The pod template: a Kubernetes PodTemplateSpec, kept loose (the API server validates pods), except for what
# stalwart relies on: at least one container, each named, with an image; the first runs the training command.


class Container(ApiModel):
    """A container of the pod template (a Kubernetes Container; fields other than these pass unchanged)."""

    model_config = ConfigDict(extra="allow")

    name: str = Field(
        description="Name of the container, a DNS-1123 label, unique within the pod.",
        min_length=1, max_length=MAX_LABEL_LENGTH, pattern=DNS1123_LABEL.pattern)
    image: str = Field(description="Container image that holds the training code.", min_length=1)
    command: list[str] | None = Field(
        default=None,
        description=("Entrypoint array. Required on the first container: stalwart's agent starts it as each "
                     "rank's process (with args), like torchrun would."))
    args: list[str] | None = Field(default=None, description="Arguments to the entrypoint.")


class PodSpec(ApiModel):
    """The pod spec of the template (a Kubernetes PodSpec; fields other than containers pass unchanged)."""

    model_config = ConfigDict(extra="allow")

    containers: list[Container] = Field(
        description=("Containers of each pod; at least one. The first is the trainer: the operator runs its "
                     "command under the stalwart agent."),
        min_length=1)

    __rules__: ClassVar[list[Rule]] = [
        Rule(
            field="containers[0].command",
            cel="has(self.containers[0].command) && size(self.containers[0].command) > 0",
            message="containers[0].command is required: the stalwart agent runs it as each rank's process",
            check=lambda s: None if s.containers[0].command else
            "required on the first container: the stalwart agent runs it as each rank's process"),
    ]

    @model_validator(mode="after")
    def _rules(self) -> PodSpec:
        check_rules(self, self.__rules__)
        return self


class PodTemplate(ApiModel):
    """A Kubernetes PodTemplateSpec: the pods the job runs (image, command, resources, volumes...)."""

    metadata: dict[str, Any] | None = Field(
        default=None, description="Labels and annotations for the pods (a Kubernetes ObjectMeta).")
    spec: PodSpec = Field(description="The pod spec (a Kubernetes PodSpec).")


# ---------------------------------------------------------------------------------------------------------
# Rendezvous: the etcd cluster the agents meet in.

_HOST = re.compile(r"^[A-Za-z0-9]([-A-Za-z0-9]*[A-Za-z0-9])?(\.[A-Za-z0-9]([-A-Za-z0-9]*[A-Za-z0-9])?)*$")
#: The CRD's pattern for an endpoint. Python validates with endpoint_problem instead, which is stricter on
#: ports and IP addresses and says what is wrong.
_PORT_PATTERN = r"([1-9][0-9]{0,3}|[1-5][0-9]{4}|6[0-4][0-9]{3}|65[0-4][0-9]{2}|655[0-2][0-9]|6553[0-5])"
ENDPOINT_PATTERN = r"^([A-Za-z0-9]([-A-Za-z0-9.]*[A-Za-z0-9])?|\[[0-9A-Fa-f:.]+\]):" + _PORT_PATTERN + "$"


def endpoint_problem(endpoint: str) -> str | None:
    """``None`` when ``endpoint`` is ``host:port`` (``[v6addr]:port`` for IPv6), else what is wrong."""
    expected = "expected host:port (e.g. etcd.example.svc:2379 or [fd00::1]:2379)"
    if "://" in endpoint:
        return f"{expected} without a scheme, got {endpoint!r}"
    host, sep, port = endpoint.rpartition(":")
    if not sep or not host:
        return f"{expected}, got {endpoint!r}"
    if not port.isdigit() or not 1 <= int(port) <= 65535:
        return f"port must be an integer in 1..65535, got {port!r} in {endpoint!r}"
    if host.startswith("["):
        if not host.endswith("]"):
            return f"{expected}, got {endpoint!r}"
        try:
            ipaddress.IPv6Address(host[1:-1])
        except ValueError:
            return f"{host[1:-1]!r} is not an IPv6 address in {endpoint!r}"
        return None
    if ":" in host:
        return f"an IPv6 address must be in brackets, e.g. [{host}]:{port}, got {endpoint!r}"
    if len(host) > MAX_SUBDOMAIN_LENGTH or not _HOST.fullmatch(host):
        return f"{host!r} is not a host name or IPv4 address in {endpoint!r}"
    return None


class SecretReference(ApiModel):
    """A Secret in the job's namespace."""

    name: str = Field(description="Name of the Secret.", min_length=1, max_length=MAX_SUBDOMAIN_LENGTH,
                      pattern=DNS1123_SUBDOMAIN.pattern)


class RendezvousSpec(ApiModel):
    """Where and how the job's agents meet: an etcd v3 cluster, and the rendezvous timeouts."""

    endpoints: list[Annotated[str, Field(json_schema_extra={"pattern": ENDPOINT_PATTERN})]] | None = Field(
        default=None,
        description=("etcd client endpoints as host:port (IPv6 as [addr]:port). When omitted, the operator's "
                     "default endpoints are used (the etcd that the Helm chart installs or names). The operator "
                     "serves jobs only on its own etcd: other endpoints fail the job with InvalidSpec."),
        min_length=1, max_length=MAX_ETCD_ENDPOINTS)
    tls: bool = Field(
        default=False,
        description=("Connect to etcd over TLS, trusting the CA in the Secret's ca.crt (and presenting "
                     "tls.crt/tls.key when present). Requires secretRef."))
    secret_ref: SecretReference | None = Field(
        default=None,
        description=("Secret with etcd credentials: ca.crt, tls.crt, tls.key for TLS; username and password "
                     "for etcd authentication. The operator mounts it into every pod and never reads it."))
    join_timeout_seconds: float = Field(
        default=600.0, gt=0, le=MAX_TIMEOUT_SECONDS,
        description=("How long an agent waits for a rendezvous round to reach minReplicas nodes before it "
                     "gives up and its pod fails."))
    last_call_seconds: float = Field(
        default=10.0, ge=0, le=MAX_TIMEOUT_SECONDS,
        description=("Once minReplicas nodes have joined, how long the round stays open for more (up to "
                     "maxReplicas) before it is sealed. Must be less than joinTimeoutSeconds."))
    lease_ttl_seconds: int = Field(
        default=10, ge=2, le=3600, alias="leaseTTLSeconds",
        description=("TTL of each agent's etcd lease: an agent that stops renewing it (its pod is gone or "
                     "partitioned) is considered lost this long after its last renewal."))

    @field_validator("endpoints")
    @classmethod
    def _endpoints(cls, endpoints: list[str] | None) -> list[str] | None:
        if endpoints is None:
            return None
        problems = [(f"[{index}]", problem) for index, endpoint in enumerate(endpoints)
                    if (problem := endpoint_problem(endpoint)) is not None]
        if problems:
            raise RuleViolation(problems)
        return endpoints

    __rules__: ClassVar[list[Rule]] = [
        Rule(
            field="secretRef",
            cel="!self.tls || has(self.secretRef)",
            message="secretRef is required when tls is true (the Secret holds ca.crt)",
            check=lambda s: None if not s.tls or s.secret_ref is not None else
            "required when tls is true (the Secret holds ca.crt)"),
        Rule(
            field="lastCallSeconds",
            cel="self.lastCallSeconds < self.joinTimeoutSeconds",
            message="lastCallSeconds must be less than joinTimeoutSeconds",
            check=lambda s: None if s.last_call_seconds < s.join_timeout_seconds else
            f"must be less than joinTimeoutSeconds ({s.join_timeout_seconds:g}), got {s.last_call_seconds:g}"),
    ]

    @model_validator(mode="after")
    def _rules(self) -> RendezvousSpec:
        check_rules(self, self.__rules__)
        return self


# ---------------------------------------------------------------------------------------------------------
# Restart policy: in-process restarts first, then pod replacement, with rules to pick per failure.


class PeerSnapshotPolicy(ApiModel):
    """Peer snapshots of each rank's shard of the state (``stalwart.restart.PeerSnapshots`` in the training
    function): what the job allows them."""

    enabled: bool = Field(
        default=True,
        description=("Whether PeerSnapshots in the training function takes snapshots; false: it takes none and "
                     "its restore() always leaves the state to the checkpoint."))
    every: int = Field(
        default=1, ge=1, le=1_000_000,
        description=("Steps between snapshots, where the training function does not pass every=... itself: "
                     "a lost pod costs at most this many steps."))
    memory_limit: str | None = Field(
        default=None, max_length=32, json_schema_extra={"pattern": QUANTITY_PATTERN},
        description=("The most memory one rank may hold in snapshots (its own shard's two newest and those of "
                     "the ranks it keeps them for), a Kubernetes quantity such as 8Gi; a rank whose snapshots "
                     "need more fails at its first snapshot, naming this setting. Unset: no limit."))

    @field_validator("memory_limit")
    @classmethod
    def _memory_limit(cls, value: str | None) -> str | None:
        if value is None:
            return value
        try:
            quantity_bytes(value)
        except ValueError as e:
            raise RuleViolation([("", str(e))]) from None
        return value

    def memory_limit_bytes(self) -> int | None:
        return None if self.memory_limit is None else quantity_bytes(self.memory_limit)


class InProcessRestart(ApiModel):
    """In-process restart: after a fault every healthy rank re-runs the training function in the same
    process, without restarting pods."""

    max_restarts: int = Field(
        default=10, ge=0, le=1_000_000,
        description=("How many in-process restarts the ranks may make in a rendezvous round; one more fault "
                     "ends the job Failed with reason RestartsExhausted (the fault repeats: no restart helps). "
                     "0: the first fault fails the job. Options the training function's "
                     "@stalwart.restartable(...) sets itself win over this and the timeouts below."))
    soft_timeout_seconds: float = Field(
        default=60.0, gt=0, le=MAX_TIMEOUT_SECONDS,
        description=("A rank that shows no progress for this long is considered hung: the job restarts in "
                     "process (progress: call_wrapper.ping(), or the training function's main thread running "
                     "Python, which a thread blocked in a collective or stopped does not). A rank process "
                     "stopped by a signal for this long is killed by its agent and respawned. Must be less "
                     "than hardTimeoutSeconds."))
    hard_timeout_seconds: float = Field(
        default=90.0, gt=0, le=MAX_TIMEOUT_SECONDS,
        description=("A rank process that shows no progress for this long, in the training function or in "
                     "stalwart's own steps around it, is killed by its agent and respawned."))
    barrier_timeout_seconds: float = Field(
        default=120.0, gt=0, le=MAX_TIMEOUT_SECONDS,
        description=("How long the ranks wait for each other at a restart barrier before the ranks that "
                     "have not arrived are declared failed, and how long building an iteration's process "
                     "group may take."))
    warm_spares: bool | None = Field(
        default=None,
        description=("Recover a lost pod in process: spare pods start their rank processes early and wait "
                     "inside the restart wrapper; when a pod is lost, the surviving pods keep their processes "
                     "and continue in the new rendezvous round, a spare taking the lost ranks. Needs a "
                     "training function wrapped with @stalwart.restartable; state comes from peers "
                     "(stalwart.restart.sync_from_peers) or the script's checkpoint. Unset (the default): on "
                     "for a job with spares, and a spare starts its processes once a worker's ranks have shown "
                     "they run the restart wrapper (a script without it restarts its processes, as with false). "
                     "true: spares start their processes at once. false: every pod loss restarts the rank "
                     "processes."))

    peer_snapshots: PeerSnapshotPolicy = Field(
        default_factory=PeerSnapshotPolicy, json_schema_extra={"default": {}},
        description="Peer snapshots of sharded state (stalwart.restart.PeerSnapshots): on, how often, how much memory.")

    __rules__: ClassVar[list[Rule]] = order_rules()

    @model_validator(mode="after")
    def _rules(self) -> InProcessRestart:
        check_rules(self, self.__rules__)
        return self


def warm_spares_on(setting: bool | None, spares: int) -> bool:
    """Whether pod loss is recovered in process: ``restartPolicy.inProcess.warmSpares`` where it is set, else
    whether the job has spares. Pure."""
    return setting if setting is not None else spares > 0


class RestartPolicy(ApiModel):
    """How failures are handled: in-process restart, pod replacement, and rules that choose per failure.
    Without a matching rule, a failure is restarted in process while maxRestarts lasts, then handled by
    replacing the failed pod while backoffLimit lasts, then fails the job."""

    in_process: InProcessRestart = Field(
        default_factory=InProcessRestart, description="In-process restart settings.",
        json_schema_extra={"default": {}})
    backoff_limit: int = Field(
        default=6, ge=0, le=1_000_000,
        description="How many pods may be replaced after failures before the job fails.")
    rules: list[FailureRule] = Field(
        default_factory=list, max_length=MAX_RULES,
        description="Failure rules, tried in order; the first that matches a failure decides its action.",
        json_schema_extra={"default": []})


# ---------------------------------------------------------------------------------------------------------
# Run policy and success policy.


class CleanPodPolicy(StrEnum):
    """Which pods to delete when the job finishes."""

    ALL = "All"
    RUNNING = "Running"
    NONE = "None"


class RunPolicy(ApiModel):
    """The job's life cycle: suspension, deadline, clean-up."""

    suspend: bool = Field(
        default=False,
        description="Suspend the job: its pods are deleted and none are created until it is resumed.")
    active_deadline_seconds: int | None = Field(
        default=None, ge=1,
        description="Fail the job when it has been running longer than this (counted from status.startTime).")
    ttl_seconds_after_finished: int | None = Field(
        default=None, ge=0,
        description="Delete the TrainingJob this long after it finished (Succeeded or Failed).")
    clean_pod_policy: CleanPodPolicy = Field(
        default=CleanPodPolicy.RUNNING,
        description=("Pods to delete when the job finishes: All, Running (those still running, e.g. "
                     "spares; finished pods keep their logs) or None."))


class FaultInjection(ApiModel):
    """Whether ``stalwart drill`` may inject faults into the job's ranks through its agents."""

    enabled: bool = Field(
        default=False,
        description=("Let the job's agents carry out fault drills (a rank exception, SIGKILL or hang) requested "
                     "with the job's Secret. Off by default: without it every such request is refused. Pod "
                     "deletions go through the Kubernetes API and need no opt-in."))


class SuccessPolicy(StrEnum):
    """When the job has succeeded."""

    ALL_WORKERS = "AllWorkers"
    RANK_ZERO = "RankZero"


# ---------------------------------------------------------------------------------------------------------
# The spec.


def _check_min_replicas(s: TrainingJobSpec) -> str | None:
    if s.min_replicas is None or s.min_replicas <= s.replicas:
        return None
    return f"must be less than or equal to replicas ({s.replicas}), got {s.min_replicas}"


def _check_max_replicas(s: TrainingJobSpec) -> str | None:
    if s.max_replicas is None or s.max_replicas >= s.replicas:
        return None
    return f"must be greater than or equal to replicas ({s.replicas}), got {s.max_replicas}"


def _check_pod_count(s: TrainingJobSpec) -> str | None:
    total = (s.max_replicas if s.max_replicas is not None else s.replicas) + s.spares
    if total <= MAX_REPLICAS:
        return None
    return f"maxReplicas + spares must be at most {MAX_REPLICAS}, got {total}"


class TrainingJobSpec(ApiModel):
    """The desired state of a TrainingJob."""

    replicas: int = Field(
        ge=1, le=MAX_REPLICAS,
        description=("Number of worker pods (nodes) to run. The scale subresource sets it. Each runs "
                     "nprocPerNode ranks."))
    min_replicas: int | None = Field(
        default=None, ge=1, le=MAX_REPLICAS,
        description=("Elastic lower bound: the job keeps training with at least this many worker pods when "
                     "pods are lost and no spare is left. Defaults to replicas (not elastic)."))
    max_replicas: int | None = Field(
        default=None, ge=1, le=MAX_REPLICAS,
        description="Elastic upper bound on worker pods in a round. Defaults to replicas.")
    spares: int = Field(
        default=0, ge=0, le=MAX_REPLICAS,
        description=("Spare pods kept running beside the workers: when a worker is lost, a spare takes "
                     "over its ranks at the next in-process restart, without waiting for a new pod."))
    nproc_per_node: int = Field(
        default=1, ge=1, le=MAX_NPROC_PER_NODE,
        description="Rank processes per pod (typically its number of GPUs).")
    template: PodTemplate = Field(
        description="The pod template of the workers and spares (image, command, resources...).")
    rendezvous: RendezvousSpec = Field(
        default_factory=RendezvousSpec, description="The etcd cluster the agents meet in, and its timeouts.",
        json_schema_extra={"default": {}})
    restart_policy: RestartPolicy = Field(
        default_factory=RestartPolicy, description="How failures are handled.",
        json_schema_extra={"default": {}})
    run_policy: RunPolicy = Field(
        default_factory=RunPolicy, description="Suspension, deadline and clean-up.",
        json_schema_extra={"default": {}})
    success_policy: SuccessPolicy = Field(
        default=SuccessPolicy.ALL_WORKERS,
        description=("When the job has succeeded: AllWorkers (every rank's process exited 0) or RankZero "
                     "(rank 0's process exited 0)."))
    fault_injection: FaultInjection = Field(
        default_factory=FaultInjection, description="Fault drills through the job's agents (stalwart drill).",
        json_schema_extra={"default": {}})
    managed_by: str | None = Field(
        default=None, max_length=63, json_schema_extra={
            "pattern": MANAGED_BY_PATTERN,
            "x-kubernetes-validations": [{"rule": "self == oldSelf", "message": "managedBy is immutable"}]},
        description=(f"The controller that reconciles this job, as in Kubernetes' batch Job: left out or "
                     f"{MANAGED_BY_STALWART!r}, stalwart's operator; any other domain-prefixed path (such as "
                     "kueue.x-k8s.io/multikueue), that controller, and stalwart's operator leaves the job, its "
                     "pods and its status alone. Immutable once set."))
    shm_size: str = Field(
        default=DEFAULT_SHM_SIZE, max_length=32, json_schema_extra={"pattern": QUANTITY_PATTERN},
        description=("Size limit of the memory-backed /dev/shm (an emptyDir with medium Memory) every pod gets "
                     "unless its template mounts /dev/shm itself: a Kubernetes quantity such as 1Gi or 8Gi, at "
                     "least 64Mi. It counts against the pod's memory. The RPC layer's shared-memory rings and "
                     "DataLoader workers need more than a container runtime's 64 MiB default."))

    @field_validator("managed_by")
    @classmethod
    def _managed_by(cls, value: str | None) -> str | None:
        if value is not None and not re.fullmatch(MANAGED_BY_PATTERN, value):
            raise RuleViolation([("", f"must be a domain-prefixed path such as {MANAGED_BY_STALWART!r}, "
                                      f"got {value!r}")])
        return value

    @field_validator("shm_size")
    @classmethod
    def _shm_size(cls, value: str) -> str:
        try:
            size = quantity_bytes(value)
        except ValueError as e:
            raise RuleViolation([("", str(e))]) from None
        if size < MIN_SHM_BYTES:
            raise RuleViolation([("", f"must be at least 64Mi (a container runtime's default), got {value!r}")])
        return value

    __rules__: ClassVar[list[Rule]] = [
        Rule(field="minReplicas",
             cel="!has(self.minReplicas) || self.minReplicas <= self.replicas",
             message="minReplicas must be less than or equal to replicas",
             check=_check_min_replicas),
        Rule(field="maxReplicas",
             cel="!has(self.maxReplicas) || self.maxReplicas >= self.replicas",
             message="maxReplicas must be greater than or equal to replicas",
             check=_check_max_replicas),
        Rule(field="spares",
             cel=f"(has(self.maxReplicas) ? self.maxReplicas : self.replicas) + self.spares <= {MAX_REPLICAS}",
             message=f"maxReplicas + spares must be at most {MAX_REPLICAS}",
             check=_check_pod_count),
    ]

    @model_validator(mode="after")
    def _defaults_and_rules(self) -> TrainingJobSpec:
        check_rules(self, self.__rules__)
        # The derived defaults, filled in only once the rules hold (they are stated against replicas).
        if self.min_replicas is None:
            self.min_replicas = self.replicas
        if self.max_replicas is None:
            self.max_replicas = self.replicas
        return self

    @property
    def min_nodes(self) -> int:
        """``minReplicas`` with its default applied."""
        return self.min_replicas if self.min_replicas is not None else self.replicas

    @property
    def max_nodes(self) -> int:
        """``maxReplicas`` with its default applied."""
        return self.max_replicas if self.max_replicas is not None else self.replicas

