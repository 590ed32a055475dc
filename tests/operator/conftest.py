"""Fixtures of the operator's integration tests: the local cluster (real kopf, real kubectl, real etcd, process
kubelet), the TrainingJob CRD installed from ``crds/``, and the operator itself running embedded in a thread
of the test process, serving only the test's namespace."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from test_operator_cluster import Jobs

from stalwart.local.cluster import LocalCluster
from stalwart.operator.embedded import EmbeddedOperator
from stalwart.operator.handlers import OperatorConfig
from stalwart.operator.model import OperatorSettings
from stalwart.store import Store

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="session")
def trainingjob_crd(local_cluster: LocalCluster) -> None:
    local_cluster.kubectl("apply", "-f", str(REPO / "crds" / "trainingjob.yaml"))


OperatorFactory = Callable[..., EmbeddedOperator]


@pytest.fixture
def start_operator(local_cluster: LocalCluster, trainingjob_crd: None) -> Iterator[OperatorFactory]:
    """``start_operator(namespace, **config)`` starts an operator serving that namespace; stopped after."""
    started: list[EmbeddedOperator] = []

    def start(namespace: str, **overrides: Any) -> EmbeddedOperator:
        settings = overrides.pop("settings", OperatorSettings(status_interval=0.5))
        config = OperatorConfig(namespaces=(namespace,), default_endpoints=(str(local_cluster.etcd_endpoint),),
                                settings=settings, **overrides)
        op = EmbeddedOperator(config, str(local_cluster.kubeconfig)).start()
        started.append(op)
        return op

    yield start
    for op in started:
        op.stop()


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
