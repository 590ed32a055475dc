"""The Helm chart: lint, render and validate every manifest against the Kubernetes schemas, for the
values combinations users run; the security and availability properties the chart promises."""

from __future__ import annotations

import base64
from pathlib import Path
from typing import Any

import helm_python
import jsonschema
import kubernetes_validate
import pytest
import yaml
from helm_render import CHART_DIR, NAMESPACE, Render, documents, find, one, render_files

from stalwart.cli import build_parser
from stalwart.operator import provenance, rbac

REPO = CHART_DIR.parents[1]
# The oldest Kubernetes the chart declares (Chart.yaml kubeVersion; the CRD needs CEL rules with fieldPath)
# and the newest with schemas at hand.
KUBE_VERSIONS = ["1.29.0", kubernetes_validate.latest_version()]
MONITORING = ["monitoring.coreos.com/v1"]

# Values combinations users run; each must lint, render and validate.
COMBINATIONS: dict[str, dict[str, Any]] = {
    "defaults": {},
    "peering": {"operator": {"replicas": 2}},
    "namespaced": {"operator": {"watchNamespaces": ["team-a", "team-b"]}},
    "namespaced-peering": {"operator": {"replicas": 3, "watchNamespaces": ["team-a"]}},
    "volcano": {"operator": {"gangScheduler": "volcano"}},
    "privileged-pods-allowed": {"operator": {"restrictPodSecurity": False}},
    "baseline-pods": {"operator": {"podSecurity": "baseline"}},
    "metrics": {"metrics": {"enabled": True}},
    "etcd-1": {"etcd": {"enabled": True}},
    "etcd-3": {"etcd": {"enabled": True, "replicas": 3, "persistence": {"size": "10Gi", "storageClassName": "fast"}}},
    "etcd-plain": {"etcd": {"enabled": True, "security": {"enabled": False}, "networkPolicy": {"enabled": False}}},
    "etcd-own-certificates": {"etcd": {"enabled": True, "security": {"serverSecret": "etcd-certs", "jobUsers": False}}},
    "external-etcd": {"etcd": {"externalEndpoints": ["etcd-0.etcd.infra.svc:2379", "etcd-1.etcd.infra.svc:2379"]}},
    "digest": {"image": {"digest": "sha256:" + "ab" * 32}, "imagePullSecrets": [{"name": "registry"}]},
    "existing-account": {"serviceAccount": {"create": False, "name": "ops"}, "rbac": {"create": False}},
    "everything": {
        "operator": {"replicas": 2, "extraArgs": ["--verbose"], "extraEnv": [{"name": "X", "value": "1"}],
                     "nodeSelector": {"pool": "system"}, "tolerations": [{"key": "system", "operator": "Exists"}],
                     "priorityClassName": "system-cluster-critical", "podAnnotations": {"a": "b"}},
        "metrics": {"enabled": True, "serviceMonitor": {"labels": {"release": "prom"}}},
        "etcd": {"enabled": True, "replicas": 3},
    },
}


def kopf_peering_schemas() -> dict[str, dict[str, Any]]:
    schemas: dict[str, dict[str, Any]] = {}
    for crd in yaml.safe_load_all((CHART_DIR / "crds" / "kopfpeering.yaml").read_text()):
        schemas[crd["spec"]["names"]["kind"]] = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    return schemas


def validate(doc: dict[str, Any]) -> None:
    """Validate one manifest: Kubernetes kinds against the official schemas (strict: unknown fields fail)."""
    kind = doc["kind"]
    if doc["apiVersion"] == "kopf.dev/v1":
        jsonschema.validate(doc, kopf_peering_schemas()[kind])
        return
    if doc["apiVersion"] == "monitoring.coreos.com/v1":
        # No schema of the Prometheus operator's CRDs is at hand; check the fields it requires.
        assert kind in {"ServiceMonitor", "PodMonitor"}, kind
        if kind == "ServiceMonitor":
            assert doc["spec"]["selector"]["matchLabels"] and doc["spec"]["endpoints"]
        else:
            assert doc["spec"]["selector"]["matchExpressions"] and doc["spec"]["podMetricsEndpoints"]
        return
    for version in KUBE_VERSIONS:
        try:
            kubernetes_validate.validate(doc, version, strict=True)
        except kubernetes_validate.ValidationError as e:
            pytest.fail(f"{kind}/{doc['metadata']['name']} is invalid for Kubernetes {version}: {e.message}")


