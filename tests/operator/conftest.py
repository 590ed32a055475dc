"""Fixtures of the operator's integration tests: the local cluster (real kopf, real kubectl, real etcd, process
kubelet), the TrainingJob CRD installed from ``crds/``, and the operator itself running embedded in a thread
of the test process, serving only the test's namespace, as the Helm chart's ServiceAccount with the chart's RBAC
(:mod:`chart_rbac`): a permission the chart lacks fails here with the API server's 403, and the API server's
record of the account's calls is what ``stalwart/operator/rbac.py`` is checked against (test_zz_rbac.py)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import helm_python
import pytest
from chart_rbac import ACCESS_LOG, CHART, OperatorAccount, OperatorFactory, misused, operator_factory
from test_operator_cluster import Jobs

from stalwart.etcd.store import Store
from stalwart.local.cluster import LocalCluster

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="session")
def trainingjob_crd(local_cluster: LocalCluster) -> None:
    local_cluster.kubectl("apply", "-f", str(REPO / "crds" / "trainingjob.yaml"))


@pytest.fixture(scope="session")
def chart() -> Iterator[helm_python.Chart]:
    with helm_python.Chart.load(CHART) as loaded:
        yield loaded


@pytest.fixture(scope="session")
def operator_account(local_cluster: LocalCluster, chart: helm_python.Chart,
                     tmp_path_factory: pytest.TempPathFactory) -> Iterator[OperatorAccount]:
    """The chart's ServiceAccount ``stalwart-operator`` in ``stalwart-system``, with its cluster-wide RBAC. At the
    end of the session (of each xdist worker, each with its own cluster), nothing the operator did as it may have
    been refused or left out of rbac.py (:func:`chart_rbac.misused`)."""
    account = OperatorAccount.create(local_cluster, chart, "stalwart-operator", tmp_path_factory.mktemp("operator"))
    yield account
    problems = misused(local_cluster, account.user)
    assert problems == [], "; ".join(problems)


@pytest.fixture
def start_operator(local_cluster: LocalCluster, trainingjob_crd: None, operator_account: OperatorAccount,
                   k8s_namespace: str, request: pytest.FixtureRequest) -> Iterator[OperatorFactory]:
    """``start_operator(namespace, **config)`` starts an operator serving that namespace, as the chart's
    ServiceAccount with the chart's Role granted there; stopped after, before the test's namespace (and the Role
    in it) is deleted. What the account did so far is then noted in :data:`chart_rbac.ACCESS_LOG`."""
    start, started = operator_factory(operator_account, str(local_cluster.etcd_endpoint))
    yield start
    for op in started:
        op.stop()
    ACCESS_LOG.note(local_cluster, operator_account.user, request.node.name)


@pytest.fixture
def jobs(kube_api: Any, k8s_namespace: str) -> Jobs:
    """The TrainingJobs and pods of the test's namespace, through the real kubernetes client."""
    return Jobs(kube_api, k8s_namespace)


@pytest.fixture
def etcd_store(local_cluster: LocalCluster) -> Iterator[Store]:
    """A client of the cluster's real etcd."""
    store = Store([str(local_cluster.etcd_endpoint)], timeout=5.0)
    yield store
    store.close()
