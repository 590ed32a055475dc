"""Helpers for the local cluster's tests."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any, TypeVar

from stalwart.local.cluster import LocalCluster

T = TypeVar("T")

WIDGET_CRD = """
apiVersion: apiextensions.k8s.io/v1
kind: CustomResourceDefinition
metadata:
  name: widgets.example.dev
spec:
  group: example.dev
  scope: Namespaced
  names: {plural: widgets, singular: widget, kind: Widget, shortNames: [wd]}
  versions:
  - name: v1
    served: true
    storage: true
    subresources:
      status: {}
      scale: {specReplicasPath: .spec.replicas, statusReplicasPath: .status.replicas}
    additionalPrinterColumns:
    - {name: Replicas, type: integer, jsonPath: .spec.replicas}
    - {name: Phase, type: string, jsonPath: .status.phase}
    - {name: Age, type: date, jsonPath: .metadata.creationTimestamp}
    schema:
      openAPIV3Schema:
        type: object
        properties:
          spec:
            type: object
            description: The widget's desired state.
            x-kubernetes-validations:
            - rule: "self.replicas <= self.maxReplicas"
              message: "replicas must not exceed maxReplicas"
            properties:
              replicas: {type: integer, minimum: 0, default: 1, description: How many widgets.}
              maxReplicas: {type: integer, default: 10}
              restartPolicy:
                type: string
                enum: [Never, OnFailure]
                default: Never
                description: "When to restart a widget: Never or OnFailure."
          status:
            type: object
            properties:
              phase: {type: string}
              replicas: {type: integer}
"""


def wait_until(fn: Callable[[], T | None], what: str, timeout: float = 60.0, every: float = 0.1) -> T:
    """Poll ``fn`` until it returns something truthy; fail naming ``what`` after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        last = fn()
        if last:
            return last
        time.sleep(every)
    raise AssertionError(f"timed out after {timeout:g}s waiting for {what} (last: {last!r})")


def get_json(cluster: LocalCluster, *args: str) -> Any:
    return json.loads(cluster.kubectl("get", *args, "-o", "json").stdout)


def phase_is(cluster: LocalCluster, ns: str, name: str, *phases: str) -> dict[str, Any] | None:
    """The pod if its phase is one of ``phases``, else None."""
    pod: dict[str, Any] = get_json(cluster, "-n", ns, "pod", name)
    return pod if pod.get("status", {}).get("phase") in phases else None


def ensure_widget_crd(cluster: LocalCluster) -> None:
    cluster.kubectl("apply", "-f", "-", input=WIDGET_CRD)
    wait_until(lambda: cluster.kubectl("get", "widgets", "-A", check=False).returncode == 0, "widgets served")