@pytest.mark.parametrize("combo", sorted(COMBINATIONS))
def test_lint_is_clean(combo: str) -> None:
    report = helm_python.lint(CHART_DIR, COMBINATIONS[combo], strict=True, namespace=NAMESPACE, kube_version="v1.29.0")
    problems = [m for m in report["messages"] if m["severity"] >= 2]
    assert report["errors"] == [] and problems == [], problems or report["errors"]


@pytest.mark.parametrize("combo", sorted(COMBINATIONS))
@pytest.mark.parametrize("monitoring", [False, True], ids=["plain", "prometheus-operator"])
def test_every_manifest_is_valid(render: Render, combo: str, monitoring: bool) -> None:
    docs = render(COMBINATIONS[combo], MONITORING if monitoring else None)
    assert docs
    for doc in docs:
        validate(doc)
    for doc in docs:
        labels = doc["metadata"].get("labels", {})
        assert labels.get("app.kubernetes.io/instance") == "demo", f"{doc['kind']} lacks the release labels"
        if doc["kind"] in {"ClusterRole", "ClusterRoleBinding", "ClusterKopfPeering"}:
            assert "namespace" not in doc["metadata"]
        elif doc["kind"] not in {"Role", "RoleBinding", "KopfPeering"}:  # these live in the watched namespaces
            assert doc["metadata"]["namespace"] == NAMESPACE


def test_names_are_unique(render: Render) -> None:
    docs = render(COMBINATIONS["everything"], MONITORING)
    keys = [(d["kind"], d["metadata"].get("namespace"), d["metadata"]["name"]) for d in docs]
    assert len(keys) == len(set(keys))


def operator_container(docs: list[dict[str, Any]]) -> dict[str, Any]:
    deployment = one(docs, "Deployment", "-operator")
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    return container


