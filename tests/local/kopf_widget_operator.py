"""A small kopf operator for the local cluster's tests: it reacts to Widget create/update/delete."""

from __future__ import annotations

from typing import Any

import kopf


@kopf.on.startup()
def configure(settings: kopf.OperatorSettings, **_: Any) -> None:
    settings.posting.level = 0
    settings.watching.server_timeout = 30
    settings.persistence.finalizer = "widgets.example.dev/kopf-finalizer"


@kopf.on.create("example.dev", "v1", "widgets")
def created(spec: Any, patch: kopf.Patch, **_: Any) -> None:
    patch.status["phase"] = "Created"
    patch.status["replicas"] = spec.get("replicas", 0)


@kopf.on.update("example.dev", "v1", "widgets", field="spec.replicas")
def updated(new: Any, patch: kopf.Patch, **_: Any) -> None:
    patch.status["phase"] = "Updated"
    patch.status["replicas"] = new


@kopf.on.delete("example.dev", "v1", "widgets")
def deleted(name: str, namespace: str, **_: Any) -> None:
    import kubernetes

    kubernetes.config.load_kube_config()
    api = kubernetes.client.CoreV1Api()
    api.create_namespaced_config_map(namespace, {"metadata": {"name": f"deleted-{name}"}, "data": {"by": "kopf"}})
