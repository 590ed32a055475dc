"""A whole job on the local cluster against an etcd that speaks TLS only and has authentication on: the
operator, logged in as an etcd administrator, gives the job an etcd user of its own; the job's agents and rank
processes log in as that user from the Secret mounted into their pods, meet (rendezvous), survive a fault with
an in-process restart and call each other over RPC. The job's user can touch nothing outside its prefix, and
goes with the job."""

from __future__ import annotations

import base64
import json
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from test_operator_cluster import Jobs, OperatorFactory, job_body, phase_is, wait_for

from stalwart.api import naming
from stalwart.etcd.admin import job_user_name
from stalwart.etcd.client import connect
from stalwart.etcd.keys import JobKeys
from stalwart.etcd.store import StorePermissionDenied, StoreSecurityError
from stalwart.local.cluster import LocalCluster
from stalwart.local.etcd import EtcdServer

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
#: Two ranks: init_rpc() from the environment, rank 1 fails the first iteration of a restartable function,
#: both re-run it in process, calling each other over RPC (tests/rpc/test_rpc_from_env.py, run as a script).
RANK_SCRIPT = REPO / "tests" / "rpc" / "test_rpc_from_env.py"


@pytest.fixture(scope="module")
def secure_etcd(local_cluster: LocalCluster, secure_etcd: EtcdServer,
                tmp_path_factory: pytest.TempPathFactory) -> Iterator[EtcdServer]:
    """The session's TLS etcd where the pods share the machine's loopback; with a network per node, where pods
    cannot reach 127.0.0.1 of the machine, one like it on the cluster's bridge address, as an etcd outside the
    cluster is reached at an address of its own."""
    if local_cluster.network.get("mode") != "netns":
        yield secure_etcd
        return
    server = EtcdServer(tmp_path_factory.mktemp("etcd-secure-bridge"), host=local_cluster.network["bridge_ip"],
                        tls=True, auth=True, auth_token_ttl=3)
    server.start()
    process = server.process
    yield server
    server.cleanup()
    assert process is not None and process.poll() is not None


def test_a_whole_job_runs_against_a_secured_etcd_with_its_own_user(
        start_operator: OperatorFactory, jobs: Jobs, secure_etcd: EtcdServer, tmp_path: Path) -> None:
    start_operator(jobs.ns, default_endpoints=(secure_etcd.endpoint,), etcd_credentials=secure_etcd.credentials(),
                   job_etcd_users=True, job_client=secure_etcd.job_client())
    created = jobs.create(job_body("secure", replicas=2, command=[sys.executable, str(RANK_SCRIPT),
                                                                  str(tmp_path), "--restart"]))
    keys = JobKeys(jobs.ns, created["metadata"]["uid"])

    pods = wait_for("two pods", lambda: len(jobs.pods("secure")) == 2 and jobs.pods("secure"))
    container = pods[0].spec.containers[0]
    env = {e.name: e.value for e in container.env}
    assert env["STALWART_ETCD_TLS"] == "true" and env["STALWART_ETCD_SECRET_DIR"] == "/etc/stalwart/etcd"
    assert [m.mount_path for m in container.volume_mounts] == ["/etc/stalwart/etcd", "/dev/shm"]
    secret = jobs.core.read_namespaced_secret(naming.secret_name("secure"), jobs.ns).data
    user = base64.b64decode(secret["username"]).decode()
    password = base64.b64decode(secret["password"]).decode()
    assert user == job_user_name(keys) and len(password) >= 24 and {"ca.crt", "tls.crt", "tls.key"} <= set(secret)
    job_client = secure_etcd.job_client()  # the jobs' certificate, never the operator's (issue 31, finding 3)
    assert job_client is not None and base64.b64decode(secret["tls.crt"]) == job_client.cert
    assert base64.b64decode(secret["tls.crt"]) != secure_etcd.credentials().client_cert
    assert all(password not in str(v) for v in env.values())

    st = wait_for("Succeeded", phase_is(jobs, "secure", "Succeeded", "Failed"), timeout=300)
    assert st["phase"] == "Succeeded", st
    results = {r: json.loads((tmp_path / f"rank-{r}.json").read_text()) for r in (0, 1)}
    for rank, r in results.items():
        assert r["iteration"] >= 1, r  # the fault of iteration 0 was restarted in process
        assert r["peer"]["pid"] == r["before"]["pid"] == results[1 - rank]["pid"]  # RPC to the same process
        assert r["kept"] == {"made_by": f"worker{1 - rank}", "for": f"worker{rank}"} and r["clean"], r

    job_login = secure_etcd.credentials(user, password)
    with connect([secure_etcd.endpoint], job_login, probe=keys.prefix) as store:
        assert store.get(keys.job) is not None  # the operator's record, in the job's prefix
        with pytest.raises(StorePermissionDenied):
            store.get_prefix("/stalwart/v1/")
        with pytest.raises(StorePermissionDenied):
            store.put(JobKeys(jobs.ns, "some-other-job").job, b"forged")

    jobs.delete("secure")
    wait_for("the job to go", lambda: jobs.gone("secure"), timeout=90)
    with pytest.raises(StoreSecurityError, match="username or password is wrong"):
        connect([secure_etcd.endpoint], job_login)
    with connect([secure_etcd.endpoint], secure_etcd.credentials()) as root:
        assert root.count_prefix(keys.prefix) == 0


