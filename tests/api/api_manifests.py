"""A valid TrainingJob manifest and the catalogue of bad ones that the validator and the CRD are tested with.

Each bad manifest is the good one with one edit, the field path ``stalwart validate`` must report, a part of
the message it must print, and how the API server would catch it with the generated CRD:
``"schema"`` (the openAPIV3Schema: types, bounds, enums, patterns, required fields, unknown fields under
strict field validation, list-type set uniqueness), ``"cel"`` (an ``x-kubernetes-validations`` rule) or
``"server"`` (the API server itself, before any CRD schema: apiVersion, kind, metadata).
"""

from __future__ import annotations

import copy
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

GOOD: dict[str, Any] = {
    "apiVersion": "stalwart.dev/v1alpha1",
    "kind": "TrainingJob",
    "metadata": {"name": "mnist", "namespace": "ml"},
    "spec": {
        "replicas": 2,
        "spares": 1,
        "template": {"spec": {"containers": [
            {"name": "trainer", "image": "python:3.11-slim", "command": ["python", "train.py"]}]}},
        "rendezvous": {"endpoints": ["etcd.infra.svc:2379"]},
        "restartPolicy": {"rules": [{"action": "FailJob", "onExitCodes": {"operator": "In", "values": [3]}}]},
    },
}

_PART = re.compile(r"([^.\[\]]+)|\[(\d+)\]")


def _parts(path: str) -> list[str | int]:
    return [int(index) if index else name for name, index in _PART.findall(path)]


def _parent(doc: Any, path: str) -> tuple[Any, str | int]:
    parts = _parts(path)
    node = doc
    for part in parts[:-1]:
        node = node[part]
    return node, parts[-1]


def put(path: str, value: Any) -> Callable[[dict[str, Any]], None]:
    def edit(doc: dict[str, Any]) -> None:
        node, last = _parent(doc, path)
        node[last] = copy.deepcopy(value)
    return edit


def drop(path: str) -> Callable[[dict[str, Any]], None]:
    def edit(doc: dict[str, Any]) -> None:
        node, last = _parent(doc, path)
        del node[last]
    return edit


def both(*edits: Callable[[dict[str, Any]], None]) -> Callable[[dict[str, Any]], None]:
    def edit(doc: dict[str, Any]) -> None:
        for one in edits:
            one(doc)
    return edit


@dataclass(frozen=True)
class Bad:
    id: str
    edit: Callable[[dict[str, Any]], None]
    path: str
    message: str
    caught_by: str  # "schema" | "cel" | "server"

    def manifest(self) -> dict[str, Any]:
        doc = copy.deepcopy(GOOD)
        self.edit(doc)
        return doc


C0 = "spec.template.spec.containers[0]"
RDZV = "spec.rendezvous"
IP = "spec.restartPolicy.inProcess"
RULE = "spec.restartPolicy.rules[0]"

