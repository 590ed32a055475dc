"""A whole job on the local cluster against an etcd that speaks TLS only and has authentication on: the
operator, logged in as an etcd administrator, gives the job an etcd user of its own; the job's agents and rank
processes log in as that user from the Secret mounted into their pods, meet (rendezvous), survive a fault with
an in-process restart and call each other over RPC. The job's user can touch nothing outside its prefix, and
goes with the job."""

from __future__ import annotations

import base64
import json
import sys
from pathlib import Path
from typing import Any

import pytest
from test_operator_cluster import Jobs, OperatorFactory, job_body, phase_is, wait_for

from stalwart.api import naming
from stalwart.etcd.admin import job_user_name
from stalwart.etcd.client import connect
from stalwart.etcd.keys import JobKeys
from stalwart.etcd.store import StorePermissionDenied, StoreSecurityError
from stalwart.local.etcd import EtcdServer

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
#: Two ranks: init_rpc() from the environment, rank 1 fails the first iteration of a restartable function,
#: both re-run it in process, calling each other over RPC (tests/rpc/test_rpc_from_env.py, run as a script).
RANK_SCRIPT = REPO / "tests" / "rpc" / "test_rpc_from_env.py"


def test_a_whole_job_runs_against_a_secured_etcd_with_its_own_user(
        start_operator: OperatorFactory, jobs: Jobs, secure_etcd: EtcdServer, tmp_path: Path) -> None:
    start_operator(jobs.ns, default_endpoints=(secure_etcd.endpoint,), etcd_credentials=secure_etcd.credentials(),
                   job_etcd_users=True)
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


def test_a_tls_job_whose_secret_lacks_the_ca_is_told_and_never_started(
        start_operator: OperatorFactory, jobs: Jobs, secure_etcd: EtcdServer) -> None:
    start_operator(jobs.ns, agent_command=())
    jobs.core.create_namespaced_secret(jobs.ns, {"metadata": {"name": "etcd-no-ca"},
                                                 "stringData": {"username": "u", "password": "p"}})
    body = job_body("no-ca", replicas=1, command=["sleep", "60"])
    body["spec"]["rendezvous"].update(endpoints=[secure_etcd.endpoint], tls=True, secretRef={"name": "etcd-no-ca"})
    jobs.create(body)
    wait_for("the EtcdCredentialsInvalid event", lambda: "EtcdCredentialsInvalid" in jobs.events("no-ca"),
             timeout=60)
    message = next(e.message for e in jobs.core.list_namespaced_event(jobs.ns).items
                   if e.reason == "EtcdCredentialsInvalid")
    assert "Secret etcd-no-ca (spec.rendezvous.secretRef): ca.crt: required with TLS" in message
    # The status says it too, for as long as it holds: a condition naming the key.
    access = wait_for("the EtcdAccess condition", lambda: _condition(jobs, "no-ca", "EtcdAccess"), timeout=60)
    assert access["status"] == "False" and access["reason"] == "EtcdCredentialsInvalid"
    assert "ca.crt: required with TLS" in access["message"]
    assert jobs.pods("no-ca") == []  # nothing runs in plaintext


def _condition(jobs: Jobs, name: str, type_: str) -> dict[str, Any] | None:
    return next((c for c in jobs.status(name).get("conditions") or [] if c.get("type") == type_), None)


def test_a_job_whose_login_etcd_refuses_gets_a_condition_naming_the_refusal(
        start_operator: OperatorFactory, jobs: Jobs, secure_etcd: EtcdServer) -> None:
    start_operator(jobs.ns, agent_command=())
    good = secure_etcd.credentials()
    assert good.ca_cert is not None and good.client_cert is not None and good.client_key is not None
    jobs.core.create_namespaced_secret(jobs.ns, {"metadata": {"name": "etcd-wrong-password"}, "stringData": {
        "ca.crt": good.ca_cert.decode(), "tls.crt": good.client_cert.decode(), "tls.key": good.client_key.decode(),
        "username": "root", "password": "not-the-password"}})
    body = job_body("refused", replicas=1, command=["sleep", "60"])
    body["spec"]["rendezvous"].update(endpoints=[secure_etcd.endpoint], tls=True,
                                      secretRef={"name": "etcd-wrong-password"})
    jobs.create(body)
    access = wait_for("the EtcdAccess condition", lambda: _condition(jobs, "refused", "EtcdAccess"), timeout=60)
    assert access["status"] == "False" and access["reason"] == "EtcdAuthFailed", access
    assert "etcd refused the operator's credentials" in access["message"]
    assert "EtcdAuthFailed" in jobs.events("refused")
    assert jobs.pods("refused") == []
