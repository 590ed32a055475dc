"""The operator's identity in the operator tests: the Helm chart's ServiceAccount and RBAC, rendered by the real
Helm library exactly as ``helm install --set operator.watchNamespaces={ns}`` renders them, applied to the local
cluster, and a kubeconfig with a token the API server issued for that ServiceAccount. So every call the operator
makes in a test is authorized by the chart's rules, and recorded by the API server under the account's name."""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import helm_python
import yaml

from stalwart.local.cluster import LocalCluster
from stalwart.operator import provenance, rbac
from stalwart.operator.embedded import EmbeddedOperator
from stalwart.operator.handlers import OperatorRunConfig
from stalwart.operator.model import ReconcileSettings

CHART = Path(__file__).resolve().parents[2] / "helm" / "stalwart"
NAMESPACE = "stalwart-system"
RELEASE = "ops"
RBAC_KINDS = ("ServiceAccount", "ClusterRole", "ClusterRoleBinding", "Role", "RoleBinding")
JSON = dict[str, Any]
Grant = tuple[str, str, str]  # api group, resource[/subresource], verb


def render(chart: helm_python.Chart, values: JSON) -> list[JSON]:
    """The chart's ServiceAccount and RBAC documents for ``values``."""
    files = chart.render(values, name=RELEASE, namespace=NAMESPACE, is_install=True)
    docs = [d for path, text in sorted(files.items()) if not path.endswith("NOTES.txt")
            for d in yaml.safe_load_all(text) if d]
    return [d for d in docs if d["kind"] in RBAC_KINDS
            and (d.get("metadata", {}).get("labels") or {}).get("app.kubernetes.io/component") != "user-roles"]


def without_verb(docs: list[JSON], resource: str, verb: str) -> list[JSON]:
    """``docs`` with ``verb`` taken off every rule that grants it on ``resource``."""
    out = copy.deepcopy(docs)
    for doc in out:
        for rule in doc.get("rules") or []:
            if resource in rule.get("resources", []) and verb in rule.get("verbs", []):
                rule["verbs"] = [v for v in rule["verbs"] if v != verb]
    return out


@dataclass
class OperatorAccount:
    """A ServiceAccount the operator runs as, with the chart's cluster-wide rules bound to it."""
    cluster: LocalCluster
    chart: helm_python.Chart
    name: str
    kubeconfig: Path
    #: Edits the rendered documents before they are applied (e.g. :func:`without_verb`).
    edit: Callable[[list[JSON]], list[JSON]] = lambda docs: docs

    @property
    def user(self) -> str:
        return f"system:serviceaccount:{NAMESPACE}:{self.name}"

    def _values(self, namespace: str, peering: bool, gang: str | None) -> JSON:
        return {"operator": {"watchNamespaces": [namespace], "replicas": 2 if peering else 1,
                             "gangScheduler": gang or ""},
                "serviceAccount": {"name": self.name}}

    def grant(self, namespace: str, *, peering: bool = False, gang: str | None = None) -> None:
        """Apply the chart's Role and RoleBinding for an operator serving ``namespace`` (configured so)."""
        docs = [d for d in self.edit(render(self.chart, self._values(namespace, peering, gang)))
                if d["kind"] in ("Role", "RoleBinding")]
        self.cluster.kubectl("apply", "-f", "-", input=yaml.safe_dump_all(docs))

    @classmethod
    def create(cls, cluster: LocalCluster, chart: helm_python.Chart, name: str, directory: Path,
               edit: Callable[[list[JSON]], list[JSON]] = lambda docs: docs) -> OperatorAccount:
        """The chart's ServiceAccount (named ``name``) with its ClusterRole and binding, and a kubeconfig for it."""
        cluster.kubectl("apply", "-f", "-", input=f"apiVersion: v1\nkind: Namespace\nmetadata: {{name: {NAMESPACE}}}\n")
        account = cls(cluster, chart, name, directory / f"{name}.kubeconfig", edit)
        values = account._values("unused", False, None)
        docs = [d for d in edit(render(chart, values)) if d["kind"] in ("ServiceAccount", "ClusterRole",
                                                                         "ClusterRoleBinding")]
        for doc in docs:  # one release's cluster-wide objects per account
            if doc["kind"] != "ServiceAccount":
                doc["metadata"]["name"] = f"{doc['metadata']['name']}-{name}"
            if doc["kind"] == "ClusterRoleBinding":
                doc["roleRef"]["name"] = f"{doc['roleRef']['name']}-{name}"
        cluster.kubectl("apply", "-f", "-", input=yaml.safe_dump_all(docs))
        config = cluster.service_account_kubeconfig(NAMESPACE, name, seconds=24 * 3600)
        account.kubeconfig.touch(mode=0o600)
        account.kubeconfig.write_text(yaml.safe_dump(config))
        return account