BAD: list[Bad] = [
    # apiVersion, kind, metadata: the API server's part.
    Bad("wrong-api-version", put("apiVersion", "stalwart.dev/v1"), "apiVersion",
        "expected 'stalwart.dev/v1alpha1', got \"stalwart.dev/v1\"", "server"),
    Bad("wrong-kind", put("kind", "PyTorchJob"), "kind", "expected 'TrainingJob', got \"PyTorchJob\"", "server"),
    Bad("missing-kind", drop("kind"), "kind", "kind is missing", "server"),
    Bad("missing-metadata", drop("metadata"), "metadata", "required field is missing", "server"),
    Bad("missing-name", drop("metadata.name"), "metadata.name", "required field is missing", "server"),
    Bad("unknown-metadata-field", put("metadata.lables", {"a": "b"}), "metadata.lables",
        "unknown field; did you mean 'labels'?", "server"),
    Bad("name-upper-case", put("metadata.name", "MNIST"), "metadata.name", "must be a DNS-1035 label", "cel"),
    Bad("name-starts-with-digit", put("metadata.name", "1mnist"), "metadata.name",
        "must be a DNS-1035 label", "cel"),
    Bad("name-ends-with-dash", put("metadata.name", "mnist-"), "metadata.name",
        "must be a DNS-1035 label", "cel"),
    Bad("name-too-long", put("metadata.name", "a" * 51), "metadata.name",
        "must be at most 50 characters so that pod names '<name>-worker-<index>' fit in 63, got 51", "cel"),
    # spec: counts.
    Bad("missing-spec", drop("spec"), "spec", "required field is missing", "schema"),
    Bad("unknown-top-level-field", put("specification", {}), "specification",
        "unknown field; did you mean 'spec'?", "schema"),
    Bad("missing-replicas", drop("spec.replicas"), "spec.replicas", "required field is missing", "schema"),
    Bad("zero-replicas", put("spec.replicas", 0), "spec.replicas",
        "must be greater than or equal to 1, got 0", "schema"),
    Bad("replicas-string", put("spec.replicas", "2"), "spec.replicas",
        "expected an integer, got a string \"2\"", "schema"),
    Bad("replicas-fraction", put("spec.replicas", 2.5), "spec.replicas",
        "expected an integer, got a number 2.5", "schema"),
    Bad("replicas-too-many", put("spec.replicas", 10_001), "spec.replicas",
        "must be less than or equal to 10000, got 10001", "schema"),
    Bad("negative-spares", put("spec.spares", -1), "spec.spares",
        "must be greater than or equal to 0, got -1", "schema"),
    Bad("zero-nproc", put("spec.nprocPerNode", 0), "spec.nprocPerNode",
        "must be greater than or equal to 1, got 0", "schema"),
    Bad("zero-min-replicas", put("spec.minReplicas", 0), "spec.minReplicas",
        "must be greater than or equal to 1, got 0", "schema"),
    Bad("min-above-replicas", put("spec.minReplicas", 3), "spec.minReplicas",
        "must be less than or equal to replicas (2), got 3", "cel"),
    Bad("max-below-replicas", put("spec.maxReplicas", 1), "spec.maxReplicas",
        "must be greater than or equal to replicas (2), got 1", "cel"),
    Bad("too-many-pods", both(put("spec.replicas", 9_999), put("spec.spares", 2)), "spec.spares",
        "maxReplicas + spares must be at most 10000, got 10001", "cel"),
    Bad("typo-in-spec-field", put("spec.nprocPerPod", 2), "spec.nprocPerPod",
        "unknown field; did you mean 'nprocPerNode'?", "schema"),
    # spec.template
    Bad("missing-template", drop("spec.template"), "spec.template", "required field is missing", "schema"),
    Bad("template-not-a-mapping", put("spec.template", ["trainer"]), "spec.template",
        "expected a mapping, got a list", "schema"),
    Bad("missing-pod-spec", drop("spec.template.spec"), "spec.template.spec", "required field is missing",
        "schema"),
    Bad("no-containers", put("spec.template.spec.containers", []), "spec.template.spec.containers",
        "must have at least 1 item, got 0", "schema"),
    Bad("container-without-name", drop(f"{C0}.name"), f"{C0}.name", "required field is missing", "schema"),
    Bad("container-without-image", drop(f"{C0}.image"), f"{C0}.image", "required field is missing", "schema"),
    Bad("container-bad-name", put(f"{C0}.name", "Trainer_1"), f"{C0}.name",
        "must be a DNS-1123 label", "schema"),
    Bad("container-command-not-list", put(f"{C0}.command", "python train.py"), f"{C0}.command",
        "expected a list, got a string", "schema"),
    Bad("first-container-without-command", drop(f"{C0}.command"), f"{C0}.command",
        "required on the first container", "cel"),
    # spec.rendezvous
    Bad("no-endpoints", put(f"{RDZV}.endpoints", []), f"{RDZV}.endpoints",
        "must have at least 1 item, got 0", "schema"),
    Bad("endpoint-without-port", put(f"{RDZV}.endpoints", ["etcd.infra.svc"]), f"{RDZV}.endpoints[0]",
        "expected host:port", "schema"),
    Bad("endpoint-with-scheme", put(f"{RDZV}.endpoints", ["http://etcd:2379"]), f"{RDZV}.endpoints[0]",
        "without a scheme", "schema"),
    Bad("endpoint-ipv6-without-brackets", put(f"{RDZV}.endpoints", ["fd00::1:2379"]),
        f"{RDZV}.endpoints[0]", "an IPv6 address must be in brackets, e.g. [fd00::1]:2379", "schema"),
    Bad("endpoint-port-out-of-range", put(f"{RDZV}.endpoints", ["etcd:2379", "etcd:65536"]),
        f"{RDZV}.endpoints[1]", "port must be an integer in 1..65535, got '65536'", "schema"),
    Bad("endpoint-bad-host", put(f"{RDZV}.endpoints", ["etcd_1:2379"]), f"{RDZV}.endpoints[0]",
        "is not a host name or IPv4 address", "schema"),
    Bad("tls-without-secret", put(f"{RDZV}.tls", True), f"{RDZV}.secretRef",
        "required when tls is true", "cel"),
    Bad("secret-bad-name", put(f"{RDZV}.secretRef", {"name": "Etcd_Client"}), f"{RDZV}.secretRef.name",
        "must be a DNS-1123 subdomain", "schema"),
    Bad("zero-join-timeout", put(f"{RDZV}.joinTimeoutSeconds", 0), f"{RDZV}.joinTimeoutSeconds",
        "must be greater than 0, got 0", "schema"),
    Bad("last-call-not-below-join", put(f"{RDZV}.lastCallSeconds", 600), f"{RDZV}.lastCallSeconds",
        "must be less than joinTimeoutSeconds (600), got 600", "cel"),
    Bad("lease-ttl-too-short", put(f"{RDZV}.leaseTTLSeconds", 1), f"{RDZV}.leaseTTLSeconds",
        "must be greater than or equal to 2, got 1", "schema"),
    Bad("lease-ttl-fraction", put(f"{RDZV}.leaseTTLSeconds", 2.5), f"{RDZV}.leaseTTLSeconds",
        "expected an integer", "schema"),
    # spec.restartPolicy
    Bad("restart-policy-not-a-mapping", put("spec.restartPolicy", "Always"), "spec.restartPolicy",
        "expected a mapping, got a string", "schema"),
    Bad("negative-max-restarts", put(f"{IP}", {"maxRestarts": -1}), f"{IP}.maxRestarts",
        "must be greater than or equal to 0, got -1", "schema"),
    Bad("soft-not-below-hard", put(f"{IP}", {"softTimeoutSeconds": 90, "hardTimeoutSeconds": 90}),
        f"{IP}.softTimeoutSeconds", "must be less than hardTimeoutSeconds (90), got 90", "cel"),
    Bad("soft-above-default-hard", put(f"{IP}", {"softTimeoutSeconds": 120}), f"{IP}.softTimeoutSeconds",
        "must be less than hardTimeoutSeconds (90), got 120", "cel"),
    Bad("timeout-string", put(f"{IP}", {"hardTimeoutSeconds": "90s"}), f"{IP}.hardTimeoutSeconds",
        "expected a number, got a string \"90s\"", "schema"),
    Bad("negative-barrier-timeout", put(f"{IP}", {"barrierTimeoutSeconds": -5}), f"{IP}.barrierTimeoutSeconds",
        "must be greater than 0, got -5", "schema"),
    Bad("snapshots-every-zero", put(f"{IP}", {"peerSnapshots": {"every": 0}}), f"{IP}.peerSnapshots.every",
        "must be greater than or equal to 1, got 0", "schema"),
    Bad("snapshots-memory-not-a-quantity", put(f"{IP}", {"peerSnapshots": {"memoryLimit": "8 gigs"}}),
        f"{IP}.peerSnapshots.memoryLimit", "expected a quantity of bytes such as 1Gi, 512Mi or 2G", "schema"),
    Bad("negative-backoff-limit", put("spec.restartPolicy.backoffLimit", -1), "spec.restartPolicy.backoffLimit",
        "must be greater than or equal to 0, got -1", "schema"),
    Bad("unknown-rule-action", put(f"{RULE}.action", "Retry"), f"{RULE}.action",
        "expected 'RestartInProcess', 'ReplacePod' or 'FailJob', got \"Retry\"", "schema"),
    Bad("rule-without-action", drop(f"{RULE}.action"), f"{RULE}.action", "required field is missing", "schema"),
    Bad("rule-matches-nothing", put(f"{RULE}", {"action": "FailJob"}), f"{RULE}.onExitCodes",
        "a rule needs onExitCodes or onReasons (or both)", "cel"),
    Bad("unknown-exit-code-operator", put(f"{RULE}.onExitCodes.operator", "Equals"),
        f"{RULE}.onExitCodes.operator", "expected 'In' or 'NotIn', got \"Equals\"", "schema"),
    Bad("exit-code-out-of-range", put(f"{RULE}.onExitCodes.values", [3, 256]),
        f"{RULE}.onExitCodes.values[1]", "must be less than or equal to 255, got 256", "schema"),
    Bad("exit-code-zero-with-in", put(f"{RULE}.onExitCodes.values", [0, 1]), f"{RULE}.onExitCodes.values",
        "exit code 0 (success) cannot be used with operator In", "cel"),
    Bad("exit-code-listed-twice", put(f"{RULE}.onExitCodes.values", [1, 2, 1]),
        f"{RULE}.onExitCodes.values[2]", "exit code 1 is listed twice", "schema"),
    Bad("no-exit-codes", put(f"{RULE}.onExitCodes.values", []), f"{RULE}.onExitCodes.values",
        "must have at least 1 item, got 0", "schema"),
    Bad("unknown-failure-reason", put(f"{RULE}.onReasons", ["Crash"]), f"{RULE}.onReasons[0]",
        "expected 'Exception', 'Hang', 'ProcessExited', 'OOMKilled', 'Evicted', 'PodLost' or 'NodeLost', "
        "got \"Crash\"",
        "schema"),
    Bad("typo-in-rule-field", put(f"{RULE}.onExitCode", {"operator": "In", "values": [1]}),
        f"{RULE}.onExitCode", "unknown field; did you mean 'onExitCodes'?", "schema"),
    # spec.runPolicy, spec.successPolicy
    Bad("unknown-clean-pod-policy", put("spec.runPolicy", {"cleanPodPolicy": "Finished"}),
        "spec.runPolicy.cleanPodPolicy", "expected 'All', 'Running' or 'None', got \"Finished\"", "schema"),
    Bad("zero-active-deadline", put("spec.runPolicy", {"activeDeadlineSeconds": 0}),
        "spec.runPolicy.activeDeadlineSeconds", "must be greater than or equal to 1, got 0", "schema"),
    Bad("negative-ttl", put("spec.runPolicy", {"ttlSecondsAfterFinished": -1}),
        "spec.runPolicy.ttlSecondsAfterFinished", "must be greater than or equal to 0, got -1", "schema"),
    Bad("suspend-not-boolean", put("spec.runPolicy", {"suspend": "maybe"}), "spec.runPolicy.suspend",
        "expected true or false, got a string \"maybe\"", "schema"),
    Bad("unknown-success-policy", put("spec.successPolicy", "AnyWorker"), "spec.successPolicy",
        "expected 'AllWorkers' or 'RankZero', got \"AnyWorker\"", "schema"),
    # spec.shmSize
    Bad("shm-size-not-a-quantity", put("spec.shmSize", "1 GB"), "spec.shmSize",
        "expected a quantity of bytes such as 1Gi, 512Mi or 2G, got '1 GB'", "schema"),
]

#: Malformed YAML: (id, text, line, column, part of the message).
MALFORMED: list[tuple[str, str, int, int, str]] = [
    ("unclosed-flow-sequence", "kind: TrainingJob\nspec:\n  replicas: [1, 2\n  spares: 1\n", 4, 9,
     "expected ',' or ']'"),
    ("bad-indentation", "kind: TrainingJob\nspec:\n  replicas: 1\n   spares: 1\n", 4, 10,
     "mapping values are not allowed here"),
    ("tab-indentation", "kind: TrainingJob\nspec:\n\treplicas: 1\n", 3, 1, "found character '\\t'"),
    ("unclosed-quote", "kind: \"TrainingJob\nspec: {}\n", 3, 1, "found unexpected end of stream"),
    ("duplicate-key", "kind: TrainingJob\nspec:\n  replicas: 1\n  replicas: 2\n", 4, 3,
     "found duplicate key 'replicas' (first at line 3)"),
]
