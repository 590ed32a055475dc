"""The defaults the operator gives worker pods (locked down where the template says nothing, as written where
it says something) and the Pod Security Standards check of the pods a template makes."""

from __future__ import annotations

from typing import Any

import pytest

from stalwart.cli.operator import pod_security_level
from stalwart.operator.pod_defaults import SHM_VOLUME, PodSecurity, pod_security_problems, with_defaults

BARE: dict[str, Any] = {"containers": [{"name": "trainer", "image": "t"}]}
LOCKED = {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}, "runAsNonRoot": True,
          "seccompProfile": {"type": "RuntimeDefault"}}


def test_a_bare_template_is_locked_down_and_gets_a_memory_backed_shm() -> None:
    spec = with_defaults(BARE, shm_size="3Gi")
    assert spec["automountServiceAccountToken"] is False
    (container,) = spec["containers"]
    assert container["securityContext"] == LOCKED
    assert container["volumeMounts"] == [{"name": SHM_VOLUME, "mountPath": "/dev/shm"}]
    assert spec["volumes"] == [{"name": SHM_VOLUME, "emptyDir": {"medium": "Memory", "sizeLimit": "3Gi"}}]
    assert "securityContext" not in BARE["containers"][0]  # the template itself is not changed
    assert pod_security_problems(spec, PodSecurity.RESTRICTED) == []


def test_init_containers_are_locked_down_too() -> None:
    spec = with_defaults({**BARE, "initContainers": [{"name": "fetch", "image": "f"}]}, shm_size="1Gi")
    assert spec["initContainers"][0]["securityContext"] == LOCKED
    assert pod_security_problems(spec, PodSecurity.RESTRICTED) == []


@pytest.mark.parametrize(("template", "check"), [
    ({"automountServiceAccountToken": True, "containers": [{"name": "c"}]},
     lambda s: s["automountServiceAccountToken"] is True),
    ({"containers": [{"name": "c", "securityContext": {"allowPrivilegeEscalation": True}}]},
     lambda s: s["containers"][0]["securityContext"]["allowPrivilegeEscalation"] is True),
    # capabilities the template adds stay, and every other one is still dropped
    ({"containers": [{"name": "c", "securityContext": {"capabilities": {"add": ["NET_BIND_SERVICE"]}}}]},
     lambda s: s["containers"][0]["securityContext"]["capabilities"] == {"add": ["NET_BIND_SERVICE"],
                                                                         "drop": ["ALL"]}),
    ({"containers": [{"name": "c", "securityContext": {"privileged": True}}]},
     lambda s: s["containers"][0]["securityContext"] == {"privileged": True}),
    # the pod's own securityContext answers for its containers
    ({"securityContext": {"runAsNonRoot": True, "seccompProfile": {"type": "Localhost", "localhostProfile": "p"}},
      "containers": [{"name": "c"}]},
     lambda s: "runAsNonRoot" not in s["containers"][0]["securityContext"]
     and "seccompProfile" not in s["containers"][0]["securityContext"]),
    # a template naming user 0 is not made unrunnable by a runAsNonRoot it did not ask for
    ({"containers": [{"name": "c", "securityContext": {"runAsUser": 0}}]},
     lambda s: "runAsNonRoot" not in s["containers"][0]["securityContext"]),
    ({"containers": [{"name": "c", "volumeMounts": [{"name": "mine", "mountPath": "/dev/shm/"}]}],
      "volumes": [{"name": "mine", "emptyDir": {"medium": "Memory", "sizeLimit": "16Gi"}}]},
     lambda s: [v["name"] for v in s["volumes"]] == ["mine"]
     and s["containers"][0]["volumeMounts"] == [{"name": "mine", "mountPath": "/dev/shm/"}]),
])
def test_what_the_template_says_is_kept(template: dict[str, Any], check: Any) -> None:
    assert check(with_defaults(template, shm_size="1Gi"))


P = "spec.template.spec"
C0 = f"{P}.containers[0].securityContext"


