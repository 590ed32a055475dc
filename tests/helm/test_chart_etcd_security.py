"""The chart's bundled etcd is secured: client and peer TLS with certificates the chart makes, authentication
with a root login the operator holds, one etcd user per job, and a NetworkPolicy admitting only the operator,
the jobs' pods and the members."""

from __future__ import annotations

import base64
import datetime
import ipaddress
from typing import Any

from cryptography import x509
from helm_render import NAMESPACE, Render, find, one

from stalwart.api import naming

ETCD = {"etcd": {"enabled": True, "replicas": 3}}


def _etcd_container(docs: list[dict[str, Any]]) -> dict[str, Any]:
    (container,) = one(docs, "StatefulSet", "-etcd")["spec"]["template"]["spec"]["containers"]
    return container


def _args(container: dict[str, Any]) -> dict[str, str]:
    return dict(arg.removeprefix("--").split("=", 1) for arg in container["args"])


def _operator(docs: list[dict[str, Any]]) -> dict[str, Any]:
    spec: dict[str, Any] = one(docs, "Deployment", "-operator")["spec"]["template"]["spec"]
    return spec


def test_members_speak_tls_only_and_require_client_certificates(render: Render) -> None:
    docs = render(ETCD)
    args = _args(_etcd_container(docs))
    assert args["listen-client-urls"] == "https://0.0.0.0:2379"
    assert args["advertise-client-urls"].startswith("https://") and args["listen-peer-urls"].startswith("https://")
    assert all(peer.split("=", 1)[1].startswith("https://") for peer in args["initial-cluster"].split(","))
    assert args["client-cert-auth"] == "true" and args["peer-client-cert-auth"] == "true"
    assert args["trusted-ca-file"] == args["peer-trusted-ca-file"] == "/etc/etcd/tls/ca.crt"
    assert args["listen-metrics-urls"] == "http://0.0.0.0:2381"  # probes; no keys there
    sts_spec = one(docs, "StatefulSet", "-etcd")["spec"]["template"]["spec"]
    (volume,) = sts_spec["volumes"]
    assert volume["secret"]["secretName"].endswith("-etcd-server-tls")


def test_the_generated_server_certificate_covers_every_member_and_chains_to_the_ca(render: Render) -> None:
    docs = render(ETCD)
    secret = one(docs, "Secret", "-etcd-server-tls")
    data = {k: base64.b64decode(v) for k, v in secret["data"].items()}
    assert set(data) == {"ca.crt", "tls.crt", "tls.key", "client.crt", "client.key", "job-client.crt",
                         "job-client.key"}
    ca = x509.load_pem_x509_certificate(data["ca.crt"])
    server = x509.load_pem_x509_certificate(data["tls.crt"])
    names = server.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    dns = names.get_values_for_type(x509.DNSName)
    name = secret["metadata"]["name"].removesuffix("-server-tls")
    member = f"{name}-2.{name}.{NAMESPACE}.svc"
    assert any(member == d or (d.startswith("*.") and member.split(".", 1)[1] == d[2:]) for d in dns), dns
    assert ipaddress.ip_address("127.0.0.1") in names.get_values_for_type(x509.IPAddress)
    assert server.issuer == ca.subject
    server.verify_directly_issued_by(ca)
    x509.load_pem_x509_certificate(data["client.crt"]).verify_directly_issued_by(ca)
    # Job pods get a certificate of their own, never the operator's, and its CN is no etcd user (issue 31).
    job = x509.load_pem_x509_certificate(data["job-client.crt"])
    job.verify_directly_issued_by(ca)
    assert data["job-client.crt"] != data["client.crt"] and data["job-client.key"] != data["client.key"]
    assert job.subject.rfc4514_string() == f"CN={name}-job-client"
    assert server.not_valid_after_utc > datetime.datetime.now(datetime.UTC) + datetime.timedelta(days=365)


def test_the_operator_logs_in_as_root_from_files_and_gives_each_job_a_user(render: Render) -> None:
    docs = render(ETCD)
    login = one(docs, "Secret", "-etcd-client")
    assert base64.b64decode(login["data"]["username"]) == b"root"
    assert len(base64.b64decode(login["data"]["password"])) == 32
    pod = _operator(docs)
    (container,) = pod["containers"]
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["STALWART_ETCD_TLS"] == "true" and env["STALWART_ETCD_SECRET_DIR"] == "/etc/stalwart/etcd"
    assert env["STALWART_JOB_ETCD_USERS"] == "true" and env["STALWART_ETCD_ENABLE_AUTH"] == "true"
    assert not any("password" in str(e).lower() for e in container["env"])  # the secret stays in files
    mount = next(m for m in container["volumeMounts"] if m["mountPath"] == "/etc/stalwart/etcd")
    volume = next(v for v in pod["volumes"] if v["name"] == mount["name"])
    paths = {item["path"] for source in volume["projected"]["sources"] for item in source["secret"]["items"]}
    assert paths == {"ca.crt", "tls.crt", "tls.key", "username", "password", "job-tls.crt", "job-tls.key"}


