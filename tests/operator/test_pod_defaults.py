"""The defaults the operator gives worker pods: locked down where the template says nothing, as written where
it says something."""

from __future__ import annotations

from typing import Any

import pytest

from stalwart.operator.pod_defaults import SHM_VOLUME, privilege_problems, with_defaults

BARE: dict[str, Any] = {"containers": [{"name": "trainer", "image": "t"}]}


def test_a_bare_template_is_locked_down_and_gets_a_memory_backed_shm() -> None:
    spec = with_defaults(BARE, shm_size="3Gi")
    assert spec["automountServiceAccountToken"] is False
    (container,) = spec["containers"]
    assert container["securityContext"] == {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}}
    assert container["volumeMounts"] == [{"name": SHM_VOLUME, "mountPath": "/dev/shm"}]
    assert spec["volumes"] == [{"name": SHM_VOLUME, "emptyDir": {"medium": "Memory", "sizeLimit": "3Gi"}}]
    assert "securityContext" not in BARE["containers"][0]  # the template itself is not changed


@pytest.mark.parametrize(("template", "check"), [
    ({"automountServiceAccountToken": True, "containers": [{"name": "c"}]},
     lambda s: s["automountServiceAccountToken"] is True),
    ({"containers": [{"name": "c", "securityContext": {"allowPrivilegeEscalation": True}}]},
     lambda s: s["containers"][0]["securityContext"]["allowPrivilegeEscalation"] is True),
    ({"containers": [{"name": "c", "securityContext": {"capabilities": {"add": ["SYS_PTRACE"]}}}]},
     lambda s: s["containers"][0]["securityContext"]["capabilities"] == {"add": ["SYS_PTRACE"]}),
    ({"containers": [{"name": "c", "securityContext": {"privileged": True}}]},
     lambda s: s["containers"][0]["securityContext"] == {"privileged": True}),
    ({"containers": [{"name": "c", "volumeMounts": [{"name": "mine", "mountPath": "/dev/shm/"}]}],
      "volumes": [{"name": "mine", "emptyDir": {"medium": "Memory", "sizeLimit": "16Gi"}}]},
     lambda s: [v["name"] for v in s["volumes"]] == ["mine"]
     and s["containers"][0]["volumeMounts"] == [{"name": "mine", "mountPath": "/dev/shm/"}]),
])
def test_what_the_template_says_is_kept(template: dict[str, Any], check: Any) -> None:
    assert check(with_defaults(template, shm_size="1Gi"))


P = "spec.template.spec"


@pytest.mark.parametrize(("template", "paths"), [
    (BARE, []),
    ({**BARE, "hostNetwork": False, "hostPID": False}, []),
    ({"containers": [{"name": "c", "securityContext": {"privileged": False}}]}, []),
    ({"containers": [{"name": "a"}, {"name": "b", "securityContext": {"privileged": True}}]},
     [f"{P}.containers[1].securityContext.privileged"]),
    ({**BARE, "initContainers": [{"name": "i", "securityContext": {"privileged": True}}]},
     [f"{P}.initContainers[0].securityContext.privileged"]),
    ({**BARE, "hostNetwork": True, "hostPID": True, "hostIPC": True},
     [f"{P}.hostNetwork", f"{P}.hostPID", f"{P}.hostIPC"]),
    ({**BARE, "volumes": [{"name": "data", "emptyDir": {}}, {"name": "h", "hostPath": {"path": "/"}}]},
     [f"{P}.volumes[1].hostPath"]),
])
def test_what_asks_for_the_host_is_named_by_its_field(template: dict[str, Any], paths: list[str]) -> None:
    problems = privilege_problems(template)
    assert [path for path, _ in problems] == paths
    assert all("--restrict-pod-security" in message for _, message in problems)