def _c(**context: Any) -> dict[str, Any]:
    return {"containers": [{"name": "c", "image": "i", "securityContext": context}]}


#: (template, level, the field paths refused). Each row is a template as its author wrote it; the operator's
#: defaults are filled in before the check, as for the pods it creates.
ROWS: list[tuple[dict[str, Any], PodSecurity, list[str]]] = [
    (BARE, PodSecurity.RESTRICTED, []),
    ({**BARE, "hostNetwork": False, "hostPID": False}, PodSecurity.RESTRICTED, []),
    (_c(privileged=False), PodSecurity.RESTRICTED, []),
    (_c(capabilities={"add": ["NET_BIND_SERVICE"]}), PodSecurity.RESTRICTED, []),
    (_c(runAsUser=1000), PodSecurity.RESTRICTED, []),
    ({**BARE, "volumes": [{"name": "d", "persistentVolumeClaim": {"claimName": "x"}}]}, PodSecurity.RESTRICTED, []),
    # issue 31, finding 4: each of these was accepted
    (_c(capabilities={"add": ["SYS_ADMIN"]}), PodSecurity.RESTRICTED, [f"{C0}.capabilities.add[0]"]),
    (_c(capabilities={"add": ["NET_RAW"], "drop": []}), PodSecurity.RESTRICTED,
     [f"{C0}.capabilities.add[0]", f"{C0}.capabilities.drop"]),
    (_c(allowPrivilegeEscalation=True), PodSecurity.RESTRICTED, [f"{C0}.allowPrivilegeEscalation"]),
    (_c(runAsUser=0), PodSecurity.RESTRICTED, [f"{C0}.runAsNonRoot", f"{C0}.runAsUser"]),
    (_c(runAsNonRoot=False), PodSecurity.RESTRICTED, [f"{C0}.runAsNonRoot"]),
    ({**BARE, "securityContext": {"runAsUser": 0}}, PodSecurity.RESTRICTED,
     [f"{C0}.runAsNonRoot", f"{P}.securityContext.runAsUser"]),
    ({"containers": [{"name": "c", "ports": [{"containerPort": 80, "hostPort": 80}]}]}, PodSecurity.RESTRICTED,
     [f"{P}.containers[0].ports[0].hostPort"]),
    (_c(seccompProfile={"type": "Unconfined"}), PodSecurity.RESTRICTED, [f"{C0}.seccompProfile.type"]),
    ({**BARE, "securityContext": {"seccompProfile": {"type": "Unconfined"}}}, PodSecurity.RESTRICTED,
     [f"{P}.securityContext.seccompProfile.type"]),
    (_c(procMount="Unmasked"), PodSecurity.RESTRICTED, [f"{C0}.procMount"]),
    ({**BARE, "serviceAccountName": "deployer", "automountServiceAccountToken": True}, PodSecurity.RESTRICTED,
     [f"{P}.automountServiceAccountToken"]),
    ({**BARE, "volumes": [{"name": "t", "projected": {"sources": [{"serviceAccountToken": {"path": "t"}}]}}]},
     PodSecurity.RESTRICTED, [f"{P}.volumes[0].projected.sources[0].serviceAccountToken"]),
    ({**BARE, "volumes": [{"name": "n", "nfs": {"server": "s", "path": "/"}}]}, PodSecurity.RESTRICTED,
     [f"{P}.volumes[0].nfs"]),
    # what asks for the host (the former --restrict-pod-security), at both levels
    ({"containers": [{"name": "a"}, {"name": "b", "securityContext": {"privileged": True}}]},
     PodSecurity.BASELINE, [f"{P}.containers[1].securityContext.privileged"]),
    ({**BARE, "initContainers": [{"name": "i", "securityContext": {"privileged": True}}]}, PodSecurity.BASELINE,
     [f"{P}.initContainers[0].securityContext.privileged"]),
    ({**BARE, "hostNetwork": True, "hostPID": True, "hostIPC": True}, PodSecurity.BASELINE,
     [f"{P}.hostNetwork", f"{P}.hostPID", f"{P}.hostIPC"]),
    ({**BARE, "volumes": [{"name": "data", "emptyDir": {}}, {"name": "h", "hostPath": {"path": "/"}}]},
     PodSecurity.BASELINE, [f"{P}.volumes[1].hostPath"]),
    ({**BARE, "securityContext": {"sysctls": [{"name": "kernel.msgmax", "value": "1"}]}}, PodSecurity.BASELINE,
     [f"{P}.securityContext.sysctls[0].name"]),
    ({**BARE, "volumes": [{"name": "h", "hostPath": {"path": "/"}}]}, PodSecurity.RESTRICTED,
     [f"{P}.volumes[0].hostPath"]),
    # baseline allows what only restricted refuses
    (_c(capabilities={"add": ["CHOWN"]}, runAsUser=0, allowPrivilegeEscalation=True), PodSecurity.BASELINE, []),
    ({**BARE, "automountServiceAccountToken": True}, PodSecurity.BASELINE, []),
    (_c(capabilities={"add": ["SYS_ADMIN"]}), PodSecurity.BASELINE, [f"{C0}.capabilities.add[0]"]),
    (_c(seccompProfile={"type": "Unconfined"}, procMount="Unmasked"), PodSecurity.BASELINE,
     [f"{C0}.procMount", f"{C0}.seccompProfile.type"]),
    # off: nothing is refused
    (_c(privileged=True, capabilities={"add": ["SYS_ADMIN"]}), PodSecurity.OFF, []),
]


