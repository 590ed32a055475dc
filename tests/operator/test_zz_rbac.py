"""``stalwart/operator/rbac.py`` against what the operator actually did: every operator test of this directory runs
as the chart's ServiceAccount with the chart's RBAC (conftest.py), and the API server records each authorization
decision it made for that account (verb, API group, resource, subresource, namespace). This module runs last
(its name), reads that record and checks it against rbac.py both ways (under xdist, in one group with the
operator modules that use every grant between them, tests/conftest.py; every worker's cluster is also checked
one way at the end of its session, by the ``operator_account`` fixture); and it runs the
operator once under an account whose Role lacks one verb of rbac.py, which fails with the API server's 403.
"""

from __future__ import annotations

import json
import logging
import uuid
from collections.abc import Iterator
from typing import Any

import helm_python
import pytest
from chart_rbac import ACCESS_LOG, OperatorAccount, declared, operator_factory, used, without_verb
from kubernetes import client as k8s
from kubernetes import config as kconfig
from test_operator_cluster import SLEEP, Jobs, job_body, wait_for
from xdist_groups import GROUP_MODULES, RBAC_GROUP

from stalwart.local.cluster import LocalCluster

pytestmark = pytest.mark.integration

def ran(request: pytest.FixtureRequest, module: str) -> list[str]:
    return [item.name for item in request.session.items if item.module is not None
            and item.module.__name__ == module]


def ran_with_the_account(request: pytest.FixtureRequest) -> list[str]:
    """The tests of this module's xdist group (tests/conftest.py) before this one that run an operator as the
    chart's account: what this test's record must hold."""
    names = []
    for item in request.session.items:
        if item is request.node:
            return names
        in_group = item.path.is_relative_to(request.config.rootpath) and \
            GROUP_MODULES.get(item.path.relative_to(request.config.rootpath).as_posix()) == RBAC_GROUP
        if in_group and "start_operator" in getattr(item, "fixturenames", ()):
            names.append(item.name)
    return names


def test_rbac_py_is_exactly_what_the_operator_used(local_cluster: LocalCluster, operator_account: OperatorAccount,
                                                   request: pytest.FixtureRequest) -> None:
    allowed, refused = used(local_cluster, operator_account.user)
    assert refused == set(), f"the operator was refused {sorted(refused)}: the chart's RBAC lacks them"
    allowed |= ACCESS_LOG.allowed
    possible = declared(peering=True, clusterwide=False, gang="coscheduling") | declared(
        peering=True, clusterwide=False, gang="volcano")
    assert allowed - possible == set(), f"calls rbac.py does not declare: {sorted(allowed - possible)}"
    cluster_tests = ran(request, "test_operator_cluster")
    if "test_lifecycle_of_a_small_job_with_real_agents" not in cluster_tests:
        pytest.skip("which permissions go unused is known only after the operator suite of this directory")
    elsewhere = [t for t in ran_with_the_account(request) if t not in ACCESS_LOG.tests]
    assert elsewhere == [], f"tests of the chart's account ran on another worker (xdist group?): {elsewhere}"
    wanted = declared(peering="test_two_replicas_with_peering_one_works_and_the_other_takes_over" in cluster_tests,
                      clusterwide=False, gang="coscheduling" if "test_gang_scheduler_pod_group" in cluster_tests
                      else None)
    assert wanted - allowed == set(), (f"rbac.py grants what the operator never used: {sorted(wanted - allowed)}; "
                                       f"the account's tests on this worker: {ACCESS_LOG.tests}")


@pytest.fixture
def account_without_pod_create(local_cluster: LocalCluster, chart: helm_python.Chart,
                               tmp_path: Any) -> Iterator[OperatorAccount]:
    name = f"stalwart-no-create-{uuid.uuid4().hex[:6]}"
    account = OperatorAccount.create(local_cluster, chart, name, tmp_path,
                                     edit=lambda docs: without_verb(docs, "pods", "create"))
    yield account
    local_cluster.kubectl("delete", "serviceaccount", name, "-n", "stalwart-system", "--ignore-not-found")


@pytest.mark.usefixtures("trainingjob_crd")
def test_an_operator_lacking_one_verb_of_rbac_py_fails_with_the_403(
        local_cluster: LocalCluster, account_without_pod_create: OperatorAccount,
        kube_api: Any, k8s_namespace: str, caplog: pytest.LogCaptureFixture) -> None:
    assert ("", "pods", "create") in declared(peering=False, clusterwide=False)
    jobs = Jobs(kube_api, k8s_namespace)
    start, started = operator_factory(account_without_pod_create, str(local_cluster.etcd_endpoint))
    caplog.set_level(logging.WARNING, logger="stalwart.operator")
    try:
        start(k8s_namespace, agent_command=())
        jobs.create(job_body("denied", replicas=2, command=SLEEP))
        user = account_without_pod_create.user
        wait_for("the API server to refuse the operator's pod creation",
                 lambda: ("", "pods", "create") in used(local_cluster, user)[1], timeout=120)
        wait_for("the operator to report the 403", lambda: any(
            "create pods" in r.getMessage() and "403" in r.getMessage() for r in caplog.records), timeout=60)
    finally:
        for op in started:
            op.stop()
    assert jobs.pods("denied") == []
    assert jobs.status("denied").get("phase") in (None, "Pending")
    # What the operator got: the API server's 403 for its account, as the same request shows.
    cfg = k8s.Configuration()
    kconfig.load_kube_config(config_file=str(account_without_pod_create.kubeconfig), client_configuration=cfg)
    with pytest.raises(k8s.ApiException) as err:
        k8s.CoreV1Api(k8s.ApiClient(cfg)).create_namespaced_pod(k8s_namespace, {
            "metadata": {"name": "probe"}, "spec": {"containers": [{"name": "c", "image": "i"}]}})
    assert err.value.status == 403 and json.loads(err.value.body)["message"] == (
        f'pods is forbidden: User "{account_without_pod_create.user}" cannot create resource "pods" in API group "" '
        f'in the namespace "{k8s_namespace}"')
