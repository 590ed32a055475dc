"""Finding 1 of issue 31: a TrainingJob cannot make the operator log in with a Secret at a host the job names.

The attack: a job sets ``spec.rendezvous.endpoints`` to a host of its own and ``secretRef`` to some Secret of its
namespace holding ``username``/``password``. Before the fix the operator read that Secret with its own rights
and logged in with it there, in plaintext, on every resync. Now the job fails with ``InvalidSpec`` naming
``spec.rendezvous.endpoints`` and one Event, and nothing reaches that host: a bare TCP server in the test
records every connection and byte.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest
from recording_server import Recorder
from test_operator_cluster import Jobs, OperatorFactory, job_body, wait_for

from stalwart.operator.etcd_access import EtcdAccess
from stalwart.operator.etcd_policy import ENDPOINTS_FIELD, etcd_refusal, same_endpoints
from stalwart.operator.observe import job_view
from stalwart.operator.runner import OperatorContext, etcd_target


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