@pytest.mark.parametrize(("template", "level", "paths"), ROWS)
def test_the_pod_security_standards_refuse_by_field(template: dict[str, Any], level: PodSecurity,
                                                    paths: list[str]) -> None:
    problems = pod_security_problems(with_defaults(template, shm_size="1Gi"), level)
    assert [path for path, _ in problems] == paths
    assert all("is refused by the Pod Security Standards' " in m and f"--pod-security={level.value}" in m
               for _, m in problems)


def test_the_message_names_the_value_the_control_and_what_is_allowed() -> None:
    ((path, message),) = pod_security_problems(with_defaults(_c(capabilities={"add": ["SYS_ADMIN"]}),
                                                             shm_size="1Gi"), PodSecurity.RESTRICTED)
    assert path == f"{C0}.capabilities.add[0]"
    assert message.startswith("'SYS_ADMIN' is refused by the Pod Security Standards' baseline profile "
                              "(control 'Capabilities'; allowed: one of AUDIT_WRITE, CHOWN")
    assert message.endswith("the operator runs with --pod-security=restricted (the chart's operator.podSecurity)")


def test_apparmor_annotations_of_the_template_are_checked() -> None:
    meta = {"annotations": {"container.apparmor.security.beta.kubernetes.io/c": "unconfined"}}
    problems = pod_security_problems(with_defaults(BARE, shm_size="1Gi"), PodSecurity.BASELINE, meta)
    assert [p for p, _ in problems] == [
        "spec.template.metadata.annotations[container.apparmor.security.beta.kubernetes.io/c]"]


@pytest.mark.parametrize(("level", "restrict", "env", "expected"), [
    (None, None, None, PodSecurity.RESTRICTED),
    ("baseline", None, None, PodSecurity.BASELINE),
    (None, True, None, PodSecurity.RESTRICTED),
    (None, False, None, PodSecurity.OFF),
    (None, None, "false", PodSecurity.OFF),
    ("baseline", True, None, PodSecurity.BASELINE),
    ("off", False, None, PodSecurity.OFF),
])
def test_the_operator_flag_and_the_former_switch(level: str | None, restrict: bool | None, env: str | None,
                                                 expected: PodSecurity) -> None:
    assert pod_security_level(level, restrict, env) == expected


@pytest.mark.parametrize(("level", "restrict"), [("restricted", False), ("off", True)])
def test_contradicting_flags_are_refused(level: str, restrict: bool) -> None:
    with pytest.raises(ValueError, match=r"--pod-security=\w+ contradicts --(no-)?restrict-pod-security"):
        pod_security_level(level, restrict, None)
