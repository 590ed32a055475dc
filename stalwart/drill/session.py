"""The shell of ``stalwart drill``: inject faults into a running TrainingJob and watch it recover.

Pod faults go through the Kubernetes API (delete, or force delete with no grace period). Rank faults go through
the job's agents: a :class:`~stalwart.api.drill.DrillRequest` signed with the job's token (read from the job's
Secret, as the user's own credentials allow) is written to the job's etcd prefix; the agent of the target pod
checks it and carries it out, or refuses it (the job must opt in with ``spec.faultInjection.enabled``).

After each fault the drill waits for the next completed step, then for the status to settle, and records one
:class:`~stalwart.drill.core.Row`. Every wait has a deadline.
"""

from __future__ import annotations

import base64
import secrets
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, TextIO

from pydantic import ValidationError

from stalwart.api import naming
from stalwart.api.base import positive_seconds
from stalwart.api.drill import AGENT_KINDS, DrillRequest, DrillResult
from stalwart.api.manifest import decode_manifest
from stalwart.api.recovery import RecoveryPhases, from_records
from stalwart.api.rendezvous import Manifest
from stalwart.api.restart import ProgressRecord
from stalwart.api.trainingjob import GROUP, PLURAL, VERSION
from stalwart.drill.core import (
    HEADER,
    PARTITION_KINDS,
    RankPoint,
    Recovery,
    Row,
    cut_of,
    format_phases,
    format_row,
    partition_targets,
    points,
    recovery,
    standing,
    status_summary,
    table_line,
    went_on,
)
from stalwart.drill.login import drill_credentials
from stalwart.etcd.client import CredentialsError, connect
from stalwart.etcd.keys import MANIFEST, JobKeys
from stalwart.etcd.store import Store, StoreError

__all__ = ["DrillError", "DrillOptions", "DrillSession", "Partitioner", "Refused"]

JSON = dict[str, Any]
#: Validity of a request and the lease its key is bound to (seconds).
REQUEST_TTL = 120


class DrillError(RuntimeError):
    """The drill cannot go on (the message says why); the CLI exits 2."""


class Refused(DrillError):
    """An agent refused a request (its answer says why)."""


class Partitioner(Protocol):
    """Cuts a node's network while its processes run on, and heals it (a ``stalwart local`` cluster with a
    network per node, adapted by the CLI). Either raises :class:`DrillError` naming what is wrong."""

    def partition(self, node: str, from_: list[str] | None = None) -> list[str]: ...

    def heal(self, node: str) -> str: ...


@dataclass(frozen=True)
class DrillOptions:
    """``timeout``: seconds a fault may take to recover; ``settle``: seconds the status may take to say so
    afterwards; ``ready_timeout``: seconds to wait for the job to run before the first fault; ``heal_after``:
    seconds a partition kind holds its cut."""

    timeout: float = 300.0
    heal_after: float = 10.0
    settle: float = 30.0
    ready_timeout: float = 300.0
    poll: float = 0.2
    #: Seconds between the progress lines said while a fault has not recovered yet.
    progress_every: float = 15.0

    def __post_init__(self) -> None:
        for name in ("timeout", "settle", "ready_timeout", "poll", "progress_every", "heal_after"):
            positive_seconds(f"--{name.replace('_', '-')}", getattr(self, name))


