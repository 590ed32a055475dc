"""Server-side apply with field managers through the real kubectl, and CustomResourceDefinitions checked when
they are stored: conflicts with the managers and fields named as a real API server names them, ``--force-conflicts``
taking ownership, shared ownership of equal values; non-structural schemas and CEL rules that do not compile
refused with 422."""

from __future__ import annotations

import json

import pytest
import yaml

from stalwart.local.cluster import LocalCluster

pytestmark = pytest.mark.integration


def deployment(ns: str, replicas: int, image: str = "busybox:1") -> str:
    return yaml.safe_dump({
        "apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "web", "namespace": ns},
        "spec": {"replicas": replicas, "selector": {"matchLabels": {"app": "web"}},
                 "template": {"metadata": {"labels": {"app": "web"}},
                              "spec": {"containers": [{"name": "web", "image": image, "command": ["sleep", "300"]}]}}}})


def managers(cluster: LocalCluster, ns: str) -> dict[tuple[str, str], str]:
    """(manager, subresource) -> the fields it owns (FieldsV1 as JSON text)."""
    obj = json.loads(cluster.kubectl("get", "deployment", "web", "-n", ns, "-o", "json", "--show-managed-fields")
                     .stdout)
    return {(m["manager"], m.get("subresource", "")): json.dumps(m["fieldsV1"])
            for m in obj["metadata"]["managedFields"] if m.get("subresource") != "status"}


def test_apply_conflicts_name_the_other_manager_and_force_takes_over(local_cluster: LocalCluster,
                                                                     k8s_namespace: str) -> None:
    ns = k8s_namespace
    local_cluster.kubectl("create", "-f", "-", input=deployment(ns, 1))
    local_cluster.kubectl("scale", "deployment", "web", "-n", ns, "--replicas=2")
    owners = managers(local_cluster, ns)
    assert set(owners) == {("kubectl-create", ""), ("kubectl", "scale")}
    assert '"f:replicas"' in owners[("kubectl", "scale")] and '"f:replicas"' not in owners[("kubectl-create", "")]

    # Applying the values they hold shares them; changing values other managers set is a conflict naming them.
    local_cluster.kubectl("apply", "--server-side", "--field-manager=ci", "-f", "-", input=deployment(ns, 2))
    clash = local_cluster.kubectl("apply", "--server-side", "--field-manager=ci", "-f", "-",
                                  input=deployment(ns, 3, "busybox:2"), check=False)
    assert clash.returncode == 1
    lines = clash.stderr.strip().splitlines()
    assert "Apply failed with 2 conflicts: conflicts with \"kubectl\" with subresource \"scale\" using apps/v1" in (
        lines[0])
    assert lines[1:3] == ["- .spec.replicas", 'conflicts with "kubectl-create" using apps/v1 at ' + lines[2].split(
        " at ")[-1]] and lines[3] == '- .spec.template.spec.containers[name="web"].image'
    assert json.loads(local_cluster.kubectl("get", "deployment", "web", "-n", ns, "-o", "json").stdout)[
        "spec"]["replicas"] == 2  # nothing changed

    local_cluster.kubectl("apply", "--server-side", "--field-manager=ci", "--force-conflicts", "-f", "-",
                          input=deployment(ns, 3, "busybox:2"))
    obj = json.loads(local_cluster.kubectl("get", "deployment", "web", "-n", ns, "-o", "json",
                                           "--show-managed-fields").stdout)
    assert obj["spec"]["replicas"] == 3
    owners = {m["manager"]: json.dumps(m["fieldsV1"]) for m in obj["metadata"]["managedFields"]
              if m.get("subresource") != "status"}
    assert '"f:replicas"' in owners["ci"] and "kubectl" not in owners  # the scaler owned nothing else
    # Now the scaler is the one in conflict... but a plain update (not an apply) always wins and takes over.
    local_cluster.kubectl("scale", "deployment", "web", "-n", ns, "--replicas=1")
    again = local_cluster.kubectl("apply", "--server-side", "--field-manager=ci", "-f", "-",
                                  input=deployment(ns, 3, "busybox:2"), check=False)
    assert 'Apply failed with 1 conflict: conflict with "kubectl" with subresource "scale" using apps/v1' in (
        again.stderr)
    assert again.stderr.splitlines()[0].endswith(": .spec.replicas")  # kubectl adds its advice below


CRD = """
apiVersion: apiextensions.k8s.io/v1
kind: CustomResourceDefinition
metadata: {name: gadgets.example.dev}
spec:
  group: example.dev
  scope: Namespaced
  names: {plural: gadgets, singular: gadget, kind: Gadget}
  versions:
  - name: v1
    served: true
    storage: true
    schema:
      openAPIV3Schema:
        type: object
        properties:
          spec:
            type: object
            x-kubernetes-validations:
            - rule: RULE
            properties:
              size: {type: integer}
              color: COLOR
"""


def test_crds_are_checked_when_stored(local_cluster: LocalCluster) -> None:
    def create(rule: str, color: str = "{type: string}") -> str:
        text = CRD.replace("RULE", json.dumps(rule)).replace("COLOR", color)
        result = local_cluster.kubectl("create", "--dry-run=server", "-f", "-", input=text, check=False)
        return str(result.stderr.strip()) if result.returncode else ""

    assert create("self.size >= 0") == ""
    untyped = create("self.size >= 0", color="{description: no type}")
    assert untyped == ('The CustomResourceDefinition "gadgets.example.dev" is invalid: spec.versions[0].schema.'
                       "openAPIV3Schema.properties[spec].properties[color].type: Required value: must not be empty "
                       "for specified object fields")
    syntax = create("self.size >== 0")
    assert "spec.versions[0].schema.openAPIV3Schema.properties[spec].x-kubernetes-validations[0].rule: " in syntax
    assert "compilation failed: ERROR: <input>:1:" in syntax and "Syntax error" in syntax
    typo = create("self.sise >= 0")
    assert "undefined field 'sise'" in typo
    assert "no matching" not in create("self.color.startsWith('r')")
    assert local_cluster.kubectl("get", "crd", "gadgets.example.dev", check=False).returncode == 1  # dry runs
