"""Helpers of the e2e tests: TrainingJobs built from the repository's examples, and waits on what kubectl
shows. Every wait has a deadline and says what it waited for."""

from __future__ import annotations

import copy
import json
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

from stalwart.api import naming
from stalwart.local.cluster import LocalCluster

REPO = Path(__file__).resolve().parents[2]
NAMESPACE = "default"
JSON = dict[str, Any]


def example_job(prefix: str, args: list[str], env: dict[str, str] | None = None, **spec: Any) -> JSON:
    """``examples/minimal.yaml`` under a unique name, with training arguments, env and spec fields added."""
    job: JSON = yaml.safe_load((REPO / "examples" / "minimal.yaml").read_text())
    job = copy.deepcopy(job)
    job["metadata"] = {"name": f"{prefix}-{uuid.uuid4().hex[:6]}", "namespace": NAMESPACE}
    (container,) = job["spec"]["template"]["spec"]["containers"]
    container["args"] = [*container.get("args", []), *args]
    container["env"] = [*container.get("env", []), *({"name": k, "value": v} for k, v in (env or {}).items())]
    container.pop("resources", None)
    job["spec"].update(spec)
    return job


def apply(cluster: LocalCluster, job: JSON) -> None:
    cluster.kubectl("apply", "-f", "-", input=json.dumps(job))


def get_job(cluster: LocalCluster, name: str) -> JSON:
    result = cluster.kubectl("get", "tj", name, "-n", NAMESPACE, "-o", "json", check=False)
    if result.returncode != 0:
        return {}
    got: JSON = json.loads(result.stdout)
    return got


def status(cluster: LocalCluster, name: str) -> JSON:
    st: JSON = get_job(cluster, name).get("status") or {}
    return st


def pods(cluster: LocalCluster, name: str) -> list[JSON]:
    out = cluster.kubectl("get", "pods", "-n", NAMESPACE, "-l", naming.selector(name), "-o", "json").stdout
    items: list[JSON] = json.loads(out)["items"]
    return items


def wait_for(what: str, check: Callable[[], Any], timeout: float = 240.0, interval: float = 0.5) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        result = check()
        if result:
            return result
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:g}s waiting for {what}")
        time.sleep(interval)


def wait_phase(cluster: LocalCluster, name: str, *phases: str, timeout: float = 240.0) -> JSON:
    def reached() -> JSON | None:
        st = status(cluster, name)
        return st if st.get("phase") in phases else None
    try:
        result: JSON = wait_for(f"{name} to be {' or '.join(phases)}", reached, timeout)
    except AssertionError as e:
        raise AssertionError(f"{e}; last status: {json.dumps(status(cluster, name))}") from None
    return result


def training_events(cluster: LocalCluster, pod: str) -> list[JSON]:
    logs = cluster.kubectl("logs", pod, "-n", NAMESPACE, check=False).stdout
    events: list[JSON] = []
    for line in logs.splitlines():
        if line.startswith("{"):
            try:
                events.append(json.loads(line))
            except ValueError:
                continue
    return events


def delete(cluster: LocalCluster, name: str) -> None:
    cluster.kubectl("delete", "tj", name, "-n", NAMESPACE, "--ignore-not-found", "--wait=false", check=False)