@dataclass
class DrillSession:
    """One drill against ``namespace/job``. ``api`` is a configured ``kubernetes.client.ApiClient``;
    ``etcd_endpoints`` the job's etcd (default: its spec's)."""

    api: Any
    namespace: str
    job: str
    etcd_endpoints: Sequence[str] = ()
    options: DrillOptions = field(default_factory=DrillOptions)
    out: TextIO = sys.stdout
    #: Where the drill says what it waits for (the table goes to ``out``).
    progress: TextIO = sys.stderr
    clock: Callable[[], float] = time.time
    store: Store | None = None
    uid: str = ""
    token: bytes = b""
    #: Speak TLS to etcd even when the job does not say so (``--etcd-tls``).
    etcd_tls: bool = False
    #: What carries out the partition kinds (``--local-dir``); None: they are refused.
    partitioner: Partitioner | None = None

    def __post_init__(self) -> None:
        from kubernetes import client

        self.core: Any = client.CoreV1Api(self.api)
        self.custom: Any = client.CustomObjectsApi(self.api)

    # -- connecting ------------------------------------------------------------------------------------------

    def connect(self) -> None:
        body = self.get_job()
        if not body:
            raise DrillError(f"trainingjob {self.namespace}/{self.job} not found")
        self.uid = str(body["metadata"]["uid"])
        spec = body.get("spec") or {}
        endpoints = list(self.etcd_endpoints) or list((spec.get("rendezvous") or {}).get("endpoints") or [])
        if not endpoints:
            raise DrillError("--etcd-endpoints: the job names no etcd endpoints (spec.rendezvous.endpoints); give "
                             "the etcd the operator uses (or set STALWART_ETCD_ENDPOINTS)")
        # The job's own login (its secretRef, else the Secret the operator made for it), through the one connect
        # path: TLS asked and no ca.crt is an error naming the key, never plaintext.
        ref = (spec.get("rendezvous") or {}).get("secretRef")
        secret_name = ref["name"] if ref else naming.secret_name(self.job)
        try:
            creds = drill_credentials(spec, endpoints, secret_name, self.secret_data(secret_name),
                                      force_tls=self.etcd_tls)
            self.store = connect(endpoints, creds, timeout=5.0, probe=JobKeys(self.namespace, self.uid).prefix)
        except CredentialsError as e:
            raise DrillError(f"etcd credentials: {e}") from None
        except StoreError as e:
            raise DrillError(f"etcd {','.join(endpoints)}: {e}") from None
        self.token = self.secret_data(naming.secret_name(self.job)).get(naming.RPC_TOKEN_KEY, b"")

    def close(self) -> None:
        if self.store is not None:
            self.store.close()

    def secret_data(self, name: str) -> dict[str, bytes]:
        from kubernetes.client.exceptions import ApiException

        try:
            secret = self.core.read_namespaced_secret(name, self.namespace)
        except ApiException as e:
            raise DrillError(f"cannot read Secret {self.namespace}/{name}: {e.status} {e.reason}") from None
        return {k: base64.b64decode(v) for k, v in (secret.data or {}).items()}

    # -- observing -------------------------------------------------------------------------------------------

    @property
    def keys(self) -> JobKeys:
        return JobKeys(self.namespace, self.uid)

    def get_job(self) -> JSON:
        from kubernetes.client.exceptions import ApiException

        try:
            got: JSON = self.custom.get_namespaced_custom_object(GROUP, VERSION, self.namespace, PLURAL, self.job)
        except ApiException as e:
            if e.status == 404:
                return {}
            raise
        return got

    def status(self) -> JSON:
        st: JSON = self.get_job().get("status") or {}
        return st

    def _store(self) -> Store:
        if self.store is None:
            raise DrillError("not connected")
        return self.store

    def records(self) -> list[ProgressRecord]:
        kvs, _ = self._store().get_prefix(self.keys.progress)
        out = []
        for kv in kvs:
            try:
                out.append(ProgressRecord.from_json_bytes(kv.value))
            except (ValidationError, ValueError):
                continue
        return out

    def manifest(self) -> Manifest | None:
        # One read of the header and its parts (a large manifest's keys share the prefix "manifest").
        rdzv = self.keys.rendezvous
        kvs, _ = self._store().get_prefix(self.keys.manifest)
        found = {kv.key[len(rdzv):]: (kv.value, kv.mod_revision) for kv in kvs}
        header = found.get(MANIFEST)
        return decode_manifest(header[0], header[1], found) if header is not None else None

    def current_points(self) -> list[RankPoint]:
        """The ranks of the current round as their agents last reported them."""
        manifest = self.manifest()
        if manifest is None:
            return []
        return [p for p in points(self.records()) if p.round == manifest.round]

    def job_pods(self) -> dict[str, str | None]:
        """The job's pods that are not being deleted, each with its node."""
        pods = self.core.list_namespaced_pod(self.namespace, label_selector=f"{naming.LABEL_JOB_NAME}={self.job}")
        return {p.metadata.name: p.spec.node_name for p in pods.items if p.metadata.deletion_timestamp is None}

    def wait_running(self, timeout: float) -> JSON:
        """Until the job is Running with a rank in its training function (DrillError when it ends)."""
        deadline = time.monotonic() + timeout
        while True:
            st = self.status()
            if st.get("phase") in ("Succeeded", "Failed"):
                raise DrillError(f"the job is {st['phase']}")
            if st.get("phase") == "Running" and any(p.state == "running" for p in self.current_points()):
                return st
            if time.monotonic() > deadline:
                raise DrillError(f"the job was not Running within {timeout:g}s (it is {st.get('phase')})")
            time.sleep(self.options.poll)

    # -- injecting -------------------------------------------------------------------------------------------

    def pod_fault(self, kind: str, pod: str) -> None:
        from kubernetes import client

        grace = 0 if kind == "pod-force-delete" else None
        body = client.V1DeleteOptions(grace_period_seconds=grace)
        self.core.delete_namespaced_pod(pod, self.namespace, body=body, grace_period_seconds=grace)

    def agent_fault(self, kind: str, node: str, local_rank: int, *, token: bytes | None = None) -> DrillResult:
        """Ask ``node``'s agent for ``kind`` on ``local_rank``; its answer (Refused if it refused)."""
        now = self.clock()
        req = DrillRequest(id=secrets.token_hex(16), job_uid=self.uid, node_id=node, local_rank=local_rank,
                           kind=kind, issued=now, expires=now + REQUEST_TTL)
        req = req.signed(self.token if token is None else token)
        store = self._store()
        lease = store.lease_grant(REQUEST_TTL, keepalive=False)
        store.put(self.keys.drill_request(req.id), req.to_json_bytes(), lease=lease)
        deadline = time.monotonic() + 30.0
        key = self.keys.drill_result(req.id)
        while time.monotonic() < deadline:
            kv = store.get(key)
            if kv is not None:
                result = DrillResult.from_json_bytes(kv.value)
                if not result.accepted:
                    raise Refused(f"{node} refused {kind}: {result.reason}")
                return result
            time.sleep(self.options.poll)
        raise DrillError(f"no answer from the agent of {node} within 30s (is it running?)")

    # -- one fault ---------------------------------------------------------------------------------------------

    def inject(self, index: int, kind: str, pick: Callable[[Sequence[Any]], Any]) -> Row:
        """Inject one fault of ``kind`` (``pick`` chooses the target), wait for the recovery, return its row."""
        self.wait_running(self.options.ready_timeout)
        recoveries = _recoveries(self.status())
        healed_at: float | None = None
        pts = self.current_points()
        before, step_before = standing(pts)
        if kind in AGENT_KINDS:
            running = sorted((p for p in pts if p.state == "running"), key=lambda p: (p.node, p.local_rank))
            if not running:
                raise DrillError("no rank is in its training function to inject into")
            target = pick(running)
            injected_at = self.clock()
            result = self.agent_fault(kind, target.node, target.local_rank)
            what = f"rank {result.rank if result.rank is not None else target.rank} ({target.node})"
        elif kind in PARTITION_KINDS:
            injected_at, healed_at, what = self.partition_fault(index, kind, pick)
        else:
            manifest = self.manifest()
            members = sorted(m.node_id for m in manifest.members) if manifest else []
            if not members:
                raise DrillError("the job has no rendezvous round to take a pod from")
            pod = pick(members)
            injected_at = self.clock()
            self.pod_fault(kind, pod)
            what = pod
        self.tell(f"fault {index} ({kind}) on {what}: waiting for the next completed step "
                  f"(at most {self.options.timeout:g}s)")
        rec = self.wait_recovered(before, injected_at, step_before, healed_at)
        if rec is None:
            return Row(index, kind, what, None, status_summary(self.status()),
                       note=f"not within {self.options.timeout:g}s")
        if healed_at is not None and standing(self.current_points())[0] <= before:
            return Row(index, kind, what, rec, status_summary(self.status()))  # waited out: nothing to count
        phases = self.wait_phases(injected_at)
        return Row(index, kind, what, rec, self.settled_status(recoveries), phases=phases)

    def wait_phases(self, injected_at: float) -> RecoveryPhases | None:
        """The phases of the recovery once every rank of the new world reported its first step and its marks
        (agents publish about every second), or None after ``settle`` seconds."""
        deadline = time.monotonic() + self.options.settle
        while True:
            try:
                found = from_records(self.records(), injected_at)
            except StoreError:
                found = None
            if found is not None or time.monotonic() > deadline:
                return found
            time.sleep(self.options.poll)

    def partition_fault(self, index: int, kind: str, pick: Callable[[Sequence[Any]], Any]) -> tuple[float, float, str]:
        """Cut the node of a member alone on it as ``kind`` says, hold the cut ``heal_after`` seconds, heal it;
        the times of the cut and the heal, and the target's description."""
        if self.partitioner is None:
            raise DrillError(f"--local-dir: {kind} cuts a node's network on a `stalwart local` cluster; give its "
                             "directory")
        manifest = self.manifest()
        members = sorted(m.node_id for m in manifest.members) if manifest else []
        pods = self.job_pods()
        targets = [t for t in partition_targets(members, pods, sorted(pods))
                   if kind != "partition-peer" or t[2] is not None]
        if not targets:
            raise DrillError(f"{kind}: no member of the round runs alone on its node with another member elsewhere "
                             f"(nodes: {pods}); a cut would take more than the one pod")
        pod, node, peer = pick(targets)
        cut = cut_of(kind, peer)
        injected_at = self.clock()
        self.partitioner.partition(node, cut)
        try:
            self.tell(f"fault {index} ({kind}): node {node} of {pod} cut from "
                      f"{'everything' if cut is None else ', '.join(cut)}; healed in {self.options.heal_after:g}s")
            time.sleep(self.options.heal_after)
        finally:
            self.partitioner.heal(node)
        return injected_at, self.clock(), f"{pod} ({node})"

    def wait_recovered(self, before: tuple[int, int], injected_at: float, step_before: int,
                       healed_at: float | None = None) -> Recovery | None:
        """The recovery once the ranks report it (:func:`.core.recovery`; after a cut healed at ``healed_at``,
        :func:`.core.went_on`), None after ``timeout`` or once the job failed."""
        began = time.monotonic()
        deadline, next_word = began + self.options.timeout, began + self.options.progress_every
        best = step_before
        while time.monotonic() < deadline:
            if time.monotonic() >= next_word:
                next_word += self.options.progress_every
                self.tell(f"  still waiting: {time.monotonic() - began:.0f}s since the fault, "
                          f"phase {self.status().get('phase')}")
            try:
                pts = points(self.records())
            except StoreError:
                time.sleep(self.options.poll)
                continue
            # Steps a rank completed after the injection but still before the fault took hold count as done
            # (reports of the fault's round only: those of pods gone in earlier rounds are history).
            # After a cut, a step at or after the heal is the recovery itself, not a step done before the fault.
            best = max([best, *(p.step for p in pts if p.round == before[0] and p.position <= before
                                and p.step is not None and (healed_at is None or (p.step_time or 0.0) < healed_at))])
            found = (recovery(pts, before, injected_at, best) if healed_at is None
                     else went_on(pts, before, injected_at, best, healed_at))
            if found is not None:
                return found
            if self.status().get("phase") == "Failed":
                return None
            time.sleep(self.options.poll)
        return None

    def settled_status(self, recoveries_before: int) -> str:
        """The status once it says Running again with the recovery counted (or whatever it says after ``settle``
        seconds: the drill shows what the status said, it does not judge it)."""
        deadline = time.monotonic() + self.options.settle
        while True:
            st = self.status()
            if st.get("phase") in ("Succeeded", "Failed") or (
                    st.get("phase") == "Running" and _recoveries(st) > recoveries_before):
                return status_summary(st)
            if time.monotonic() > deadline:
                return status_summary(st)
            time.sleep(self.options.poll)

    def say(self, text: str) -> None:
        print(text, file=self.out, flush=True)

    def tell(self, text: str) -> None:
        """A progress line (what the drill waits for), apart from the table."""
        print(text, file=self.progress, flush=True)

    def run(self, kinds: Sequence[str], seed: int) -> list[Row]:
        """Inject one fault per entry of ``kinds`` (targets drawn with ``seed``), printing each row as it ends."""
        import random

        rng = random.Random(seed)
        rows: list[Row] = []
        self.say(table_line(HEADER))
        for i, kind in enumerate(kinds, start=1):
            row = self.inject(i, kind, lambda xs: xs[rng.randrange(len(xs))])
            rows.append(row)
            self.say(format_row(row))
            if row.phases is not None:
                self.say(format_phases(row.phases))
            if row.recovery is None:
                break
        return rows


def _recoveries(status: JSON) -> int:
    restarts = status.get("restarts") or {}
    return int(restarts.get("inProcess", 0)) + int(restarts.get("processRestarts", 0))
