"""Fixtures of the operator's integration tests: the local cluster (real kopf, real kubectl, real etcd, process
kubelet), the TrainingJob CRD installed from ``crds/``, and the operator itself running embedded in a thread
of the test process, serving only the test's namespace."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from stalwart.local.cluster import LocalCluster
from stalwart.local.pytest_plugin import k8s_namespace, kube_api, local_cluster
from stalwart.operator.handlers import OperatorConfig, kube_from_config, operate
from stalwart.operator.kube import Kube
from stalwart.operator.model import OperatorSettings

__all__ = ["k8s_namespace", "kube_api", "local_cluster"]

REPO = Path(__file__).resolve().parents[2]


class EmbeddedOperator:
    """``stalwart operator`` in a thread of this process (kopf unmodified, its own event loop)."""

    def __init__(self, config: OperatorConfig, kubeconfig: str) -> None:
        self.config = config
        self.kube: Kube = kube_from_config(kubeconfig, config.concurrency)
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="operator", daemon=True)

    def _run(self) -> None:
        try:
            asyncio.run(operate(self.config, self.kube, stop_flag=self._stop, ready_flag=self._ready))
        except BaseException as e:  # surfaced by start()/stop()
            self._error = e

    def start(self, timeout: float = 60.0) -> EmbeddedOperator:
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self._ready.wait(0.2):
            if self._error is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the operator did not start: {self._error!r}")
        return self

    def stop(self, timeout: float = 60.0) -> None:
        self._stop.set()
        self._thread.join(timeout)
        self.kube.close()
        if self._thread.is_alive():
            raise RuntimeError("the operator did not stop within the timeout")


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