OperatorFactory = Callable[..., EmbeddedOperator]
#: The adoption key of every operator the tests start (as the chart's Secret gives every replica and run one):
#: an operator restarted in a test adopts the Secrets its predecessor made.
ADOPTION_KEY = provenance.new_key()


def operator_factory(account: OperatorAccount, etcd_endpoint: str) -> tuple[OperatorFactory, list[EmbeddedOperator]]:
    """``start(namespace, **OperatorRunConfig fields)``, which grants the account the chart's Role in ``namespace``
    and starts an embedded operator serving it as the account; and the list of those started (to stop)."""
    started: list[EmbeddedOperator] = []

    def start(namespace: str, **overrides: Any) -> EmbeddedOperator:
        settings = overrides.pop("settings", ReconcileSettings(status_interval=0.5))
        overrides.setdefault("default_endpoints", (etcd_endpoint,))
        overrides.setdefault("adoption_key", ADOPTION_KEY)
        config = OperatorRunConfig(namespaces=(namespace,), settings=settings, **overrides)
        account.grant(namespace, peering=config.peering is not None, gang=config.gang_scheduler)
        op = EmbeddedOperator(config, str(account.kubeconfig)).start()
        started.append(op)
        return op

    return start, started


def used(cluster: LocalCluster, user: str) -> tuple[set[Grant], set[Grant]]:
    """What ``user`` was allowed and refused, as the API server recorded it."""
    allowed: set[Grant] = set()
    refused: set[Grant] = set()
    for a in cluster.access(user):
        if not a["resource"]:
            continue  # a path outside the API's resources (discovery, version): every account may read those
        resource = f"{a['resource']}/{a['subresource']}" if a["subresource"] else a["resource"]
        (allowed if a["allowed"] else refused).add((a["group"], resource, a["verb"]))
    return allowed, refused


class AccessLog:
    """What the account was allowed, as the API server recorded it, kept by this process after each operator test
    (:meth:`note`): what test_zz_rbac.py checks is then every call the operator tests of this worker made, and
    which tests those were, whatever became of the server's own record in between."""

    def __init__(self) -> None:
        self.allowed: set[Grant] = set()
        self.tests: list[str] = []

    def note(self, cluster: LocalCluster, user: str, test: str) -> None:
        self.allowed |= used(cluster, user)[0]
        self.tests.append(test)


#: This process's (one xdist worker's) record of the chart account's calls.
ACCESS_LOG = AccessLog()


def declared(**config: Any) -> set[Grant]:
    return {(group, resource, verb) for (group, resource), verbs in rbac.required(**config).items() for verb in verbs}


def misused(cluster: LocalCluster, user: str) -> list[str]:
    """What is wrong with ``user``'s calls so far, whichever tests made them: any the API server refused (the
    chart's RBAC lacks it), any rbac.py does not declare. test_zz_rbac.py checks this (and more) after the
    operator tests; under xdist each worker has a cluster of its own and only one runs that module, so the
    ``operator_account`` fixture checks its own cluster's record at the end of each worker's session too."""
    allowed, refused = used(cluster, user)
    possible = declared(peering=True, clusterwide=False, gang="coscheduling") | declared(
        peering=True, clusterwide=False, gang="volcano")
    problems = []
    if refused:
        problems.append(f"the operator was refused {sorted(refused)}: the chart's RBAC lacks them")
    if allowed - possible:
        problems.append(f"calls rbac.py does not declare: {sorted(allowed - possible)}")
    return problems
