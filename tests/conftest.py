"""Fixtures shared by every test: real servers started on loopback, stopped afterwards."""

from __future__ import annotations

import contextlib
import gc
import os
import uuid
from collections.abc import Iterator
from typing import Any

import mp_ranks
import pytest
from forked_ranks import close_fork_server
from recording_server import Recorder
from xdist_groups import GROUP_MODULES

from stalwart.etcd.store import Store
from stalwart.local.etcd import EtcdServer

# One torch thread per rank process (as torchrun sets for ranks sharing a node, and the agent does for a pod of
# several): the suite runs dozens of ranks at once on a few cores, and a second thread per rank only spins
# (measured: 16.5 against 10.4 CPU-seconds for a 2-rank, 200-step run of the example). Set before torch is
# imported, so that the workers' own torch and every process they start inherit it; the local cluster passes
# it on to its pods. A developer's own setting wins.
os.environ.setdefault("OMP_NUM_THREADS", "1")

# The local cluster's fixtures (local_cluster, k8s_namespace, kube_api), one session cluster for every directory
# (per xdist worker); each test's durations written to build/test-durations.json (tools/slowest.py reads it); and
# the machine's slots that integration tests hold, shared with any other run on it (tests/machine_slots.py).
pytest_plugins = ["stalwart.local.pytest_plugin", "durations_plugin", "machine_slots"]


def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """``--dist loadgroup`` with the groups of :mod:`xdist_groups`, decided by module path on the controller.
    (xdist's own groups ride on a suffix of the test's node id, which pytest 9 no longer takes: its tests of one
    group were spread over every worker.)"""
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadGroupScheduling

    class ModuleGroups(LoadGroupScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return GROUP_MODULES.get(nodeid.split("::", 1)[0]) or str(super()._split_scope(nodeid))

    return ModuleGroups(config, log)


@pytest.hookimpl(wrapper=True)
def pytest_collection(session: pytest.Session) -> Iterator[object]:
    """The cyclic collector scanned a worker's whole heap (torch, the Kubernetes client, 2,400 collected tests) at
    every full collection: a quarter of its CPU (measured: 6.9 of 28.7 CPU-seconds for tests/api and the chart's
    tests, 1.0 of 20.6 with this). Off while the tests are collected, then what exists is frozen, so that a
    collection scans only what the tests themselves make. (The fork server does not freeze: its children run
    training whose teardown depends on when the collector runs; see stalwart/forkserver.py. The xdist controller
    collects nothing: it only turns the collector back on.)"""
    gc.disable()
    try:
        return (yield)
    finally:
        gc.freeze()
        gc.enable()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    _skip_gpu_tests(items)


def _skip_gpu_tests(items: list[pytest.Item]) -> None:
    try:
        import torch

        has_cuda = bool(torch.cuda.is_available())
    except ImportError:
        has_cuda = False
    if has_cuda:
        return
    skip = pytest.mark.skip(reason="needs CUDA; none on this machine")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session", autouse=True)
def _rank_fork_server() -> Iterator[None]:
    """The test process's fork server for rank processes (tests/forked_ranks.py) ends with the session."""
    yield
    lost, code = close_fork_server()
    # It served every rank it was asked for (a lost server's ranks would start as plain processes, and the tests
    # would still pass), and it ends on its own when its socket closes.
    assert not lost, "the tests' fork server was lost"
    assert code in (None, 0), f"the tests' fork server ended with {code}"


@pytest.fixture(scope="session", autouse=True)
def _multiprocessing_fork_server() -> Iterator[None]:
    """The multiprocessing fork server of the tests' rank functions (tests/mp_ranks.py) ends with the session."""
    yield
    code = mp_ranks.stop_server()
    assert code in (None, 0), f"the tests' multiprocessing fork server ended with {code}"


@pytest.fixture(scope="session")
def etcd_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EtcdServer]:
    """One real etcd server for the whole session (tests isolate themselves by key prefix)."""
    server = EtcdServer(tmp_path_factory.mktemp("etcd"))
    server.start()
    yield server
    server.cleanup()


@pytest.fixture
def etcd(etcd_server: EtcdServer) -> EtcdServer:
    """The session's etcd server, started again if a test stopped it."""
    if etcd_server.process is None or etcd_server.process.poll() is not None:
        etcd_server.start()
    return etcd_server


@pytest.fixture
def private_etcd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EtcdServer]:
    """An etcd server of the test's own, for tests that stop, kill or compact it."""
    server = EtcdServer(tmp_path_factory.mktemp("etcd-private"))
    server.start()
    yield server
    server.cleanup()


@pytest.fixture(scope="session")
def secure_etcd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EtcdServer]:
    """One real etcd for the session serving clients over TLS only (client certificates required) with
    authentication on; a token unused for 3 s expires, so tests run past the token's life."""
    server = EtcdServer(tmp_path_factory.mktemp("etcd-secure"), tls=True, auth=True, auth_token_ttl=3)
    server.start()
    yield server
    server.cleanup()


@pytest.fixture
def store(etcd: EtcdServer) -> Iterator[Store]:
    s = Store([etcd.endpoint], timeout=5.0)
    yield s
    s.close()


@pytest.fixture
def prefix(store: Store) -> Iterator[str]:
    """A fresh key prefix for one test; everything under it is deleted afterwards."""
    p = f"/test/{uuid.uuid4().hex}/"
    yield p
    with contextlib.suppress(Exception):  # the test may have left etcd stopped
        store.delete_prefix(p)


@pytest.fixture
def fake_etcd() -> Iterator[Recorder]:
    """A TCP server in etcd's place that records what arrives and answers nothing (see recording_server)."""
    r = Recorder()
    yield r
    r.close()
