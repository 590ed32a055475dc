"""The pod contract: every variable the operator, the agent and a rank process pass to one another, defined once.

Three hops, each a model read with :func:`read_env` (one parse, one error type, :class:`PodEnvError`, whose
message names each bad or missing variable and what was expected):

* the operator writes a worker pod's :class:`AgentEnvironment` (``STALWART_JOB`` ... ``STALWART_RPC_TOKEN``,
  the etcd credentials' directory; :func:`worker_env` is the container ``env`` it writes); ``stalwart agent``
  reads it;
* the agent gives each rank process torchrun's variables (:class:`TorchrunEnvironment`, so that unmodified
  scripts run) and the restart wrapper's :class:`RankEnvironment` (its round's epoch, its slot, the job's
  in-process restart settings), plus the pod's own ``STALWART_POD_IP``/``STALWART_RPC_TOKEN`` and the etcd
  credentials' directory (never the credentials themselves);
* a rank process reads them: the restart wrapper (:class:`RankEnvironment`), ``init_rpc()`` with no arguments
  (:class:`RpcVariables` besides), the etcd client (:class:`EtcdSecretMount`).

The handover file and the parked flag (``STALWART_HANDOVER_FILE``, ``STALWART_PARKED``) are named here too.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from ipaddress import ip_address
from typing import Annotated, Any, Self, TypeVar

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    SecretStr,
    ValidationError,
    model_validator,
)

from stalwart.api.restart_settings import RESTART_SETTINGS, by_option, order_problem

__all__ = [
    "AGENT_VARIABLES",
    "ETCD_VARIABLES",
    "FORK_SERVER",
    "HANDOVER_FILE",
    "PARKED",
    "PARKED_REPORT",
    "RANK_VARIABLES",
    "RPC_VARIABLES",
    "SNAPSHOT_VARIABLES",
    "STANDBY",
    "TORCHRUN_VARIABLES",
    "AgentEnvironment",
    "EtcdEndpoints",
    "EtcdSecretMount",
    "JobRef",
    "PodEnvError",
    "RankEnvironment",
    "RpcVariables",
    "SnapshotEnvironment",
    "TorchrunEnvironment",
    "read_env",
    "worker_env",
]

# -- the variables -------------------------------------------------------------------------------------------

JOB = "STALWART_JOB"
JOB_UID = "STALWART_JOB_UID"
NODE_ID = "STALWART_NODE_ID"
#: The pod's uid (downward API): the incarnation the operator's fence record names (JobKeys.fenced).
POD_UID = "STALWART_POD_UID"
#: The job's peer-snapshot policy (restartPolicy.inProcess.peerSnapshots), for stalwart.restart.PeerSnapshots.
SNAPSHOTS = "STALWART_SNAPSHOTS"
SNAPSHOT_EVERY = "STALWART_SNAPSHOT_EVERY"
SNAPSHOT_MEMORY_LIMIT = "STALWART_SNAPSHOT_MEMORY_LIMIT"
POD_IP = "STALWART_POD_IP"
SPARE = "STALWART_SPARE"
NPROC_PER_NODE = "STALWART_NPROC_PER_NODE"
MIN_NODES = "STALWART_MIN_NODES"
MAX_NODES = "STALWART_MAX_NODES"
ETCD_ENDPOINTS = "STALWART_ETCD_ENDPOINTS"
RPC_TOKEN = "STALWART_RPC_TOKEN"
ETCD_TLS = "STALWART_ETCD_TLS"
ETCD_SECRET_DIR = "STALWART_ETCD_SECRET_DIR"
EPOCH = "STALWART_EPOCH"
SLOT = "STALWART_SLOT"
SLOTS = "STALWART_SLOTS"
TARGET_WORLD = "STALWART_TARGET_WORLD"
MIN_WORLD = "STALWART_MIN_WORLD"
STATUS_FILE = "STALWART_STATUS_FILE"
#: The port the agent serves its Prometheus metrics on (unset: none served).
METRICS_PORT = "STALWART_METRICS_PORT"
#: ``false`` starts every rank process fresh instead of forking it from the pod's fork server (the container's
#: own opt-out: the agent's command line is the operator's).
FORK_SERVER = "STALWART_FORK_SERVER"
MAX_RESTARTS = by_option("max_restarts").env
SOFT_TIMEOUT = by_option("soft_timeout").env
HARD_TIMEOUT = by_option("hard_timeout").env
BARRIER_TIMEOUT = by_option("barrier_timeout").env
#: The agent's barrier relay (:mod:`stalwart.api.relay`): a Unix socket in its private run directory.
RELAY_SOCKET = "STALWART_RELAY_SOCKET"
#: The variable naming a rank process's handover file (:mod:`stalwart.api.handover`).
HANDOVER_FILE = "STALWART_HANDOVER_FILE"
#: ``true`` for a warm spare's process that has no round yet.
PARKED = "STALWART_PARKED"
#: Where a parked process writes why it ended before a round took it (its prepare hook raised): a
#: :class:`~stalwart.api.restart.FailureInfo`, in the agent's private run directory.
PARKED_REPORT = "STALWART_PARKED_REPORT"
#: ``false`` keeps no standby process in the pod (the container's own opt-out; see stalwart.agent.standby).
STANDBY = "STALWART_STANDBY"
# torchrun's
RANK = "RANK"
LOCAL_RANK = "LOCAL_RANK"
WORLD_SIZE = "WORLD_SIZE"
LOCAL_WORLD_SIZE = "LOCAL_WORLD_SIZE"
GROUP_RANK = "GROUP_RANK"
ROLE_RANK = "ROLE_RANK"
ROLE_WORLD_SIZE = "ROLE_WORLD_SIZE"
MASTER_ADDR = "MASTER_ADDR"
MASTER_PORT = "MASTER_PORT"
RESTART_COUNT = "TORCHELASTIC_RESTART_COUNT"
RUN_ID = "TORCHELASTIC_RUN_ID"

#: Variable -> field, per model.
AGENT_VARIABLES = {
    JOB: "job", JOB_UID: "job_uid", NODE_ID: "node_id", POD_UID: "pod_uid", POD_IP: "pod_ip", SPARE: "spare",
    NPROC_PER_NODE: "nproc_per_node", MIN_NODES: "min_nodes", MAX_NODES: "max_nodes",
    ETCD_ENDPOINTS: "etcd_endpoints", RPC_TOKEN: "rpc_token", ETCD_TLS: "etcd_tls", ETCD_SECRET_DIR: "etcd_secret_dir",
    METRICS_PORT: "metrics_port", FORK_SERVER: "fork_server", STANDBY: "standby",
}
RANK_VARIABLES = {
    ETCD_ENDPOINTS: "etcd_endpoints", JOB: "job", JOB_UID: "job_uid", NODE_ID: "node_id", EPOCH: "epoch",
    SLOT: "slot", SLOTS: "slots", TARGET_WORLD: "target_world", MIN_WORLD: "min_world", SPARE: "spare",
    STATUS_FILE: "status_file", LOCAL_RANK: "local_rank", RELAY_SOCKET: "relay_socket",
    **{setting.env: setting.option for setting in RESTART_SETTINGS},
}
TORCHRUN_VARIABLES = {
    RANK: "rank", LOCAL_RANK: "local_rank", WORLD_SIZE: "world_size", LOCAL_WORLD_SIZE: "local_world_size",
    GROUP_RANK: "group_rank", ROLE_RANK: "role_rank", ROLE_WORLD_SIZE: "role_world_size",
    MASTER_ADDR: "master_addr", MASTER_PORT: "master_port", RESTART_COUNT: "restart_count", RUN_ID: "run_id",
}
RPC_VARIABLES = {RANK: "rank", WORLD_SIZE: "world_size", POD_IP: "pod_ip", RPC_TOKEN: "rpc_token"}
SNAPSHOT_VARIABLES = {SNAPSHOTS: "enabled", SNAPSHOT_EVERY: "every", SNAPSHOT_MEMORY_LIMIT: "memory_limit"}
ETCD_VARIABLES = {ETCD_TLS: "tls", ETCD_SECRET_DIR: "secret_dir"}

#: Who sets the variables, for the "is required" message.
BY_OPERATOR = "set by the operator"
BY_AGENT = "set by `stalwart agent`"


class PodEnvError(ValueError):
    """The pod environment is incomplete or malformed; the message is ``VARIABLE: problem``, ``; ``-separated."""

    def __init__(self, problems: Sequence[str]) -> None:
        super().__init__("; ".join(problems))
        self.problems = tuple(problems)


M = TypeVar("M", bound=BaseModel)


def problems_of(error: ValidationError, variables: Mapping[str, str], set_by: str) -> list[str]:
    """``VARIABLE: problem`` for each error of a model read from ``variables`` (variable -> field)."""
    by_field = {f: var for var, f in variables.items()}
    out = []
    for err in error.errors():
        loc = str(err["loc"][0]) if err["loc"] else ""
        var = by_field.get(loc, "environment")
        if err["type"] == "missing":
            what = f"is required ({set_by})"
        elif err["type"] == "value_error" and "error" in err.get("ctx", {}):
            what = str(err["ctx"]["error"])  # our own validators' words, without pydantic's prefix
        else:
            what = err["msg"]
        if not loc and what.split(" ", 1)[0].rstrip(":") in variables:
            out.append(what)  # a check across variables, which names them itself
        else:
            out.append(f"{var}: {what}")
    return out


def try_read(model: type[M], variables: Mapping[str, str], environ: Mapping[str, str] | None, set_by: str,
             problems: list[str]) -> M | None:
    """:func:`read_env`, adding the problems to ``problems`` instead of raising (to name all at once)."""
    env = os.environ if environ is None else environ
    data = {f: env[var] for var, f in variables.items() if env.get(var, "").strip() != ""}
    try:
        return model.model_validate(data)
    except ValidationError as e:
        problems.extend(problems_of(e, variables, set_by))
        return None


def read_env(model: type[M], variables: Mapping[str, str], environ: Mapping[str, str] | None = None, *,
             set_by: str = BY_AGENT) -> M:
    """``model`` from the variables (``variables``: variable -> field; unset or empty means unset); raises
    :class:`PodEnvError` naming every bad or missing variable."""
    problems: list[str] = []
    value = try_read(model, variables, environ, set_by, problems)
    if value is None:
        raise PodEnvError(problems)
    return value


def to_env(model: BaseModel, variables: Mapping[str, str]) -> dict[str, str]:
    """The variables that :func:`read_env` reads back as ``model`` (unset fields are left out)."""
    out: dict[str, str] = {}
    for var, name in variables.items():
        value = getattr(model, name)
        if value is None:
            continue
        if isinstance(value, list):
            out[var] = ",".join(value)
        elif isinstance(value, bool):
            out[var] = "true" if value else "false"
        elif isinstance(value, SecretStr):
            out[var] = value.get_secret_value()
        else:
            out[var] = str(value)
    return out


# -- field types ---------------------------------------------------------------------------------------------

def _split(v: object) -> object:
    if isinstance(v, str):
        return [e.strip() for e in v.split(",") if e.strip()]
    return v


def _check_endpoints(v: list[str]) -> list[str]:
    for ep in v:
        host, sep, port = ep.rpartition(":")
        if not sep or not host or not port.isdigit():
            raise ValueError(f"expected comma-separated host:port, got {ep!r}")
    return v


def _check_job(v: str) -> str:
    ns, sep, name = v.partition("/")
    if not sep or not ns or not name:
        raise ValueError(f"expected <namespace>/<name>, got {v!r}")
    return v


#: ``STALWART_ETCD_ENDPOINTS``: comma-separated ``host:port``, at least one.
EtcdEndpoints = Annotated[list[str], BeforeValidator(_split), Field(min_length=1), AfterValidator(_check_endpoints)]
#: ``STALWART_JOB``: ``<namespace>/<name>``.
JobRef = Annotated[str, AfterValidator(_check_job)]
_Seconds = Annotated[float | None, Field(default=None, gt=0, allow_inf_nan=False)]


def _count(minimum: int) -> BeforeValidator:
    def check(v: object) -> object:
        if v is None or isinstance(v, int):
            return v
        raw = str(v).strip()
        try:
            value = int(raw)
        except ValueError:
            value = minimum - 1
        if value < minimum:
            raise ValueError(f"expected an integer >= {minimum}, got {raw!r}")
        return value
    return BeforeValidator(check)


def _ip(v: str | None) -> str | None:
    if v is None:
        return None
    try:
        return str(ip_address(v.strip()))
    except ValueError:
        raise ValueError(f"expected the pod's IP address (status.podIP), got {v!r}") from None


class _Env(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


# -- operator -> agent ---------------------------------------------------------------------------------------

class AgentEnvironment(_Env):
    """Where the agent's pod stands in its job: what the operator writes into every worker container."""

    job: JobRef
    job_uid: str
    node_id: str = Field(min_length=1, max_length=253)
    #: None for an agent started outside the operator (no fence record can name it).
    pod_uid: str | None = Field(default=None, min_length=1, max_length=64)
    pod_ip: str = Field(min_length=1)
    spare: bool = False
    nproc_per_node: int = Field(default=1, ge=1, le=1024)
    min_nodes: int = Field(default=1, ge=1)
    max_nodes: int = Field(default=1, ge=1)
    etcd_endpoints: EtcdEndpoints
    rpc_token: SecretStr | None = None
    #: The mounted etcd credentials Secret (stalwart.etcd.client); files, so no secret is in the environment.
    etcd_tls: bool = False
    etcd_secret_dir: str | None = None
    metrics_port: int | None = Field(default=None, ge=1, le=65535)
    fork_server: bool = True
    standby: bool = True

    @model_validator(mode="after")
    def _bounds(self) -> AgentEnvironment:
        if self.max_nodes < self.min_nodes:
            raise ValueError(f"{MAX_NODES} ({self.max_nodes}) must be >= {MIN_NODES} ({self.min_nodes})")
        return self

    @property
    def namespace(self) -> str:
        return self.job.partition("/")[0]

    def etcd_env(self) -> dict[str, str]:
        """The variables that hand the etcd credentials on to rank processes (paths, never the secrets)."""
        if self.etcd_secret_dir is None:
            return {}
        return {ETCD_TLS: "true" if self.etcd_tls else "false", ETCD_SECRET_DIR: self.etcd_secret_dir}