def test_operator_runs_locked_down(render: Render) -> None:
    docs = render()
    deployment = one(docs, "Deployment", "-operator")
    pod = deployment["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["runAsUser"] > 0
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    sc = operator_container(docs)["securityContext"]
    assert sc["readOnlyRootFilesystem"] is True
    assert sc["allowPrivilegeEscalation"] is False
    assert sc["privileged"] is False
    assert sc["capabilities"] == {"drop": ["ALL"]}
    # The read-only root filesystem leaves Python a writable /tmp only.
    assert {"name": "tmp", "mountPath": "/tmp"} in operator_container(docs)["volumeMounts"]


def test_every_replica_reads_one_adoption_key_from_a_secret_of_the_chart(render: Render) -> None:
    # The operator adopts a job's Secret only with its mark, whose key must be the same for every replica and
    # every run (issue 31, finding 8): a Secret of the chart's namespace, mounted read-only, named by the flag's
    # variable, long enough for provenance.load_key.
    docs = render({"operator": {"replicas": 2}})
    secret = one(docs, "Secret", "-operator-key")
    assert len(base64.b64decode(secret["data"]["adoption-key"])) >= provenance.KEY_BYTES
    container = operator_container(docs)
    env = {e["name"]: e.get("value") for e in container["env"]}
    mount = next(m for m in container["volumeMounts"] if m["name"] == "operator-key")
    assert mount["readOnly"] is True and env["STALWART_ADOPTION_KEY_FILE"] == mount["mountPath"] + "/adoption-key"
    volumes = one(docs, "Deployment", "-operator")["spec"]["template"]["spec"]["volumes"]
    assert {"name": "operator-key", "secret": {"secretName": secret["metadata"]["name"]}} in volumes


def test_operator_probes_and_resources(render: Render) -> None:
    container = operator_container(render({"operator": {"healthPort": 8181}}))
    assert container["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "health"}
    assert container["readinessProbe"]["httpGet"] == {"path": "/healthz", "port": "health"}
    assert {"name": "health", "containerPort": 8181, "protocol": "TCP"} in container["ports"]
    assert "--health-port=8181" in container["args"]
    assert set(container["resources"]) == {"requests", "limits"}
    assert container["resources"]["limits"]["memory"]


def test_single_operator_is_standalone_and_never_overlaps(render: Render) -> None:
    docs = render()
    deployment = one(docs, "Deployment", "-operator")
    assert deployment["spec"]["strategy"] == {"type": "Recreate"}
    assert "--standalone" in operator_container(docs)["args"]
    assert find(docs, "ClusterKopfPeering") == [] and find(docs, "KopfPeering") == []


def test_several_operators_use_peering(render: Render) -> None:
    docs = render({"operator": {"replicas": 3}})
    deployment = one(docs, "Deployment", "-operator")
    assert deployment["spec"]["replicas"] == 3
    assert deployment["spec"]["strategy"]["type"] == "RollingUpdate"
    peering = one(docs, "ClusterKopfPeering")
    args = operator_container(docs)["args"]
    assert f"--peering={peering['metadata']['name']}" in args and "--standalone" not in args
    # Each replica is a distinct peer, named after its pod.
    env = {e["name"]: e for e in operator_container(docs)["env"]}
    assert env["POD_ID"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
    # kopf reads and patches the peering object.
    cluster_rules = one(docs, "ClusterRole", "-operator-cluster")["rules"]
    assert {"apiGroups": ["kopf.dev"], "resources": ["clusterkopfpeerings"],
            "verbs": ["list", "watch", "patch"]} in cluster_rules
    pod = deployment["spec"]["template"]["spec"]
    assert pod["affinity"]["podAntiAffinity"], "standby replicas belong on other nodes"


def test_namespaced_peering_lives_in_each_watched_namespace(render: Render) -> None:
    docs = render({"operator": {"replicas": 2, "watchNamespaces": ["team-a", "team-b"]}})
    assert sorted(p["metadata"]["namespace"] for p in find(docs, "KopfPeering")) == ["team-a", "team-b"]
    assert find(docs, "ClusterKopfPeering") == []


def test_watch_namespaces_limits_rbac_to_them(render: Render) -> None:
    docs = render({"operator": {"watchNamespaces": ["team-a", "team-b"]}})
    args = operator_container(docs)["args"]
    assert "--namespace=team-a" in args and "--namespace=team-b" in args and "--all-namespaces" not in args
    roles = find(docs, "Role")
    assert sorted(r["metadata"]["namespace"] for r in roles) == ["team-a", "team-b"]
    assert sorted(b["metadata"]["namespace"] for b in find(docs, "RoleBinding")) == ["team-a", "team-b"]
    # No job-level permission is granted cluster-wide.
    (cluster_role,) = operator_roles(docs, "ClusterRole")
    granted = {r for rule in cluster_role["rules"] for r in rule["resources"]}
    assert granted == {"customresourcedefinitions", "namespaces", "nodes"}


def operator_roles(docs: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    """The operator's own roles of ``kind`` (not the aggregated user roles)."""
    return [d for d in find(docs, kind) if d["metadata"]["labels"].get("app.kubernetes.io/component") == "operator"]


def granted(docs: list[dict[str, Any]], kinds: set[str]) -> dict[tuple[str, str], set[str]]:
    out: dict[tuple[str, str], set[str]] = {}
    for role in (d for d in docs if d["kind"] in kinds
                 and d["metadata"]["labels"].get("app.kubernetes.io/component") == "operator"):
        for rule in role["rules"]:
            for group in rule["apiGroups"]:
                for resource in rule["resources"]:
                    out.setdefault((group, resource), set()).update(rule["verbs"])
    return out


@pytest.mark.parametrize("gang", ["", "volcano", "coscheduling"])
@pytest.mark.parametrize("replicas", [1, 2])
@pytest.mark.parametrize("namespaces", [[], ["team-a", "team-b"]], ids=["clusterwide", "namespaced"])
def test_rbac_is_exactly_what_the_operator_calls(render: Render, replicas: int, namespaces: list[str],
                                                 gang: str) -> None:
    docs = render({"operator": {"replicas": replicas, "watchNamespaces": namespaces, "gangScheduler": gang}})
    wanted = rbac.required(peering=replicas > 1, clusterwide=not namespaces, gang=gang or None)
    assert granted(docs, {"ClusterRole", "Role"}) == wanted
    args = operator_container(docs)["args"]
    assert (f"--gang-scheduler={gang}" in args) == bool(gang)
    cluster_scoped = {(p.api_group, p.resource) for p in rbac.PERMISSIONS if p.scope == "cluster"}
    if namespaces:
        # Namespaced permissions come from a Role in each served namespace, and from nothing cluster-wide.
        assert set(granted(docs, {"ClusterRole"})) <= cluster_scoped
        for ns in namespaces:
            in_ns = [d for d in docs if d["kind"] == "Role" and d["metadata"]["namespace"] == ns]
            assert set(granted(in_ns, {"Role"})) == set(wanted) - cluster_scoped
    else:
        assert find(docs, "Role") == []


def test_default_roles_gain_trainingjobs_by_aggregation(render: Render) -> None:
    docs = render()
    roles = {d["metadata"]["name"].rsplit("-", 1)[-1]: d for d in find(docs, "ClusterRole")
             if d["metadata"]["labels"].get("app.kubernetes.io/component") == "user-roles"}
    assert set(roles) == {"editor", "viewer"}
    labels = {k for k, v in roles["editor"]["metadata"]["labels"].items() if v == "true"}
    assert {"rbac.authorization.k8s.io/aggregate-to-edit", "rbac.authorization.k8s.io/aggregate-to-admin"} <= labels
    assert roles["viewer"]["metadata"]["labels"]["rbac.authorization.k8s.io/aggregate-to-view"] == "true"
    viewer = {v for rule in roles["viewer"]["rules"] for v in rule["verbs"]}
    assert viewer == {"get", "list", "watch"}  # view never writes
    editor = {(r, v) for rule in roles["editor"]["rules"] for r in rule["resources"] for v in rule["verbs"]}
    assert ("trainingjobs", "create") in editor and ("trainingjobs/status", "patch") not in editor
    assert not [d for d in render({"rbac": {"aggregateToDefaultRoles": False}}) if d["kind"] == "ClusterRole"
                and d["metadata"]["labels"].get("app.kubernetes.io/component") == "user-roles"]


def test_rbac_is_least_privilege(render: Render) -> None:
    for combo in COMBINATIONS.values():
        for role in [*find(render(combo), "ClusterRole"), *find(render(combo), "Role")]:
            for rule in role["rules"]:
                assert "*" not in rule["verbs"] and "*" not in rule["resources"] and "*" not in rule["apiGroups"]
                assert not {"escalate", "bind", "impersonate", "deletecollection"} & set(rule["verbs"])
                if "secrets" in rule["resources"]:
                    # The operator creates one Secret per job and reads named ones; it never lists, rewrites or
                    # patches Secrets.
                    assert not {"update", "patch", "list", "watch"} & set(rule["verbs"])
    docs = render()
    sa = one(docs, "ServiceAccount")
    for binding in find(docs, "ClusterRoleBinding"):
        assert binding["subjects"] == [{"kind": "ServiceAccount", "name": sa["metadata"]["name"],
                                        "namespace": NAMESPACE}]
    assert one(docs, "Deployment")["spec"]["template"]["spec"]["serviceAccountName"] == sa["metadata"]["name"]


def test_existing_service_account_and_no_rbac(render: Render) -> None:
    docs = render(COMBINATIONS["existing-account"])
    assert find(docs, "ServiceAccount") == [] and find(docs, "ClusterRole") == []
    assert one(docs, "Deployment")["spec"]["template"]["spec"]["serviceAccountName"] == "ops"


def test_missing_service_account_name_is_refused(chart: helm_python.Chart) -> None:
    with pytest.raises(helm_python.HelmRenderError, match=r"serviceAccount\.name is required"):
        render_files(chart, {"serviceAccount": {"create": False}})


def test_metrics_service_and_service_monitor_only_with_its_api(render: Render) -> None:
    assert find(render(), "Service") == []
    without = render({"metrics": {"enabled": True}})
    service = one(without, "Service", "-operator-metrics")
    assert find(without, "ServiceMonitor") == []
    assert "--metrics-port=9090" in operator_container(without)["args"]
    assert {"name": "metrics", "containerPort": 9090, "protocol": "TCP"} in operator_container(without)["ports"]
    with_api = render({"metrics": {"enabled": True}}, MONITORING)
    monitor = one(with_api, "ServiceMonitor")
    # The ServiceMonitor selects the metrics Service and scrapes its named port.
    selector = monitor["spec"]["selector"]["matchLabels"]
    assert selector.items() <= service["metadata"]["labels"].items()
    assert monitor["spec"]["endpoints"][0]["port"] == service["spec"]["ports"][0]["name"]
    # The Service reaches the operator pods.
    pod_labels = one(with_api, "Deployment")["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= pod_labels.items()
    assert find(render({"metrics": {"enabled": True, "serviceMonitor": {"enabled": False}}}, MONITORING),
                "ServiceMonitor") == []


def etcd_args(statefulset: dict[str, Any]) -> dict[str, str]:
    (container,) = statefulset["spec"]["template"]["spec"]["containers"]
    return dict(arg.removeprefix("--").split("=", 1) for arg in container["args"])


@pytest.mark.parametrize("members", [1, 3])
def test_bundled_etcd(render: Render, members: int) -> None:
    docs = render({"etcd": {"enabled": True, "replicas": members}})
    sts = one(docs, "StatefulSet", "-etcd")
    name = sts["metadata"]["name"]
    assert sts["spec"]["replicas"] == members
    assert sts["spec"]["podManagementPolicy"] == "Parallel"
    headless = one(docs, "Service", "-etcd")
    assert headless["spec"]["clusterIP"] == "None" and sts["spec"]["serviceName"] == headless["metadata"]["name"]
    args = etcd_args(sts)
    hosts = [f"{name}-{i}.{name}.{NAMESPACE}.svc" for i in range(members)]
    assert args["initial-cluster"] == ",".join(f"{name}-{i}=https://{h}:2380" for i, h in enumerate(hosts))
    assert args["initial-cluster-state"] == "new"
    # Data lives on a persistent volume, the only writable path of the container.
    (claim,) = sts["spec"]["volumeClaimTemplates"]
    assert claim["spec"]["resources"]["requests"]["storage"] == "2Gi"
    (container,) = sts["spec"]["template"]["spec"]["containers"]
    assert args["data-dir"].startswith(container["volumeMounts"][0]["mountPath"] + "/")
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    # Jobs that name no endpoints get every member.
    env = {e["name"]: e.get("value") for e in operator_container(docs)["env"]}
    assert env["STALWART_DEFAULT_ETCD_ENDPOINTS"] == ",".join(f"{h}:2379" for h in hosts)
    pdbs = find(docs, "PodDisruptionBudget")
    if members == 3:
        assert one(docs, "PodDisruptionBudget")["spec"]["minAvailable"] == 2
    else:
        assert pdbs == []


def test_external_etcd_is_the_default_and_no_etcd_is_deployed(render: Render) -> None:
    docs = render(COMBINATIONS["external-etcd"])
    assert find(docs, "StatefulSet") == []
    env = {e["name"]: e.get("value") for e in operator_container(docs)["env"]}
    assert env["STALWART_DEFAULT_ETCD_ENDPOINTS"] == "etcd-0.etcd.infra.svc:2379,etcd-1.etcd.infra.svc:2379"
    assert "STALWART_DEFAULT_ETCD_ENDPOINTS" not in {e["name"] for e in operator_container(render())["env"]}


def test_image_by_tag_or_digest(render: Render, chart: helm_python.Chart) -> None:
    assert operator_container(render())["image"] == f"stalwart/operator:{chart.metadata['appVersion']}"
    assert operator_container(render({"image": {"tag": "0.2.0"}}))["image"] == "stalwart/operator:0.2.0"
    digest = "sha256:" + "ab" * 32
    assert operator_container(render({"image": {"tag": "0.2.0", "digest": digest}}))["image"] == \
        f"stalwart/operator@{digest}"


@pytest.mark.parametrize(("values", "message"), [
    ({"operator": {"replicas": 0}}, "/operator/replicas"),
    ({"etcd": {"replicas": 2}}, "/etcd/replicas"),
    ({"operatr": {"replicas": 1}}, "'operatr' not allowed"),
    ({"operator": {"logLevel": "LOUD"}}, "/operator/logLevel"),
    ({"operator": {"healthPort": 70000}}, "/operator/healthPort"),
    ({"operator": {"securityContext": {"privileged": True}}}, "/operator/securityContext/privileged"),
    ({"operator": {"podSecurityContext": {"runAsNonRoot": False}}}, "/operator/podSecurityContext/runAsNonRoot"),
    ({"etcd": {"externalEndpoints": ["http://etcd:2379"]}}, "/etcd/externalEndpoints/0"),
    ({"image": {"digest": "latest"}}, "/image/digest"),
    ({"metrics": {"enabled": "yes"}}, "/metrics/enabled"),
    ({"operator": {"gangScheduler": "kueue"}}, "/operator/gangScheduler"),
])
def test_schema_refuses_bad_values_naming_the_field(chart: helm_python.Chart, values: dict[str, Any],
                                                    message: str) -> None:
    with pytest.raises(helm_python.HelmValuesError) as err:
        chart.validate_schema(values)
    assert message in str(err.value)


def test_notes_tell_where_etcd_is(chart: helm_python.Chart) -> None:
    notes = render_files(chart, {"etcd": {"enabled": True, "replicas": 3}})["stalwart/templates/NOTES.txt"]
    assert "demo-stalwart-etcd-0.demo-stalwart-etcd.stalwart-system.svc:2379" in notes
    assert "kubectl get tj" in notes
    plain = render_files(chart)["stalwart/templates/NOTES.txt"]
    assert "every TrainingJob must set spec.rendezvous.endpoints" in plain
    # Each remedy is a command as written: a bare etcd.externalEndpoints=... is no helm flag.
    assert '--set "etcd.externalEndpoints={host:port,...}"' in plain


def test_chart_crds_are_valid_custom_resource_definitions(chart: helm_python.Chart) -> None:
    names = set()
    for crd in chart.crds:
        for doc in yaml.safe_load_all(crd["data"]):
            validate(doc)
            names.add(doc["metadata"]["name"])
    assert {"clusterkopfpeerings.kopf.dev", "kopfpeerings.kopf.dev"} <= names


def test_chart_crd_is_the_repository_crd() -> None:
    """The chart installs exactly the CRD generated from the API models (`stalwart crd` > crds/trainingjob.yaml)."""
    source = REPO / "crds" / "trainingjob.yaml"
    copy = CHART_DIR / "crds" / "trainingjob.yaml"
    assert copy.read_bytes() == source.read_bytes(), f"{copy} differs from {source}: copy it over"


def test_long_release_names_stay_within_dns_limits(chart: helm_python.Chart) -> None:
    long_name = "a-very-long-release-name-for-the-training-platform"
    values = {"etcd": {"enabled": True, "replicas": 3}, "metrics": {"enabled": True}, "operator": {"replicas": 2}}
    docs = documents(render_files(chart, values, MONITORING, release=long_name))
    for doc in docs:
        assert len(doc["metadata"]["name"]) <= 63, doc["metadata"]["name"]
    # A StatefulSet labels its pods controller-revision-hash=<name>-<10 characters>, a 63-character label value.
    assert len(one(docs, "StatefulSet")["metadata"]["name"]) <= 63 - 11


def test_no_template_file_is_unused() -> None:
    for path in (CHART_DIR / "templates").iterdir():
        assert path.suffix in {".yaml", ".tpl", ".txt"}, path
    assert Path(CHART_DIR / "values.schema.json").is_file()


@pytest.mark.parametrize("combo", sorted(COMBINATIONS))
def test_operator_command_line_is_what_stalwart_operator_accepts(render: Render, combo: str) -> None:
    container = operator_container(render(COMBINATIONS[combo]))
    assert container["command"] == ["stalwart"]
    args = [a for a in container["args"] if a != "--verbose"]  # an extraArgs example, not an operator flag
    parsed = build_parser().parse_args(args)
    assert parsed.command == "operator"
    values = COMBINATIONS[combo]
    operator = values.get("operator", {})
    assert parsed.namespace == operator.get("watchNamespaces", [])
    assert (parsed.peering is not None) == (operator.get("replicas", 1) > 1)
    assert parsed.metrics_port == (9090 if values.get("metrics", {}).get("enabled") else None)
    assert parsed.gang_scheduler == (operator.get("gangScheduler") or None)
    expected = "off" if operator.get("restrictPodSecurity") is False else operator.get("podSecurity", "restricted")
    assert parsed.pod_security == expected and parsed.restrict_pod_security is None


def test_notes_tell_where_the_agents_serve_their_metrics(chart: helm_python.Chart) -> None:
    notes = render_files(chart, {"metrics": {"enabled": True}})["stalwart/templates/NOTES.txt"]
    assert "Agents' metrics: every job pod's container port agent-metrics (9400), path /metrics" in notes
    assert "no PodMonitor was created" in notes  # the rendering here serves no monitoring.coreos.com/v1
    off = render_files(chart, {"metrics": {"enabled": True, "agents": {"enabled": False}}})
    assert "Agents' metrics" not in off["stalwart/templates/NOTES.txt"]
