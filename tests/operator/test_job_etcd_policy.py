"""Finding 1 of issue 31: a TrainingJob cannot make the operator log in with a Secret at a host the job names.

The attack: a job sets ``spec.rendezvous.endpoints`` to a host of its own and ``secretRef`` to some Secret of its
namespace holding ``username``/``password``. Before the fix the operator read that Secret with its own rights
and logged in with it there, in plaintext, on every resync. Now the job fails with ``InvalidSpec`` naming
``spec.rendezvous.endpoints`` and one Event, and nothing reaches that host: a bare TCP server in the test
records every connection and byte.
"""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
from test_operator_cluster import Jobs, OperatorFactory, job_body, wait_for

from stalwart.operator.etcd_access import EtcdAccess
from stalwart.operator.etcd_policy import ENDPOINTS_FIELD, etcd_refusal, same_endpoints
from stalwart.operator.observe import job_view
from stalwart.operator.runner import OperatorContext, etcd_target


class Recorder:
    """A TCP server that accepts and records what arrives (and answers nothing)."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.endpoint = f"127.0.0.1:{self.sock.getsockname()[1]}"
        self.received = bytearray()
        self.connections = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        self.sock.settimeout(0.1)
        while not self._stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except OSError:
                continue
            self.connections += 1
            conn.settimeout(0.2)
            with conn:
                while not self._stop.is_set():
                    try:
                        data = conn.recv(65536)
                    except OSError:
                        continue
                    if not data:
                        break
                    self.received += data

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)
        self.sock.close()


@pytest.fixture
def fake_etcd() -> Iterator[Recorder]:
    r = Recorder()
    yield r
    r.close()


@pytest.mark.parametrize(("job", "default", "refused"), [
    (None, ["etcd:2379"], False),
    ([], ["etcd:2379"], False),
    (["etcd:2379"], ["etcd:2379"], False),
    (["https://etcd:2379"], ["etcd:2379"], False),
    (["b:1", "a:1"], ["a:1", "b:1"], False),
    (["evil.example:2379"], ["etcd:2379"], True),
    (["etcd:2379", "evil.example:2379"], ["etcd:2379"], True),
    (["etcd:2379"], [], True),
])
def test_etcd_refusal(job: list[str] | None, default: list[str], refused: bool) -> None:
    result = etcd_refusal(job, default)
    assert (result is not None) is refused
    if result is not None:
        assert result[0] == ENDPOINTS_FIELD and "never with a job's Secret" in result[1]
    assert same_endpoints(["a:1"], ["http://a:1/"]) and not same_endpoints([], [])


def test_a_job_naming_its_own_etcd_and_someone_elses_secret_is_refused_and_nothing_is_sent(
        start_operator: OperatorFactory, jobs: Jobs, fake_etcd: Recorder) -> None:
    start_operator(jobs.ns, agent_command=())
    jobs.core.create_namespaced_secret(jobs.ns, {"metadata": {"name": "database-login"},
                                                 "stringData": {"username": "dba", "password": "db-s3cret"}})
    body = job_body("exfil", replicas=1, command=["sleep", "60"])
    body["spec"]["rendezvous"] = {"endpoints": [fake_etcd.endpoint], "secretRef": {"name": "database-login"}}
    jobs.create(body)

    def failed() -> dict[str, Any] | None:
        st = jobs.status("exfil")
        return next((c for c in st.get("conditions") or [] if c.get("type") == "Failed"
                     and st.get("phase") == "Failed"), None)

    condition = wait_for("the job to fail with InvalidSpec", failed, timeout=60)
    assert condition["reason"] == "InvalidSpec"
    assert condition["message"].startswith(f"{ENDPOINTS_FIELD}: {fake_etcd.endpoint} is not the etcd")
    wait_for("the InvalidSpec Event", lambda: "InvalidSpec" in jobs.events("exfil"), timeout=30)
    time.sleep(2.0)  # a few resyncs' worth: still nothing
    assert jobs.pods("exfil") == []
    assert fake_etcd.connections == 0 and bytes(fake_etcd.received) == b""


class _NoSecrets:
    """A Kube that fails the test if the operator reads any Secret."""

    reads: list[str] = []

    async def get_secret_data(self, namespace: str, name: str, **_: Any) -> dict[str, bytes]:
        self.reads.append(name)
        raise AssertionError(f"the operator read Secret {namespace}/{name}")


def test_the_operator_never_reads_the_secret_a_job_names() -> None:
    body = job_body("creds", replicas=1, command=["sleep", "60"])
    body["metadata"].update(namespace="ns", uid="u-1", generation=1)
    kube: Any = _NoSecrets()
    ctx = OperatorContext(kube=kube, etcd=EtcdAccess(), default_endpoints=("default:2379",))
    body["spec"]["rendezvous"] = {"endpoints": ["default:2379"], "tls": True, "secretRef": {"name": "etcd-creds"}}
    own = asyncio.run(etcd_target(ctx, "ns", job_view(body)))
    assert own is not None and own.endpoints == ("default:2379",) and own.credentials == ctx.default_credentials
    body["spec"]["rendezvous"] = {"endpoints": ["etcd.example:2379"], "secretRef": {"name": "etcd-creds"}}
    assert asyncio.run(etcd_target(ctx, "ns", job_view(body))) is None
    assert kube.reads == []
