"""pytest fixtures for tests that need a Kubernetes cluster: the local cluster, started once per session.

Enable with ``pytest_plugins = ["stalwart.local.pytest_plugin"]`` in the top-level ``conftest.py``.

- ``local_cluster`` (session): a running :class:`~stalwart.local.cluster.LocalCluster` with 3 nodes of the default
  capacity and a short node-monitor grace period (:data:`TEST_SETTINGS`: a lost node turns Unknown within
  seconds; pods keep the real default tolerations of 300 s unless a test sets its own), a network namespace per
  node where the session may make them (``STALWART_LOCAL_NETWORK=loopback`` forces the loopback mode). Use
  ``.kubeconfig`` (path), ``.api_url``, ``.etcd_endpoint`` (``host:port`` of its real etcd), ``.env()``
  (KUBECONFIG etc. for subprocesses), ``.kubectl(*args)``, ``.lose_node(name)`` / ``.restore_node(name)``
  (node names in ``.nodes``). Stopped, with every process it started, at the end of the session.
- ``k8s_namespace``: a fresh namespace (its name) in that cluster for one test, deleted afterwards.
- ``kube_api``: a ``kubernetes.client.ApiClient`` configured for the cluster.
- ``exits_within_bound`` (autouse): after each test, every stalwart process the test ran that decided to exit
  (its ``leaving with exit code`` line, or the agent's ``every rank returned``) must have been gone within the
  bound of issue 29 (the bound its ``leaving`` line declares, else
  :data:`~stalwart.local.exitcheck.EXIT_BOUND`, plus :data:`~stalwart.local.exitcheck.SLACK`), leaving no
  process behind: the containers of every local cluster this
  process started (the kubelet's book) and every :class:`~stalwart.local.exitcheck.WatchedProcess` (agents a test
  starts itself). A process still alive or late fails the test, named with its pod or pid and its last log lines.
  It waits only for a process that decided to exit and has not ended yet, at most until its bound.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from stalwart.local import exitcheck
from stalwart.local.cluster import LocalCluster
from stalwart.local.settings import LocalClusterSettings, network_from_env

#: The session cluster's settings: node loss is noticed after 3 s instead of 40 s; the network mode is
#: ``$STALWART_LOCAL_NETWORK`` (auto, netns or loopback; default auto: a namespace per node when run as root), so
#: that a suite can be run in either mode.
TEST_SETTINGS = LocalClusterSettings(node_monitor_grace_period=3.0, network=network_from_env())


@pytest.fixture(scope="session")
def local_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    cluster = LocalCluster.up(tmp_path_factory.mktemp("local-cluster"), nodes=3, timeout=120.0,
                              owner_pid=os.getpid(), settings=TEST_SETTINGS)
    try:
        yield cluster
    finally:
        cluster.down()


@pytest.fixture
def kube_api(local_cluster: LocalCluster) -> Iterator[Any]:
    from kubernetes import client, config

    cfg = client.Configuration()
    config.load_kube_config(config_file=str(local_cluster.kubeconfig),  # type: ignore[no-untyped-call]
                            client_configuration=cfg)
    api = client.ApiClient(cfg)
    try:
        yield api
    finally:
        api.close()  # type: ignore[no-untyped-call]


@pytest.fixture
def k8s_namespace(local_cluster: LocalCluster) -> Iterator[str]:
    name = f"t-{uuid.uuid4().hex[:10]}"
    local_cluster.kubectl("create", "namespace", name)
    try:
        yield name
    finally:
        local_cluster.kubectl("delete", "namespace", name, "--wait=false", "--ignore-not-found", check=False)


@pytest.fixture(autouse=True)
def exits_within_bound() -> Iterator[None]:
    """See the module docstring. Scoped to this process (its own clusters and processes): safe beside other
    pytest-xdist workers."""
    exitcheck.take_watched()  # started outside any test (a session fixture's): not this test's
    yield
    problems = exitcheck.judge_watched(exitcheck.take_watched())
    for cluster in exitcheck.followed():
        problems += cluster.judge()
    if problems:
        pytest.fail(f"{len(problems)} process(es) not gone within their exit bound (+{exitcheck.SLACK:g}s "
                    f"slack):\n"
                    + "\n".join(str(p) for p in problems), pytrace=False)