def worker_env(*, job: str, namespace: str, uid: str, spare: bool, nproc_per_node: int, min_nodes: int,
               max_nodes: int, endpoints: Sequence[str], token_secret: str, token_key: str,
               etcd_secret_dir: str | None = None, etcd_tls: bool = False,
               metrics_port: int | None = None) -> list[dict[str, Any]]:
    """The container ``env`` the operator writes for :class:`AgentEnvironment`: the node id, the pod's uid and
    the pod IP from the downward API, the RPC token from the job's Secret (``token_secret``/``token_key``), the etcd
    credentials' directory when a Secret is mounted there, the agent's metrics port when it serves metrics."""
    def value(name: str, v: str) -> dict[str, Any]:
        return {"name": name, "value": v}

    def field(name: str, path: str) -> dict[str, Any]:
        return {"name": name, "valueFrom": {"fieldRef": {"fieldPath": path}}}

    env = [
        value(JOB, f"{namespace}/{job}"), value(JOB_UID, uid), field(NODE_ID, "metadata.name"),
        field(POD_UID, "metadata.uid"), field(POD_IP, "status.podIP"), value(SPARE, "true" if spare else "false"),
        value(NPROC_PER_NODE, str(nproc_per_node)), value(MIN_NODES, str(min_nodes)),
        value(MAX_NODES, str(max_nodes)), value(ETCD_ENDPOINTS, ",".join(endpoints)),
        {"name": RPC_TOKEN, "valueFrom": {"secretKeyRef": {"name": token_secret, "key": token_key}}},
    ]
    if etcd_secret_dir is not None:
        env.append(value(ETCD_TLS, "true" if etcd_tls else "false"))
        env.append(value(ETCD_SECRET_DIR, etcd_secret_dir))
    if metrics_port is not None:
        env.append(value(METRICS_PORT, str(metrics_port)))
    return env