def test_network_policy_admits_only_the_operator_the_jobs_and_the_members(render: Render) -> None:
    docs = render(ETCD)
    policy = one(docs, "NetworkPolicy", "-etcd")
    sts = one(docs, "StatefulSet", "-etcd")
    assert policy["spec"]["podSelector"]["matchLabels"].items() <= sts["spec"]["template"]["metadata"]["labels"].items()
    assert policy["spec"]["policyTypes"] == ["Ingress"]
    client, peer, metrics = policy["spec"]["ingress"]
    assert [p["port"] for p in client["ports"]] == ["client"]
    operator_labels = one(docs, "Deployment", "-operator")["spec"]["template"]["metadata"]["labels"]
    sources = client["from"]
    assert sources[0]["podSelector"]["matchLabels"].items() <= operator_labels.items()
    assert sources[1] == {"namespaceSelector": {}, "podSelector": {"matchExpressions": [
        {"key": naming.LABEL_JOB_NAME, "operator": "Exists"}]}}
    assert len(sources) == 2
    assert [p["port"] for p in peer["ports"]] == ["peer"]
    assert peer["from"][0]["podSelector"]["matchLabels"] == policy["spec"]["podSelector"]["matchLabels"]
    assert [p["port"] for p in metrics["ports"]] == ["metrics"]


def _namespaces(source: dict[str, Any]) -> list[str]:
    (expression,) = source["namespaceSelector"]["matchExpressions"]
    assert expression["key"] == "kubernetes.io/metadata.name" and expression["operator"] == "In"
    return list(expression["values"])


VAP = "admissionregistration.k8s.io/v1/ValidatingAdmissionPolicy"


def test_only_the_operator_may_label_a_pod_as_a_jobs_and_the_metrics_ports_are_fenced(render: Render) -> None:
    """Issue 31, finding 10: etcd admitted any pod labelled stalwart.dev/job-name (in any namespace; the label
    is the pod author's to write) and its metrics port, like the operator's, was open to every pod."""
    values = {**ETCD, "operator": {"watchNamespaces": ["team-a", "team-b"]},
              "metrics": {"enabled": True, "allowedNamespaces": ["monitoring"]}}
    docs = render(values, api_versions=[VAP])
    client, _, metrics = one(docs, "NetworkPolicy", "-etcd")["spec"]["ingress"]
    assert _namespaces(client["from"][1]) == ["team-a", "team-b"]  # only where the operator makes pods
    assert [_namespaces(s) for s in metrics["from"]] == [["monitoring"]]
    # The label that admits a pod is the operator's alone: an admission policy refuses it from anyone else.
    policy = one(docs, "ValidatingAdmissionPolicy", "-job-pod-label")
    (rule,) = policy["spec"]["matchConstraints"]["resourceRules"]
    assert rule["resources"] == ["pods"] and rule["operations"] == ["CREATE", "UPDATE"]
    assert policy["spec"]["failurePolicy"] == "Fail"
    (validation,) = policy["spec"]["validations"]
    operator_sa = _operator(docs)["serviceAccountName"]
    assert validation["expression"].startswith(
        f'request.userInfo.username == "system:serviceaccount:{NAMESPACE}:{operator_sa}"')
    assert f'!("{naming.LABEL_JOB_NAME}" in object.metadata.labels)' in validation["expression"]
    assert validation["reason"] == "Forbidden"
    binding = one(docs, "ValidatingAdmissionPolicyBinding", "-job-pod-label")
    assert binding["spec"] == {"policyName": policy["metadata"]["name"], "validationActions": ["Deny"]}
    # The operator's metrics port: the same namespaces only.
    operator_policy = one(docs, "NetworkPolicy", "-operator-metrics")
    (ingress,) = operator_policy["spec"]["ingress"]
    assert [p["port"] for p in ingress["ports"]] == ["metrics"]
    assert [_namespaces(s) for s in ingress["from"]] == [["monitoring"]]
    assert operator_policy["spec"]["podSelector"]["matchLabels"].items() <= \
        one(docs, "Deployment", "-operator")["spec"]["template"]["metadata"]["labels"].items()
    # Unset, the metrics ports are the release namespace's only; without the API, no policy is rendered.
    plain = render({**ETCD, "metrics": {"enabled": True}})
    assert [_namespaces(s) for s in one(plain, "NetworkPolicy", "-etcd")["spec"]["ingress"][2]["from"]] == [
        [NAMESPACE]]
    assert find(plain, "ValidatingAdmissionPolicy") == []


def test_security_can_be_turned_off_and_certificates_brought(render: Render) -> None:
    plain = render({"etcd": {"enabled": True, "security": {"enabled": False}, "networkPolicy": {"enabled": False}}})
    assert _args(_etcd_container(plain))["listen-client-urls"] == "http://0.0.0.0:2379"
    assert find(plain, "Secret", "-etcd-server-tls") == find(plain, "NetworkPolicy") == []
    assert "STALWART_ETCD_TLS" not in {e["name"] for e in _operator(plain)["containers"][0]["env"]}
    own = render({"etcd": {"enabled": True, "security": {"serverSecret": "etcd-certs", "jobUsers": False}}})
    assert find(own, "Secret", "-etcd-server-tls") == []
    (volume,) = one(own, "StatefulSet", "-etcd")["spec"]["template"]["spec"]["volumes"]
    assert volume["secret"]["secretName"] == "etcd-certs"
    env = {e["name"]: e.get("value") for e in _operator(own)["containers"][0]["env"]}
    assert env["STALWART_JOB_ETCD_USERS"] == "false"
    assert find(render(), "NetworkPolicy") == []  # no bundled etcd, nothing to guard
