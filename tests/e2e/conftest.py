"""The e2e fixtures: a local cluster of their own with stalwart installed as a user installs it (the Helm chart,
the operator pod its Deployment describes), shared by the e2e tests of one session."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

from stalwart.demo import Installation
from stalwart.local.cluster import LocalCluster

READY_WAIT = 180.0


@pytest.fixture(scope="session")
def stalwart_install(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Installation]:
    """Its own cluster, not the shared ``local_cluster``: an operator watching every namespace must not meet
    TrainingJobs of other tests (or another operator)."""
    cluster = LocalCluster.up(tmp_path_factory.mktemp("e2e-cluster"), nodes=3, timeout=120.0)
    install = Installation(cluster)
    try:
        install.install_chart()
        deadline = time.monotonic() + READY_WAIT
        while not install.operator_ready():
            assert time.monotonic() < deadline, "the operator pod did not become Ready"
            time.sleep(0.5)
        yield install
    finally:
        try:
            install.uninstall()
        finally:
            cluster.down()


@pytest.fixture
def stalwart_cluster(stalwart_install: Installation) -> LocalCluster:
    cluster: LocalCluster = stalwart_install.cluster
    return cluster
