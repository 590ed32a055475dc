"""The etcd key layout: every key of a job lives under ``/stalwart/v1/<namespace>/<job-uid>/``.

One prefix per job means a job can be listed, watched and deleted as a unit (the operator's finalizer deletes
the prefix and nothing else). Each part of stalwart keeps its keys in its own sub-prefix, named here so that
no two parts can collide.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

ROOT = "/stalwart/v1/"

# The rendezvous' keys, relative to ``JobKeys.rendezvous``: one key per node under NODES, the sealed round's
# MANIFEST (its mod_revision is the round's epoch, the fencing token), a re-rendezvous REQUEST, the CLOSED
# flag, the operator's EXPECTED nodes and the SEALER's claim.
NODES = "nodes/"
MANIFEST = "manifest"
REQUEST = "request"
CLOSED = "closed"
EXPECTED = "expected"
SEALER = "sealer"
#: Fence records of pods the operator fenced, by pod uid (JobKeys.fenced).
FENCED = "fenced/"

# In-process restart's keys, relative to one round's restart prefix (``RestartKeys.base``): a live process's
# ALIVE key (bound to its lease), its ARRIVE at an iteration's barrier (bound to its lease), the iteration's
# SEAL, the FAULT records of an iteration, the DONE marks of its completion barrier and its END (written by the
# process whose mark completed it).
ALIVE = "alive/"
ARRIVE = "arrive/"
SEAL = "seal/"
FAULT = "fault/"
DONE = "done/"
END = "end/"

_SEGMENT = re.compile(r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$")


def _check_segment(what: str, value: str) -> str:
    if not _SEGMENT.fullmatch(value) or len(value) > 253:
        raise ValueError(f"{what}: {value!r} is not a DNS-1123 name (lower case letters, digits, '-', '.')")
    return value


@dataclass(frozen=True, slots=True)
class JobKeys:
    """Key names for one job. ``namespace`` and ``uid`` are the TrainingJob's."""

    namespace: str
    uid: str

    def __post_init__(self) -> None:
        _check_segment("namespace", self.namespace)
        _check_segment("uid", self.uid)

    @property
    def prefix(self) -> str:
        return f"{ROOT}{self.namespace}/{self.uid}/"

    @property
    def job(self) -> str:
        """The operator's record of the job for its agents (expected members, bounds, timeouts)."""
        return self.prefix + "job"

    @property
    def rendezvous(self) -> str:
        """Sub-prefix of the node rendezvous (node keys, manifest, close flag)."""
        return self.prefix + "rdzv/"

    def node(self, node_id: str) -> str:
        """A node's lease-bound key in the rendezvous."""
        return self.rendezvous + NODES + node_id

    @property
    def manifest(self) -> str:
        """The sealed round's manifest; its mod_revision is the round's epoch."""
        return self.rendezvous + MANIFEST

    @property
    def closed(self) -> str:
        """The rendezvous' close flag."""
        return self.rendezvous + CLOSED

    @property
    def expected(self) -> str:
        """The node ids the operator expects in a round."""
        return self.rendezvous + EXPECTED

    def fenced(self, pod_uid: str) -> str:
        """The fence record of the pod (incarnation) ``pod_uid``: written by the operator when it fences the pod,
        compared (absent) by that pod's agent whenever it registers in the rendezvous."""
        return self.prefix + FENCED + _check_segment("pod uid", pod_uid)

    @property
    def restart(self) -> str:
        """Sub-prefix of in-process restart coordination (faults, barriers), fenced by epoch."""
        return self.prefix + "restart/"

    def restart_round(self, epoch: int) -> RestartKeys:
        """The keys of in-process restart in the round of ``epoch``."""
        return RestartKeys(f"{self.restart}{epoch}/", self.torch_store(epoch))

    @property
    def progress(self) -> str:
        """Sub-prefix of progress reports, one key per node, read by the operator."""
        return self.prefix + "progress/"

    def progress_of(self, node_id: str) -> str:
        """A node's progress report."""
        return self.progress + node_id

    def torch_store(self, epoch: int) -> str:
        """Sub-prefix of the torch.distributed Store of one round (epoch)."""
        return f"{self.prefix}store/{epoch}/"

    @property
    def drill(self) -> str:
        """Sub-prefix of fault drills: signed requests for the agents and their answers."""
        return self.prefix + "drill/"

    @property
    def drill_requests(self) -> str:
        """Sub-prefix of the signed drill requests the agents watch."""
        return self.drill + "requests/"

    def drill_request(self, request_id: str) -> str:
        return self.drill_requests + request_id

    def drill_result(self, request_id: str) -> str:
        """The answer to a drill request (carried out, or refused and why)."""
        return self.drill + "results/" + request_id

    @property
    def rpc(self) -> str:
        """Sub-prefix of the RPC layer (worker addresses)."""
        return self.prefix + "rpc/"

    @property
    def rpc_workers(self) -> str:
        """Sub-prefix of the RPC workers' address records, one per worker name."""
        return self.rpc + "workers/"


@dataclass(frozen=True, slots=True)
class RestartKeys:
    """The keys of in-process restart in one round: ``base`` is ``JobKeys.restart + "<epoch>/"``, ``torch_store``
    the round's torch.distributed Store prefix (each iteration's group bootstraps under ``"<iteration>/"``).
    The records they hold are :mod:`stalwart.api.restart`'s."""

    base: str
    torch_store: str

    def alive(self, slot: int) -> str:
        return f"{self.base}{ALIVE}{slot}"

    def arrival(self, iteration: int, slot: int) -> str:
        return f"{self.base}{ARRIVE}{iteration}/{slot}"

    def seal(self, iteration: int) -> str:
        return f"{self.base}{SEAL}{iteration}"

    def fault(self, iteration: int, slot: int) -> str:
        return f"{self.base}{FAULT}{iteration}/{slot}"

    def done(self, iteration: int, slot: int) -> str:
        return f"{self.base}{DONE}{iteration}/{slot}"

    def end(self, iteration: int) -> str:
        return f"{self.base}{END}{iteration}"

    def of_iteration(self, kind: str, iteration: int) -> str:
        """The prefix of the ``kind`` (ARRIVE, FAULT or DONE) keys of ``iteration``."""
        return f"{self.base}{kind}{iteration}/"

    def torch_store_of(self, iteration: int) -> str:
        """The prefix of the torch Store keys of ``iteration``'s process groups."""
        return f"{self.torch_store}{iteration}/"