# -- agent -> rank process -----------------------------------------------------------------------------------

class RankEnvironment(_Env):
    """The rank process's place in the job: which etcd, which job, which round (epoch), which slot. The last four
    carry the TrainingJob's ``restartPolicy.inProcess`` settings when the job has a record in etcd (a job of the
    operator); the restart wrapper uses them for the options its decorator leaves out."""

    etcd_endpoints: EtcdEndpoints
    job: JobRef
    job_uid: str
    node_id: str = Field(min_length=1)
    epoch: int = Field(ge=1)
    slot: int = Field(ge=0)
    slots: int = Field(ge=1)
    target_world: int = Field(ge=1)
    #: The job's fewest ranks (``minReplicas`` x ``nprocPerNode``): no restart iteration runs with fewer.
    min_world: int | None = Field(default=None, ge=1)
    spare: bool = False
    status_file: str | None = None
    local_rank: int = Field(default=0, ge=0)
    max_restarts: int | None = Field(default=None, ge=0)
    soft_timeout: _Seconds = None
    hard_timeout: _Seconds = None
    barrier_timeout: _Seconds = None
    #: Where the pod's agent relays the ranks' barrier requests to etcd together; none: each rank goes itself.
    relay_socket: str | None = None

    @model_validator(mode="after")
    def _consistent(self) -> RankEnvironment:
        if self.slot >= self.slots:
            raise ValueError(f"{SLOT} {self.slot} must be below {SLOTS} {self.slots}")
        if self.target_world > self.slots:
            raise ValueError(f"{TARGET_WORLD} {self.target_world} exceeds {SLOTS} {self.slots}")
        if self.min_world is not None and self.min_world > self.target_world:
            raise ValueError(f"{MIN_WORLD} {self.min_world} exceeds {TARGET_WORLD} {self.target_world}")
        problem = order_problem(lambda setting: getattr(self, setting.option), lambda setting: setting.env)
        if problem is not None:
            raise ValueError(f"{problem[0]}: {problem[1]}")
        return self

    @property
    def namespace(self) -> str:
        return self.job.partition("/")[0]

    def job_settings(self) -> dict[str, float | int]:
        """The job's in-process restart settings that the agent passed, by RestartConfig option name."""
        settings = {setting.option: getattr(self, setting.option) for setting in RESTART_SETTINGS}
        return {name: value for name, value in settings.items() if value is not None}

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> Self:
        """Read the variables; raises :class:`PodEnvError` naming each bad or missing one."""
        return read_env(cls, RANK_VARIABLES, environ)

    def to_env(self) -> dict[str, str]:
        """The variables that reproduce this environment (the agent uses this to launch ranks)."""
        return to_env(self, RANK_VARIABLES)


class SnapshotEnvironment(_Env):
    """The job's peer-snapshot policy as its ranks read it; every variable unset (a plain torchrun rank): no
    policy, the training function's own arguments alone."""

    enabled: bool = True
    every: int | None = Field(default=None, ge=1)
    #: Bytes.
    memory_limit: int | None = Field(default=None, ge=1)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> Self:
        """Read the variables; raises :class:`PodEnvError` naming each bad one."""
        return read_env(cls, SNAPSHOT_VARIABLES, environ)

    def to_env(self) -> dict[str, str]:
        return to_env(self, SNAPSHOT_VARIABLES)


class TorchrunEnvironment(_Env):
    """The variables torchrun gives a rank, which the agent gives each rank process of a round."""

    rank: int = Field(ge=0)
    local_rank: int = Field(ge=0)
    world_size: int = Field(ge=1)
    local_world_size: int = Field(ge=1)
    group_rank: int = Field(ge=0)
    role_rank: int = Field(ge=0)
    role_world_size: int = Field(ge=1)
    master_addr: str = Field(min_length=1)
    master_port: int = Field(ge=1, le=65535)
    restart_count: int = Field(ge=0)
    run_id: str

    def to_env(self) -> dict[str, str]:
        return to_env(self, TORCHRUN_VARIABLES)


class RpcVariables(_Env):
    """What ``init_rpc()`` with no arguments reads besides :class:`RankEnvironment`: the rank and world size
    (torchrun's), where the RPC server listens (the pod's IP, the downward API's ``status.podIP``) and the job's
    RPC token (from its Secret). Each is ``None`` when unset; whoever needs one says so."""

    rank: Annotated[int | None, _count(0)] = None
    world_size: Annotated[int | None, _count(1)] = None
    pod_ip: Annotated[str | None, AfterValidator(_ip)] = None
    rpc_token: SecretStr | None = None


class EtcdSecretMount(_Env):
    """Where a process finds its etcd credentials: the directory of the mounted Secret (files, never values in
    the environment) and whether etcd speaks TLS. Neither set means plaintext and no login."""

    tls: bool = False
    secret_dir: str | None = None

    @model_validator(mode="after")
    def _dir_with_tls(self) -> EtcdSecretMount:
        if self.tls and not self.secret_dir:
            raise ValueError(f"{ETCD_SECRET_DIR}: required when {ETCD_TLS} is true")
        return self

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> Self:
        return read_env(cls, ETCD_VARIABLES, environ)

    def to_env(self) -> dict[str, str]:
        return to_env(self, ETCD_VARIABLES)
